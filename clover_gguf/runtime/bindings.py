"""ctypes bindings: the clover_* C API (native/clover.h, exported by libclover, the project's own
generation library beside libllama, on llama.h's public API) on top of
llama-cpp-python's own bindings (`llama_cpp.llama_cpp`: `_lib`, `ctypes_function`), plus the
few llama_cpp pieces the runtime needs that 0.3.36 leaves unbound or typed as void*
(tensor buffer-type overrides, the CPU buffer type).

Importing this module loads libllama (through llama_cpp). `load()` raises RuntimeNotBuilt with
the command to run when llama_cpp, libclover or its clover_* symbols are missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import socket
import sys
from pathlib import Path

from ..errors import CloverError

llama_token = ctypes.c_int32


class RuntimeNotBuilt(CloverError, RuntimeError):
    """llama-cpp-python with the Clover patches is not installed in this environment."""


HINT = (
    "build it with `clover-gguf runtime build`, "
    "which applies patches/*.patch to llama-cpp-python 0.3.36 and installs it here"
)


# --------------------------------------------------------------------------- C structs


class clover_gen_params(ctypes.Structure):
    _fields_ = [
        ("block_size", ctypes.c_int32),
        ("steps", ctypes.c_int32),  # 0 = use threshold
        ("threshold", ctypes.c_float),
        ("temperature", ctypes.c_float),
        ("top_k", ctypes.c_int32),
        ("top_p", ctypes.c_float),
        ("seed", ctypes.c_uint32),
        ("max_new_tokens", ctypes.c_int32),
    ]


class clover_block_stats(ctypes.Structure):
    _fields_ = [
        ("block_index", ctypes.c_int32),
        ("n_tokens", ctypes.c_int32),
        ("n_steps", ctypes.c_int32),
        ("tokens_per_step", ctypes.POINTER(ctypes.c_int32)),
        ("ms_per_step", ctypes.POINTER(ctypes.c_float)),
        ("tokens", ctypes.POINTER(llama_token)),
        ("probs", ctypes.POINTER(ctypes.c_float)),
        ("n_top", ctypes.c_int32),
        ("top_tokens", ctypes.POINTER(llama_token)),
        ("top_probs", ctypes.POINTER(ctypes.c_float)),
    ]


clover_block_cb = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.POINTER(clover_block_stats), ctypes.c_void_p)


clover_seq_block_cb = ctypes.CFUNCTYPE(
    ctypes.c_bool, ctypes.c_int32, ctypes.POINTER(clover_block_stats), ctypes.c_void_p
)


clover_step_cb = ctypes.CFUNCTYPE(
    ctypes.c_bool, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(llama_token), ctypes.c_int32, ctypes.c_void_p
)


# clover.h's enum clover_status
CLOVER_ERR_ARG = -1
CLOVER_ERR_NONFINITE = -6
CLOVER_MAX_TOP_PROBS = 64


class clover_perf(ctypes.Structure):
    _fields_ = [
        ("t_prompt_ms", ctypes.c_double),
        ("n_prompt", ctypes.c_int32),
        ("t_gen_ms", ctypes.c_double),
        ("n_gen", ctypes.c_int32),
        ("n_steps", ctypes.c_int32),
        ("n_blocks", ctypes.c_int32),
        ("t_commit_ms", ctypes.c_double),
        ("t_step_graph_ms", ctypes.c_double),
        ("t_step_compute_ms", ctypes.c_double),
        ("t_step_host_ms", ctypes.c_double),
        ("t_step_other_ms", ctypes.c_double),
        ("n_step_graphs", ctypes.c_int32),
        ("n_steps_device", ctypes.c_int32),
    ]


class llama_model_tensor_buft_override(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


# --------------------------------------------------------------------------- loading


def _signatures() -> dict:
    """name -> (argtypes, restype) of every function bound: clover_* from libclover, the rest
    from libllama."""
    u64, f32, i32, vp = ctypes.c_uint64, ctypes.c_float, ctypes.c_int32, ctypes.c_void_p
    ctx_p, tok_p = vp, ctypes.POINTER(llama_token)
    return {
        "clover_gen_default_params": ([], clover_gen_params),
        "clover_model_block_size": ([vp], i32),
        "clover_reset": ([ctx_p], i32),
        "clover_n_committed": ([ctx_p], i32),
        "clover_commit": ([ctx_p, tok_p, i32, i32], i32),
        "clover_block_logits": ([ctx_p, tok_p, i32, ctypes.POINTER(f32)], i32),
        "clover_generate": ([ctx_p, tok_p, i32, clover_gen_params, tok_p, i32, clover_block_cb, vp], i32),
        "clover_generate_ex": (
            [ctx_p, tok_p, i32, clover_gen_params, tok_p, i32, clover_block_cb, clover_step_cb, vp],
            i32,
        ),
        "clover_get_state": ([ctx_p, i32, ctypes.POINTER(f32), ctypes.c_size_t], i32),
        "clover_sampler_init_pick": ([vp, f32], vp),
        "clover_block_candidates": ([ctx_p, vp, tok_p, i32, u64, tok_p, ctypes.POINTER(f32)], i32),
        "llama_set_sampler": ([ctx_p, i32, vp], ctypes.c_bool),
        "llama_sampler_free": ([vp], None),
        "clover_get_perf": ([ctx_p, ctypes.POINTER(clover_perf)], i32),
        "clover_perf_reset": ([ctx_p], None),
        "clover_batch_init": ([ctx_p], vp),
        "clover_batch_free": ([vp], None),
        "clover_batch_add": ([vp, i32, tok_p, i32, clover_gen_params, ctypes.c_bool], i32),
        "clover_batch_step": ([vp, clover_seq_block_cb, vp], i32),
        "clover_batch_remove": ([vp, i32], i32),
        "clover_batch_tokens": ([vp, i32, tok_p, i32], i32),
        "clover_batch_set_constraint": ([vp, i32, vp], i32),
        "clover_batch_set_triggers": ([vp, i32, tok_p, i32], i32),
        "clover_batch_set_top_probs": ([vp, i32, i32], i32),
        "clover_batch_set_block": ([vp, i32, tok_p, i32], i32),
        "clover_batch_set_bias": ([vp, i32, vp], i32),
        "clover_batch_set_pick": ([vp, i32, vp], i32),
        "clover_batch_on_host": ([vp, i32], i32),
        "clover_step_key": ([u64, i32, i32], u64),
        "clover_row_key": ([u64, i32], u64),
    }


class _Lib:
    """The bound functions: `lc` is llama_cpp.llama_cpp, the clover_* functions (libclover, next
    to libllama) and the few llama_* ones llama_cpp leaves unbound are attributes."""

    def __init__(self):
        try:
            import llama_cpp.llama_cpp as lc
        except (ImportError, OSError, RuntimeError, FileNotFoundError) as e:
            raise RuntimeNotBuilt(f"llama_cpp cannot be imported ({e}); {HINT}") from None
        self.lc = lc
        self.lib = lc._lib
        self.lib_path = Path(getattr(lc._lib, "_name", "") or "")
        clover_path = self.lib_path.parent / "libclover.so"
        try:
            self.clover = ctypes.CDLL(str(clover_path))
        except OSError as e:
            raise RuntimeNotBuilt(f"{clover_path}: {e}; {HINT}") from None
        missing = []
        sigs = _signatures()
        for name, (argtypes, restype) in sigs.items():
            fn = getattr(self.clover if name.startswith("clover_") else self.lib, name, None)
            if fn is None:
                missing.append(name)
                continue
            fn.argtypes, fn.restype = argtypes, restype
            setattr(self, name, fn)
        if missing:
            raise RuntimeNotBuilt(
                f"{clover_path} or {self.lib_path.name} does not export {', '.join(missing)}: the "
                f"installed llama-cpp-python is not the patched one; {HINT}"
            )
        self._cpu_buft = None

    # ggml pieces ---------------------------------------------------------------------
    def cpu_buffer_type(self) -> int:
        """ggml_backend_cpu_buffer_type() from libggml-cpu next to libllama."""
        if self._cpu_buft is None:
            d = self.lib_path.parent
            cpu = ctypes.CDLL(str(d / "libggml-cpu.so") if (d / "libggml-cpu.so").exists() else "libggml-cpu.so")
            fn = cpu.ggml_backend_cpu_buffer_type
            fn.argtypes, fn.restype = [], ctypes.c_void_p
            self._cpu_buft = fn()
        return self._cpu_buft


_LIB: _Lib | None = None


def load() -> _Lib:
    global _LIB
    if _LIB is None:
        _LIB = _Lib()
        _LIB.lc.llama_backend_init()
    return _LIB


GGML_LOG_LEVEL_ERROR, GGML_LOG_LEVEL_CONT = 4, 5


_OVERRIDE_LINE = re.compile(r"tensor (\S+) \(.*\) buffer type overridden to (\S+)")
# the lines of a load that say where weights, memory and compute buffers went (parse_placement)
PLACEMENT_MARKS = ("assigned to device", "offloaded ", "model buffer size", "RS buffer size", "compute buffer size")


class LogCapture:
    """llama.cpp's log, kept (the last lines) so that a failing call can be explained in one
    line; printed as it comes when verbose (CLOVER_GGUF_VERBOSE=1 or --debug). The placement
    lines of a load are kept apart (a large model logs more lines than the window holds)."""

    def __init__(self, maxlen: int = 200):
        import collections

        self.lines: collections.deque[tuple[int, str]] = collections.deque(maxlen=maxlen)
        self.placement: list[str] = []
        self.verbose = bool(os.environ.get("CLOVER_GGUF_VERBOSE"))
        # tensor -> buffer type, from the loader's "buffer type overridden" lines (every one,
        # whatever the deque keeps)
        self.overrides: dict[str, str] = {}

    def __call__(self, level: int, text: bytes, _user) -> None:
        t = (text or b"").decode("utf-8", "replace")
        if self.verbose:
            sys.stderr.write(t)
        m = _OVERRIDE_LINE.match(t)
        if m:
            self.overrides[m.group(1)] = m.group(2)
        if level == GGML_LOG_LEVEL_CONT and self.lines:
            lv, prev = self.lines[-1]
            self.lines[-1] = (lv, prev + t)
        else:
            self.lines.append((level, t))
            if any(m in t for m in PLACEMENT_MARKS):
                self.placement.append(t.strip())

    def mark(self) -> int:
        """A position: reason() only looks at what was logged after it."""
        self.lines.clear()
        return 0

    def reason(self) -> str | None:
        """Why llama.cpp failed (llama-clover-cli picks the same line): the text of its "error
        loading model: ..." line, or, when that only says the GGUF could not be parsed, or is
        missing, the first error logged (without its function name)."""
        errors = [t.strip() for lv, t in self.lines if lv == GGML_LOG_LEVEL_ERROR and t.strip()]
        plain = [t.split(": ", 1)[1] if ": " in t else t for t in errors if "error loading model: " not in t]
        for t in reversed(errors):
            if "error loading model: " in t:
                why = t.split("error loading model: ", 1)[1]
                why = why.removeprefix("error loading model hyperparameters: ")  # the clover validation's
                if why.startswith("llama_model_loader: failed to load model from") and plain:
                    return plain[0]
                return why
        return plain[0] if plain else None


@contextlib.contextmanager
def stderr_silenced(silence: bool = True):
    """fd 2 to /dev/null for the block: ggml reports bad tensor data with fprintf(stderr),
    outside the log callback (what llama.cpp logs is in the LogCapture)."""
    if not silence:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def stderr_captured():
    """fd 2 into a buffer for the block (what C code prints with fprintf(stderr)); yields an
    io.StringIO that holds it after the block."""
    import io
    import tempfile

    buf = io.StringIO()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield buf
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            buf.write(tmp.read().decode("utf-8", "replace"))


_LOG: LogCapture | None = None


def log_capture(lib: _Lib, verbose: bool = False) -> LogCapture:
    """Route llama.cpp's log through one LogCapture (installed once per process)."""
    global _LOG, _LOG_CB
    if _LOG is None:
        _LOG = LogCapture()
        _LOG_CB = lib.lc.llama_log_callback(_LOG)
        lib.lc.llama_log_set(_LOG_CB, ctypes.c_void_p())
    if verbose:
        _LOG.verbose = True
    return _LOG


