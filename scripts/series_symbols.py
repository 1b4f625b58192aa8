"""Symbols the patch series adds to llama.cpp's shared libraries: `nm -D --defined-only` of each
library in a patched build against the same library of the base build.

    python scripts/series_symbols.py BASE_LIB_DIR PATCHED_LIB_DIR [--json OUT]

C symbols (unmangled) are the public API: everything llama.h, ggml.h and gguf.h declare is
extern "C". Mangled C++ symbols are listed apart: libllama is built without
-fvisibility=hidden, so upstream exports every model's internal classes (a new architecture adds
its llm_build_* and loader methods, as each of upstream's models does) and no header declares them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", type=Path)
    ap.add_argument("patched", type=Path)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    res = added(a.base, a.patched)
    n_c = sum(len(v["c"]) for v in res.values())
    n_cxx = sum(len(v["cxx"]) for v in res.values())
    for name, v in res.items():
        for s in v["c"]:
            print(f"{name}: {s}")
    print(f"C symbols added: {n_c}; C++ (mangled, internal) symbols added: {n_cxx}")
    if a.json:
        a.json.write_text(json.dumps({"c_added": n_c, "cxx_added": n_cxx, "libraries": res}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
