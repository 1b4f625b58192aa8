"""Build the project's llama.cpp runtime: the llama-cpp-python 0.3.36 sdist + `patches/*.patch`,
and the project's own native side on top of it (`native/`: libclover, libclover-grammar,
`llama-clover-cli`, `test-clover`).

One cmake + ninja build of `native/`, which adds the vendored llama.cpp as a subdirectory (shared
libraries, `test-backend-ops`, `llama-quantize`), then the patched llama-cpp-python *Python
package* is pip-installed with `LLAMA_BUILD=OFF` (no second compile) and the freshly built
libraries are copied into its `llama_cpp/lib`.

Layout under the runtime root (``$CLOVER_GGUF_RUNTIME_DIR``, default ``<cache>/runtime`` with
``<cache>`` = ``$CLOVER_GGUF_CACHE`` or ``~/.cache/clover-gguf``)::

    src/                 the unpacked sdist with the patches applied
    build-cpu/           cmake build tree (build-cuda/ for --cuda), holds stamp.json
    lib/                 libllama.so, libggml*.so of the last successful build
    bin/                 llama-clover-cli, test-backend-ops, test-clover, llama-quantize, ggml-rpc-server
    runtime.json         what runtime_paths() returns (written after each build)

`runtime_paths()` is how other modules find the libraries (e.g. libggml-base for the
converter's quantizer).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CloverError
from ..util import REPO_ROOT, sha256_file

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
DEFAULT_CUDA_ARCHS = "86;89;120;80;90;100"
CPU_TARGETS = (
    "llama",
    "ggml",
    "clover",
    "clover-grammar",
    "llama-clover-cli",
    "test-backend-ops",
    "test-clover",
    "llama-quantize",
)
# llama-quantize: the reference the converter's quantized blocks are compared with (tests/convert);
# clover-grammar: common's JSON-schema converter for the server (no program links it)
RPC_SERVER = "ggml-rpc-server"  # llama.cpp's tools/rpc (rpc-server), built with GGML_RPC
BINARIES = ("llama-clover-cli", "test-backend-ops", "test-clover", "llama-quantize", RPC_SERVER)
CLOVER_SYMBOLS = (
    "clover_gen_default_params",
    "clover_reset",
    "clover_commit",
    "clover_block_logits",
    "clover_generate",
    "clover_get_state",
)
STAMP_VERSION = 1

PATCH_DIR = REPO_ROOT / "patches"
NATIVE_DIR = REPO_ROOT / "native"


class BuildError(CloverError, RuntimeError):
    """A step of the runtime build failed; the message says which and how to fix it."""


# --------------------------------------------------------------------------- paths


def cache_dir() -> Path:
    return Path(os.environ.get("CLOVER_GGUF_CACHE") or Path.home() / ".cache" / "clover-gguf")


def runtime_root() -> Path:
    env = os.environ.get("CLOVER_GGUF_RUNTIME_DIR")
    return Path(env) if env else cache_dir() / "runtime"


def runtime_paths(root: str | Path | None = None) -> dict:
    """Where the built runtime lives: lib_dir (libllama/libggml*.so), bin_dir
    (llama-clover-cli, test-backend-ops), stamp (the stamp of the build that filled them,
    None before the first build), plus root, src_dir and the installed llama_cpp lib dir
    (llama_cpp_lib_dir, None when llama_cpp is not installed)."""
    root = Path(root) if root else runtime_root()
    info = {
        "root": root,
        "lib_dir": root / "lib",
        "bin_dir": root / "bin",
        "src_dir": root / "src",
        "stamp": None,
        "build_dir": None,
        "llama_cpp_lib_dir": installed_llama_cpp_lib_dir(),
    }
    rj = root / "runtime.json"
    if rj.exists():
        try:
            data = json.loads(rj.read_text())
            info["stamp"] = Path(data["stamp"]) if data.get("stamp") else None
            info["build_dir"] = Path(data["build_dir"]) if data.get("build_dir") else None
        except (ValueError, KeyError):
            pass
    return info


def installed_llama_cpp_lib_dir() -> Path | None:
    """llama_cpp/lib of the installed llama-cpp-python, found without importing it (the
    import loads libllama)."""
    try:
        spec = importlib.util.find_spec("llama_cpp")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


# --------------------------------------------------------------------------- helpers


def _log(msg: str) -> None:
    print(f"[build-runtime] {msg}", flush=True)


def patch_series(patch_dir: Path = PATCH_DIR) -> list[Path]:
    return sorted(patch_dir.glob("*.patch")) if patch_dir.is_dir() else []


def series_hash(patches: list[Path]) -> str:
    h = hashlib.sha256()
    for p in patches:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def native_hash(native_dir: Path = NATIVE_DIR) -> str:
    """The native side's sources, for the build stamp."""
    return series_hash(sorted(p for p in native_dir.iterdir() if p.is_file()))