# --------------------------------------------------------------------------- helpers

EXPERT_PATTERN = r"\.ffn_(up|down|gate|gate_up)_exps"
LLAMA_LOAD_MODE_NONE = 0  # llama.h: enum llama_load_mode


def parse_override(spec: str) -> str:
    """'REGEX=CPU' (llama.cpp's -ot, CPU buffers only) -> REGEX; ValueError otherwise."""
    import re

    pat, sep, buft = spec.rpartition("=")
    if not sep or not pat or buft.upper() != "CPU":
        raise ValueError(f"-ot {spec!r}: expected REGEX=CPU (only CPU overrides are supported)")
    try:
        re.compile(pat)
    except re.error as e:
        raise ValueError(f"-ot {spec!r}: bad regex ({e})") from None
    return pat


def model_params(
    lib: _Lib,
    n_gpu_layers: int = 0,
    experts_on_cpu: bool = False,
    keep: list | None = None,
    cpu_tensors=(),
    devices: list[int] | None = None,
    mmap: bool = True,
):
    """llama_model_params with n_gpu_layers and tensor buffer-type overrides keeping tensors in
    CPU memory: the routed experts when experts_on_cpu (llama.cpp's --cpu-moe), and those whose
    name matches a regex of cpu_tensors (llama.cpp's -ot REGEX=CPU). `devices`: the offload
    devices (ggml_backend_dev_t), None for llama.cpp's default (every GPU). mmap=False loads
    the file instead of mapping it (LLAMA_LOAD_MODE_NONE): host-resident weights then sit in the
    GPU backend's pinned host buffers, which llama.cpp avoids with mmap
    (llama-model-loader.cpp:1274-1282). `keep` receives the ctypes objects that must outlive
    the load."""
    lc = lib.lc
    p = lc.llama_model_default_params()
    p.n_gpu_layers = int(n_gpu_layers)
    if not mmap:
        p.load_mode = LLAMA_LOAD_MODE_NONE
    if devices is not None:
        arr = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
        p.devices = ctypes.cast(arr, ctypes.c_void_p).value
        if keep is not None:
            keep.append(arr)
    p.check_tensors = True  # NaN/Inf weights fail the load instead of generating garbage
    pats = ([EXPERT_PATTERN] if experts_on_cpu else []) + list(cpu_tensors)
    if pats:
        arr = (llama_model_tensor_buft_override * (len(pats) + 1))()
        enc = [x.encode() for x in pats]
        for i, x in enumerate(enc):
            arr[i].pattern = x
            arr[i].buft = lib.cpu_buffer_type()
        arr[len(pats)].pattern = None
        arr[len(pats)].buft = None
        p.tensor_buft_overrides = ctypes.cast(arr, ctypes.c_void_p)
        if keep is not None:
            keep += [arr, *enc]
    return p


