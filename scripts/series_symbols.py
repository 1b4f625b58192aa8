"""Symbols the patch series adds to llama.cpp's shared libraries: `nm -D --defined-only` of each
library in a patched build against the same library of the base build.

    python scripts/series_symbols.py BASE_LIB_DIR PATCHED_LIB_DIR [--json OUT]

C symbols (unmangled): the public API is among them (everything llama.h, ggml.h and gguf.h declare
is extern "C"); those a public header declares are counted apart (the headers of the source tree
the patched build was configured from, found through its CMakeCache.txt), the rest are internal
C-linkage functions (e.g. each ggml-cpu op's ggml_compute_forward_*). Mangled C++ symbols are
listed apart: libllama is built without -fvisibility=hidden, so upstream exports every model's
internal classes (a new architecture adds its llm_build_* and loader methods, as each of
upstream's models does) and no header declares them.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from clover_gguf.runtime.build import cmake_cache_value

LIBS = ("libggml-base.so", "libggml-cpu.so", "libggml.so", "libllama.so", "libllama-common.so")


def defined(lib: Path) -> set[str]:
    r = subprocess.run(["nm", "-D", "--defined-only", str(lib)], text=True, capture_output=True, check=True)
    return {line.split()[-1] for line in r.stdout.splitlines() if len(line.split()) >= 3}


def added(base_dir: Path, new_dir: Path) -> dict[str, dict[str, list[str]]]:
    out = {}
    for name in LIBS:
        if not (new_dir / name).exists():
            continue
        base = defined(base_dir / name) if (base_dir / name).exists() else set()
        new = sorted(defined(new_dir / name) - base)
        out[name] = {"c": [s for s in new if not s.startswith("_Z")], "cxx": [s for s in new if s.startswith("_Z")]}
    return out


def public_names(lib_dir: Path) -> set[str] | None:
    """Function names declared in the public headers of the tree lib_dir's build was configured
    from (include/, ggml/include/), or None when that tree is not found."""
    build = lib_dir if (lib_dir / "CMakeCache.txt").exists() else lib_dir.parent
    tree = cmake_cache_value(build, "LLAMA_CPP_DIR") or cmake_cache_value(build, "CMAKE_HOME_DIRECTORY")
    src = Path(tree) if tree else None
    if src is None or not (src / "include").is_dir():
        return None
    names: set[str] = set()
    for d in (src / "include", src / "ggml" / "include"):
        for h in d.glob("*.h"):
            names |= set(re.findall(r"\b(\w+)\s*\(", h.read_text(errors="replace")))
    return names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", type=Path)
    ap.add_argument("patched", type=Path)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    res = added(a.base, a.patched)
    n_c = sum(len(v["c"]) for v in res.values())
    n_cxx = sum(len(v["cxx"]) for v in res.values())
    public = public_names(a.patched)
    n_public = None if public is None else sum(s in public for v in res.values() for s in v["c"])
    for name, v in res.items():
        for s in v["c"]:
            where = "" if public is None else (" (public header)" if s in public else " (internal)")
            print(f"{name}: {s}{where}")
    print(
        f"C symbols added: {n_c}"
        + ("" if n_public is None else f", of which declared in a public header: {n_public}")
        + f"; C++ (mangled, internal) symbols added: {n_cxx}"
    )
    if a.json:
        out = {"c_added": n_c, "public_added": n_public, "cxx_added": n_cxx, "libraries": res}
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
