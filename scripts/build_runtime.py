#!/usr/bin/env python
"""Build the patched llama.cpp runtime and install llama-cpp-python (see
clover_gguf/runtime/build.py). Same options as `clover-gguf runtime build`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clover_gguf.cli import cli  # noqa: E402

if __name__ == "__main__":
    cli(["runtime", "build", *sys.argv[1:]])