def context_params(
    lib: _Lib,
    n_ctx: int,
    n_batch: int,
    n_ubatch: int,
    n_threads: int,
    n_threads_batch: int | None = None,
    n_seq_max: int = 1,
    op_offload: bool = True,
):
    """llama_context_params; op_offload=False keeps the ops on host-resident weights on the CPU
    (llama.cpp's --no-op-offload: ggml-backend.cpp:970 then never moves them to the GPU)."""
    lc = lib.lc
    p = lc.llama_context_default_params()
    p.op_offload = bool(op_offload)
    p.n_ctx, p.n_batch, p.n_ubatch = int(n_ctx), int(n_batch), int(n_ubatch)
    p.n_seq_max = int(n_seq_max)
    p.n_threads = int(n_threads)
    p.n_threads_batch = int(n_threads_batch or n_threads)
    p.n_outputs_max_per_seq = 0  # clover.h: a denoising step's rows all go through the pick sampler
    p.no_perf = True
    return p


def meta_str(lib: _Lib, model, key: str) -> str | None:
    lc = lib.lc
    size = 1 << 16
    while True:
        buf = ctypes.create_string_buffer(size)
        n = lc.llama_model_meta_val_str(model, key.encode(), buf, size)
        if n < 0:
            return None
        if n < size:
            return buf.value.decode("utf-8", errors="replace")
        size = n + 1