def _run(
    cmd: list[str], cwd: Path | None = None, env: dict | None = None, what: str = "", capture: bool = False
) -> subprocess.CompletedProcess:
    _log("$ " + " ".join(str(c) for c in cmd))
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, text=True, capture_output=capture)
    if r.returncode != 0:
        tail = ""
        if capture:
            tail = "\n" + "\n".join((r.stdout + r.stderr).splitlines()[-40:])
        raise BuildError(f"{what or cmd[0]} failed (exit {r.returncode}){tail}")
    return r


def _same_file(a: Path, b: Path) -> bool:
    """Same content (following symlinks); False if either is missing."""
    if not a.exists() or not b.exists():
        return False
    return a.stat().st_size == b.stat().st_size and sha256_file(a) == sha256_file(b)


def find_ccache() -> str | None:
    c = shutil.which("ccache") or shutil.which("sccache")
    if c:
        return c
    local = Path(sys.executable).parent / "ccache"
    return str(local) if local.exists() else None


def cpu_fingerprint() -> str:
    """The CPU model and its instruction-set flags: a native build is only valid on a CPU with
    the same ones."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    keep = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return hashlib.sha256("\n".join(keep).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- steps


def fetch_sdist(dest: Path | None = None) -> Path:
    """The llama-cpp-python sdist, downloaded with pip into the cache (or taken from
    $CLOVER_GGUF_SDIST), sha256-checked."""
    env_path = os.environ.get("CLOVER_GGUF_SDIST")
    if env_path:
        path = Path(env_path)
    else:
        dest = dest or cache_dir()
        dest.mkdir(parents=True, exist_ok=True)
        path = dest / SDIST_NAME
        if not path.exists() or sha256_file(path) != SDIST_SHA256:
            _run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--no-binary",
                    ":all:",
                    f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
                    "-d",
                    dest,
                ],
                what="pip download llama-cpp-python",
            )
    if not path.exists():
        raise BuildError(f"sdist not found at {path}")
    got = sha256_file(path)
    if got != SDIST_SHA256:
        raise BuildError(f"{path}: sha256 {got} != expected {SDIST_SHA256}; delete it and retry")
    return path


def extract_tar(tf: tarfile.TarFile, dest: Path, members=None) -> None:
    """extractall with the "data" filter where this Python has it (3.11.4+); the sdist is pinned
    by its sha256, so older 3.11s extract it as it is."""
    if hasattr(tarfile, "data_filter"):
        tf.extractall(dest, members=members, filter="data")
    else:
        tf.extractall(dest, members=members)


def unpack_sdist(sdist: Path, dest: Path) -> Path:
    """Unpack into dest (removed first); returns dest (the sdist's top folder)."""
    if dest.exists():
        shutil.rmtree(dest)
    tmp = dest.parent / (dest.name + ".unpack")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    with tarfile.open(sdist) as tf:
        extract_tar(tf, tmp)
    (top,) = list(tmp.iterdir())
    top.rename(dest)
    tmp.rmdir()
    return dest


def _git_env(tree: Path) -> dict:
    env = dict(os.environ)
    # the sdist ships its own .git; never let git climb above it into an enclosing repository
    # (git apply would then silently skip paths outside that repository's cwd)
    env["GIT_CEILING_DIRECTORIES"] = str(tree.parent)
    return env


def _patch_paths(p: Path) -> list[str]:
    out = []
    for line in p.read_text(errors="replace").splitlines():
        if line.startswith("diff --git a/"):
            out.append(line.split()[2][2:])
    return out


def _relative_to_llama_cpp(tree: Path, paths: list[str]) -> bool:
    """Are a patch's paths relative to vendor/llama.cpp (git format-patch in the submodule)
    rather than to the sdist root?"""
    if not paths or any(x.startswith(("vendor/", "llama_cpp/")) for x in paths):
        return False
    vend = tree / "vendor" / "llama.cpp"
    if any((vend / x).exists() for x in paths):
        return True
    return not any((tree / x).exists() for x in paths)


def apply_patches(tree: Path, patches: list[Path], check_only: bool = False) -> None:
    """git apply each patch in order (paths relative to the sdist root, or to vendor/llama.cpp:
    then applied with --directory=vendor/llama.cpp). BuildError names the first that fails.
    check_only: only `git apply --check` each one (later patches may depend on earlier ones, so
    this is only exact for the first; the test applies them for real in a scratch unpack)."""
    for i, p in enumerate(patches):
        extra = ["--directory=vendor/llama.cpp"] if _relative_to_llama_cpp(tree, _patch_paths(p)) else []
        base = ["git", "apply", "--whitespace=nowarn"] + extra
        r = subprocess.run(base + ["--check", str(p)], cwd=tree, env=_git_env(tree), text=True, capture_output=True)
        if r.returncode == 0 and not check_only:
            r = subprocess.run(base + [str(p)], cwd=tree, env=_git_env(tree), text=True, capture_output=True)
        if r.returncode != 0:
            raise BuildError(
                f"patch {p.name} does not apply to a fresh {SDIST_NAME} unpack "
                f"after {i} earlier patch(es) of the series:\n{r.stderr.strip()}"
            )
        if not check_only:
            _log(f"applied {p.name}")


def sync_tree(new: Path, old: Path) -> int:
    """Make `old` identical to `new`, touching only files that differ (so ninja rebuilds only
    what a patch changed). Returns the number of files written or removed."""
    n = 0
    new_files = {p.relative_to(new) for p in new.rglob("*") if p.is_file() or p.is_symlink()}
    old_files = {p.relative_to(old) for p in old.rglob("*") if p.is_file() or p.is_symlink()} if old.exists() else set()
    for rel in old_files - new_files:
        (old / rel).unlink()
        n += 1
    for rel in new_files:
        src, dst = new / rel, old / rel
        if dst.exists() and not dst.is_symlink() and not src.is_symlink():
            if src.stat().st_size == dst.stat().st_size and src.read_bytes() == dst.read_bytes():
                continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.exists() or dst.is_symlink():
            dst.unlink()
        shutil.copy2(src, dst, follow_symlinks=False)
        n += 1
    return n


# ggml's AMX kernels stopped a native build with SIGILL (tilezero in tinygemm_kernel_amx, every
# quantized matmul) on a 2-vCPU VM whose CPUID reports amx_tile/amx_int8, while a plain tile
# program ran there: a native build leaves them out (-U the macros -march=native defines)
NATIVE_CPU_FLAGS = "-U__AMX_TILE__ -U__AMX_INT8__ -U__AMX_BF16__"


@dataclass
class BuildOptions:
    cuda: bool = False
    cuda_archs: str = DEFAULT_CUDA_ARCHS
    jobs: int | None = None
    targets: tuple[str, ...] | None = None  # None: CPU_TARGETS (+ ggml-cuda)
    force: bool = False
    install: bool = True  # pip-install the Python package + copy the libs
    extra_cmake_args: tuple[str, ...] = ()
    ccache: bool = True
    portable: bool = False  # False: CPU kernels for this machine (-march=native), as llama.cpp builds by default
    # llama.cpp's RPC backend (ggml-rpc, one file) and its server: on by default so that every
    # build (CI's too) can offload to rpc-servers and the suite tests it
    rpc: bool = True

    def key(self) -> dict:
        return {
            "portable": self.portable,
            "rpc": self.rpc,
            "cpu": None if self.portable else cpu_fingerprint(),
            "cpu_flags": None if self.portable else NATIVE_CPU_FLAGS,
            "cuda": self.cuda,
            "cuda_archs": self.cuda_archs if self.cuda else None,
            "targets": list(self.resolved_targets()),
            "extra": list(self.extra_cmake_args),
        }

    def resolved_targets(self) -> tuple[str, ...]:
        if self.targets:
            return tuple(self.targets)
        return CPU_TARGETS + ((RPC_SERVER,) if self.rpc else ()) + (("ggml-cuda",) if self.cuda else ())


def cmake_args(src: Path, build: Path, opts: BuildOptions) -> list[str]:
    args = [
        "cmake",
        "-S",
        NATIVE_DIR,
        f"-DLLAMA_CPP_DIR={src / 'vendor' / 'llama.cpp'}",
        "-B",
        build,
        "-G",
        "Ninja",
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=ON",
        f"-DGGML_NATIVE={'OFF' if opts.portable else 'ON'}",
        "-DLLAMA_BUILD_COMMON=ON",
        "-DLLAMA_BUILD_TESTS=ON",
        "-DLLAMA_BUILD_TOOLS=ON",  # for llama-quantize; only the targets named are compiled
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_SERVER=OFF",
        "-DLLAMA_BUILD_APP=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_CURL=OFF",
        f"-DGGML_RPC={'ON' if opts.rpc else 'OFF'}",  # tools/rpc (rpc-server) with the tools
        # the libraries are copied next to each other (lib/, llama_cpp/lib) and the
        # programs to bin/: find them through $ORIGIN wherever they end up
        "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
        "-DCMAKE_INSTALL_RPATH=$ORIGIN;$ORIGIN/../lib",
    ]
    if not opts.portable:
        args += [f"-DCMAKE_C_FLAGS={NATIVE_CPU_FLAGS}", f"-DCMAKE_CXX_FLAGS={NATIVE_CPU_FLAGS}"]
    cc = find_ccache() if opts.ccache else None
    if cc:
        args += ["-DGGML_CCACHE=OFF", f"-DCMAKE_C_COMPILER_LAUNCHER={cc}", f"-DCMAKE_CXX_COMPILER_LAUNCHER={cc}"]
        if opts.cuda:
            args.append(f"-DCMAKE_CUDA_COMPILER_LAUNCHER={cc}")
    else:
        args.append("-DGGML_CCACHE=OFF")
    if opts.cuda:
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={opts.cuda_archs}", "-DGGML_CUDA_FA=OFF"]
    else:
        args.append("-DGGML_CUDA=OFF")
    return [str(a) for a in args] + list(opts.extra_cmake_args)


def _build_env(root: Path) -> dict:
    env = dict(os.environ)
    env.setdefault("CCACHE_BASEDIR", str(root))
    env.setdefault("CCACHE_NOHASHDIR", "1")
    env.setdefault("CCACHE_DIR", str(cache_dir() / "ccache"))
    return env


def _ninja_targets(build: Path) -> set[str]:
    r = subprocess.run(["ninja", "-C", str(build), "-t", "targets", "all"], text=True, capture_output=True)
    return {line.split(":")[0] for line in r.stdout.splitlines()}


def copy_outputs(build: Path, lib_dir: Path, bin_dir: Path | None) -> list[str]:
    """Copy lib*.so* (keeping the soname symlinks) and the programs. Returns lib names."""
    out_bin = build / "bin"
    lib_dir.mkdir(parents=True, exist_ok=True)
    names = []
    for p in sorted(out_bin.glob("lib*.so*")):
        dst = lib_dir / p.name
        if dst.exists() or dst.is_symlink():
            dst.unlink()
        shutil.copy2(p, dst, follow_symlinks=False)
        names.append(p.name)
    if bin_dir is not None:
        bin_dir.mkdir(parents=True, exist_ok=True)
        for name in BINARIES:
            p = out_bin / name
            if p.exists():
                dst = bin_dir / name
                if dst.exists():
                    dst.unlink()
                shutil.copy2(p, dst)
    return names


def install_python_package(src: Path, build: Path) -> Path:
    """pip-install the patched llama-cpp-python without compiling llama.cpp (LLAMA_BUILD=OFF),
    then copy the built libraries into its llama_cpp/lib."""
    env = dict(os.environ)
    env["CMAKE_ARGS"] = "-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"
    env.pop("LLAMA_CPP_LIB_PATH", None)
    # uninstall first rather than --force-reinstall, which would also reinstall numpy & co.;
    # its few pure-Python deps (diskcache, typing-extensions, jinja2, numpy) are installed if missing
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "llama_cpp_python"], capture_output=True, text=True)
    _run(
        [sys.executable, "-m", "pip", "install", "--no-cache-dir", str(src)],
        env=env,
        what="pip install llama-cpp-python (Python package only)",
    )
    lib = installed_llama_cpp_lib_dir()
    if lib is None:
        raise BuildError("llama_cpp is not importable after pip install")
    for old in lib.glob("lib*.so*") if lib.exists() else []:
        old.unlink()
    copy_outputs(build, lib, None)
    return lib


