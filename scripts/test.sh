#!/usr/bin/env bash
# The test command: install, lint, build the patched llama.cpp runtime (CPU), run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check . && ruff format --check .   # lint + formatter (settings in pyproject.toml)
clover-gguf runtime build
python -m pytest -q "$@"