def token_ptr(ids) -> ctypes.Array:
    ids = list(ids)
    return (llama_token * max(1, len(ids)))(*ids)


# --------------------------------------------------------------------------- RPC devices


class RpcError(CloverError, RuntimeError):
    """An RPC server could not be used (runtime built without GGML_RPC, unreachable, ...)."""


GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_IGPU = 1, 2
_RPC_ADDED: dict[str, list[int]] = {}  # endpoint -> its devices, registered once per process


def parse_rpc_servers(servers: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """'HOST:PORT[,HOST:PORT...]' (or a list of them) -> endpoints; ValueError naming a bad one."""
    if servers is None:
        return []
    items = servers.split(",") if isinstance(servers, str) else list(servers)
    out = []
    for raw in items:
        ep = raw.strip()
        host, _, port = ep.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--rpc: {raw!r} is not HOST:PORT")
        if ep not in out:
            out.append(ep)
    if not out:
        raise ValueError("--rpc: no server given (HOST:PORT[,HOST:PORT...])")
    return out


def _ggml(lib: _Lib) -> ctypes.CDLL:
    """libggml (the backend registry) next to libllama, with the few functions bound."""
    g = getattr(lib, "_ggml", None)
    if g is None:
        d = lib.lib_path.parent
        g = ctypes.CDLL(str(d / "libggml.so") if (d / "libggml.so").exists() else "libggml.so")
        vp, cp = ctypes.c_void_p, ctypes.c_char_p
        for name, argtypes, restype in (
            ("ggml_backend_reg_by_name", [cp], vp),
            ("ggml_backend_reg_get_proc_address", [vp, cp], vp),
            ("ggml_backend_register", [vp], None),
            ("ggml_backend_reg_dev_count", [vp], ctypes.c_size_t),
            ("ggml_backend_reg_dev_get", [vp, ctypes.c_size_t], vp),
            ("ggml_backend_reg_name", [vp], cp),
            ("ggml_backend_dev_count", [], ctypes.c_size_t),
            ("ggml_backend_dev_get", [ctypes.c_size_t], vp),
            ("ggml_backend_dev_name", [vp], cp),
            ("ggml_backend_dev_type", [vp], ctypes.c_int),
            ("ggml_backend_dev_backend_reg", [vp], vp),
        ):
            f = getattr(g, name)
            f.argtypes, f.restype = argtypes, restype
        lib._ggml = g
    return g


def add_rpc_server(lib: _Lib, endpoint: str) -> list[int]:
    """Register the devices of the rpc-server at `endpoint` (once per process, as llama.cpp's
    --rpc does through the RPC registry's ggml_backend_rpc_add_server); returns them."""
    if endpoint in _RPC_ADDED:
        return _RPC_ADDED[endpoint]
    g = _ggml(lib)
    reg = g.ggml_backend_reg_by_name(b"RPC")
    if not reg:
        raise RpcError(
            f"--rpc {endpoint}: this runtime was built without RPC; rebuild it with `clover-gguf runtime build`"
        )
    fn = g.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server")
    if not fn:
        raise RpcError(f"--rpc {endpoint}: the RPC backend has no ggml_backend_rpc_add_server")
    add = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(fn)
    host, _, port = endpoint.rpartition(":")
    try:  # ggml-rpc aborts the process when it cannot connect: try a plain connection first
        socket.create_connection((host, int(port)), timeout=10).close()
    except OSError as e:
        raise RpcError(f"--rpc {endpoint}: cannot connect to an rpc-server there ({e.strerror or e})") from None
    with stderr_silenced(not (_LOG and _LOG.verbose)):  # ggml-rpc prints connection errors itself
        server_reg = add(endpoint.encode())
    if not server_reg:
        raise RpcError(f"--rpc {endpoint}: the rpc-server there did not answer (another version?)")
    g.ggml_backend_register(server_reg)
    devs = [g.ggml_backend_reg_dev_get(server_reg, i) for i in range(g.ggml_backend_reg_dev_count(server_reg))]
    _RPC_ADDED[endpoint] = devs
    return devs


def offload_devices(lib: _Lib, rpc_servers: list[str]) -> list[int] | None:
    """The devices a model offloads to: the given RPC servers' devices first (as llama.cpp puts
    them), then the local GPUs; None (llama.cpp's default, every GPU) when no RPC device was ever
    registered in this process, so that a model loaded without --rpc never uses one."""
    rpc = [d for ep in rpc_servers for d in add_rpc_server(lib, ep)]
    if not _RPC_ADDED:
        return None
    g = _ggml(lib)
    local = []
    for i in range(g.ggml_backend_dev_count()):
        dev = g.ggml_backend_dev_get(i)
        kind = g.ggml_backend_dev_type(dev)
        reg = g.ggml_backend_dev_backend_reg(dev)
        if (
            kind in (GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_IGPU)
            and g.ggml_backend_reg_name(reg) != b"RPC"
        ):
            local.append((kind, dev))
    gpus = [d for k, d in local if k == GGML_BACKEND_DEVICE_TYPE_GPU]
    return rpc + (gpus or [d for _, d in local])  # an iGPU only when there is no GPU, as llama.cpp


def parse_placement(lines: list[str], n_layer: int) -> dict:
    """Where a load put things, from llama.cpp's log: the device of each layer and of the output
    layer (llama.cpp's layer n_layer), how many layers were offloaded, and the MiB of each weight /
    memory (recurrent state) / compute buffer."""
    import re

    layers: dict[str, list[int]] = {}
    output = None
    buffers: dict[str, dict[str, float]] = {"model": {}, "memory": {}, "compute": {}}
    offloaded = None
    for t in lines:
        if m := re.search(r"layer\s+(\d+) assigned to device (\S+?),", t):
            if int(m.group(1)) == n_layer:
                output = m.group(2)
            else:
                layers.setdefault(m.group(2), []).append(int(m.group(1)))
        elif m := re.search(r"offloaded (\d+)/(\d+) layers", t):
            offloaded = f"{m.group(1)}/{m.group(2)}"
        elif m := re.search(r":\s+(\S+)\s+(model|RS|compute) buffer size\s*=\s*([\d.]+) MiB", t):
            kind = {"model": "model", "RS": "memory", "compute": "compute"}[m.group(2)]
            buffers[kind][m.group(1)] = buffers[kind].get(m.group(1), 0.0) + float(m.group(3))
    return {"layers": layers, "output": output, "offloaded_layers": offloaded, "buffers": buffers}