def verify_install(require_clover: bool) -> dict:
    """Import llama_cpp in a fresh interpreter and look up the clover_* symbols in libclover (the
    generation library beside libllama)."""
    code = (
        "import ctypes, json, pathlib, llama_cpp\nfrom llama_cpp.llama_cpp import _lib\n"
        f"syms = {list(CLOVER_SYMBOLS)!r}\n"
        "p = pathlib.Path(getattr(_lib, '_name', '')).parent / 'libclover.so'\n"
        "lib = ctypes.CDLL(str(p)) if p.exists() else None\n"
        "print(json.dumps({'version': llama_cpp.__version__, 'lib': str(p),"
        " 'missing': [s for s in syms if lib is None or not hasattr(lib, s)]}))"
    )
    env = dict(os.environ)
    env.pop("LLAMA_CPP_LIB_PATH", None)
    r = subprocess.run([sys.executable, "-c", code], text=True, capture_output=True, env=env, cwd=str(Path.home()))
    if r.returncode != 0:
        raise BuildError(f"`import llama_cpp` fails after the install:\n{r.stderr[-3000:]}")
    info = json.loads(r.stdout.strip().splitlines()[-1])
    if info["missing"]:
        msg = f"libclover ({info['lib']}) does not export {', '.join(info['missing'])}"
        if require_clover:
            raise BuildError(msg + " (is the patch series complete?)")
        _log("warning: " + msg + " (no patches applied?)")
    return info


# --------------------------------------------------------------------------- main entry


@dataclass
class BuildResult:
    root: Path
    src_dir: Path
    build_dir: Path
    lib_dir: Path
    bin_dir: Path
    llama_cpp_lib_dir: Path | None
    stamp: Path
    skipped: bool
    seconds: dict = field(default_factory=dict)
    patches: list[str] = field(default_factory=list)


@dataclass
class RuntimeDirs:
    """The folders of one runtime root (see the module docstring)."""

    root: Path
    src: Path
    build: Path
    lib_dir: Path
    bin_dir: Path

    @classmethod
    def under(cls, root: Path, cuda: bool) -> RuntimeDirs:
        return cls(root, root / "src", root / ("build-cuda" if cuda else "build-cpu"), root / "lib", root / "bin")

    @property
    def stamp_path(self) -> Path:
        return self.build / "stamp.json"


@contextmanager
def _timed(times: dict[str, float], step: str):
    """Record the wall time of a step in `times` (not when it raises)."""
    t = time.perf_counter()
    yield
    times[step] = time.perf_counter() - t


def build_runtime(
    cuda: bool = False,
    cuda_archs: str | None = None,
    jobs: int | None = None,
    force: bool = False,
    targets: list[str] | tuple[str, ...] | None = None,
    install: bool = True,
    root: str | Path | None = None,
    patch_dir: str | Path | None = None,
    extra_cmake_args=(),
    portable: bool = False,
    rpc: bool = True,
) -> BuildResult:
    """Fetch, patch, build and install the runtime (see the module docstring). Skips the
    compile when the sdist, the patch series and the options match the build dir's stamp.
    The CPU kernels are built for this machine's instruction set unless `portable`."""
    opts = BuildOptions(
        portable=portable,
        rpc=rpc,
        cuda=cuda,
        cuda_archs=cuda_archs or DEFAULT_CUDA_ARCHS,
        jobs=jobs,
        targets=tuple(targets) if targets else None,
        force=force,
        install=install,
        extra_cmake_args=tuple(extra_cmake_args),
    )
    dirs = RuntimeDirs.under(Path(root) if root else runtime_root(), cuda)
    dirs.root.mkdir(parents=True, exist_ok=True)
    pdir = Path(patch_dir) if patch_dir else PATCH_DIR
    patches = patch_series(pdir)
    times: dict[str, float] = {}
    t_all = time.perf_counter()

    with _timed(times, "fetch"):
        sdist = fetch_sdist()
    stamp = build_stamp(dirs, opts, patches)
    _log(f"sdist {sdist} (sha256 ok); {len(patches)} patch(es) in {pdir}")

    partial = opts.targets is not None and "llama" not in opts.targets  # e.g. --targets ggml-cuda
    up_to_date = not opts.force and stamp_matches(dirs, stamp, partial)
    if up_to_date:
        _log(f"up to date (stamp {dirs.stamp_path}); --force rebuilds")
    else:
        _compile(sdist, patches, dirs, opts, times)
        if not partial and (dirs.build / "bin" / "libllama.so").exists():
            for d in (dirs.lib_dir, dirs.bin_dir):
                if d.exists():
                    shutil.rmtree(d)
            copy_outputs(dirs.build, dirs.lib_dir, dirs.bin_dir)
        stamp["seconds"] = {k: round(v, 1) for k, v in times.items()}
        dirs.stamp_path.write_text(json.dumps(stamp, indent=1))

    llama_lib = installed_llama_cpp_lib_dir()
    if partial:
        times["total"] = time.perf_counter() - t_all
        _log(f"partial build ({', '.join(opts.resolved_targets())}) in {dirs.build}: not installed")
        _log("  seconds            " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))
        return _result(dirs, llama_lib, up_to_date, times, patches)
    if opts.install and (dirs.lib_dir / "libllama.so").exists():
        with _timed(times, "install"):
            llama_lib = _install(dirs, llama_lib, reinstall=not up_to_date, require_clover=bool(patches))
    times["total"] = time.perf_counter() - t_all
    _write_runtime_json(dirs, cuda)
    res = _result(dirs, llama_lib, up_to_date, times, patches)
    _log("runtime:")
    for k in ("src_dir", "build_dir", "lib_dir", "bin_dir", "llama_cpp_lib_dir", "stamp"):
        _log(f"  {k:18s} {getattr(res, k)}")
    _log("  seconds            " + ", ".join(f"{k} {v}" for k, v in res.seconds.items()))
    return res


def build_stamp(dirs: RuntimeDirs, opts: BuildOptions, patches: list[Path]) -> dict:
    """What a build depends on; a build dir whose stamp.json holds the same is up to date."""
    return {
        "version": STAMP_VERSION,
        "sdist_sha256": SDIST_SHA256,
        "patches": [p.name for p in patches],
        "series_sha256": series_hash(patches),
        "native_sha256": native_hash(),
        "options": opts.key(),
        "cmake_args": [a for a in cmake_args(dirs.src, dirs.build, opts) if "LAUNCHER" not in a],
    }


def stamp_matches(dirs: RuntimeDirs, stamp: dict, partial: bool) -> bool:
    """The build dir's stamp holds `stamp` and (for a full build) lib/ holds its libllama."""
    try:
        old = json.loads(dirs.stamp_path.read_text()) if dirs.stamp_path.exists() else None
    except ValueError:
        old = None
    return (
        old is not None
        and {k: old.get(k) for k in stamp} == stamp
        and (partial or _same_file(dirs.lib_dir / "libllama.so", dirs.build / "bin" / "libllama.so"))
    )


def cmake_cache_value(build: Path, name: str) -> str | None:
    """An entry of a cmake build dir's CMakeCache.txt (None: not configured, or no such entry)."""
    cache = build / "CMakeCache.txt"
    if not cache.exists():
        return None
    for line in cache.read_text(errors="replace").splitlines():
        if line.startswith(f"{name}:"):
            return line.split("=", 1)[1]
    return None


def _configured_source(build: Path) -> Path | None:
    """The source tree a cmake build dir was configured from (None: not configured)."""
    home = cmake_cache_value(build, "CMAKE_HOME_DIRECTORY")
    return Path(home).resolve() if home else None


def _compile(sdist: Path, patches: list[Path], dirs: RuntimeDirs, opts: BuildOptions, times: dict) -> None:
    """Unpack + patch into src/, configure, and build the targets with ninja (the stamp is
    removed first: a failed build leaves none)."""
    # 1. a fresh unpack with the series applied, synced into src/ (only changed files touched)
    with _timed(times, "unpack+patch"):
        fresh = unpack_sdist(sdist, dirs.root / "src.fresh")
        apply_patches(fresh, patches)
        if dirs.src.exists():
            n = sync_tree(fresh, dirs.src)
            shutil.rmtree(fresh)
            _log(f"src/ synced ({n} file(s) changed)")
        else:
            fresh.rename(dirs.src)

    # 2. configure (always: cheap, and picks up new files such as src/models/clover.cpp)
    env = _build_env(dirs.root)
    with _timed(times, "configure"):
        if dirs.stamp_path.exists():
            dirs.stamp_path.unlink()
        if _configured_source(dirs.build) not in (None, NATIVE_DIR.resolve()):
            _log(f"{dirs.build} was configured from another source tree: starting it again")
            shutil.rmtree(dirs.build)
        _run(cmake_args(dirs.src, dirs.build, opts), env=env, what="cmake configure", capture=True)

    # 3. build the targets that exist (a target missing from the tree is named and skipped)
    have = _ninja_targets(dirs.build)
    tg = [x for x in opts.resolved_targets() if x in have]
    missing = [x for x in opts.resolved_targets() if x not in have]
    if missing:
        _log(f"warning: no target(s) {', '.join(missing)} in this tree; building {', '.join(tg)}")
    with _timed(times, "compile"):
        jobs = ["-j", str(opts.jobs)] if opts.jobs else []
        _run(["ninja", "-C", dirs.build] + jobs + tg, env=env, what="ninja build")


def _install(dirs: RuntimeDirs, llama_lib: Path | None, reinstall: bool, require_clover: bool) -> Path | None:
    """pip-install the Python package when the build changed or its libllama differs from
    lib/'s, then check it imports. Returns its llama_cpp/lib."""
    needs = (
        reinstall
        or llama_lib is None
        or not (llama_lib / "libllama.so").exists()
        or sha256_file(llama_lib / "libllama.so") != sha256_file(dirs.lib_dir / "libllama.so")
    )
    if needs:
        llama_lib = install_python_package(dirs.src, dirs.build)
    info = verify_install(require_clover=require_clover)
    _log(f"llama_cpp {info['version']} imports; libclover: {info['lib']}")
    return llama_lib


def _write_runtime_json(dirs: RuntimeDirs, cuda: bool) -> None:
    """What runtime_paths() reads."""
    info = {
        "lib_dir": str(dirs.lib_dir),
        "bin_dir": str(dirs.bin_dir),
        "stamp": str(dirs.stamp_path),
        "build_dir": str(dirs.build),
        "src_dir": str(dirs.src),
        "cuda": cuda,
    }
    (dirs.root / "runtime.json").write_text(json.dumps(info, indent=1))


def _result(
    dirs: RuntimeDirs, llama_lib: Path | None, skipped: bool, times: dict[str, float], patches: list[Path]
) -> BuildResult:
    return BuildResult(
        root=dirs.root,
        src_dir=dirs.src,
        build_dir=dirs.build,
        lib_dir=dirs.lib_dir,
        bin_dir=dirs.bin_dir,
        llama_cpp_lib_dir=llama_lib,
        stamp=dirs.stamp_path,
        skipped=skipped,
        seconds={k: round(v, 1) for k, v in times.items()},
        patches=[p.name for p in patches],
    )
