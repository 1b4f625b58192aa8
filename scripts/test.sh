#!/usr/bin/env bash
# The test command: install, lint, build the patched llama.cpp runtime (CPU), run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check . && ruff format --check .   # lint + formatter (settings in pyproject.toml)
clover-gguf runtime build
python -m pytest -q "$@"
# a bounded fuzz campaign on the runtime's and the Python side's GGUF loading and generation
# (metadata, tensor data and truncation mutants of random-clover and clover-tiny; about half a
# minute; fails on a crash, hang, unclean error, non-finite output or an output that differs
# without a reason; failing inputs land in out/fuzz-ci for tests/data/fuzz)
python tests/fuzz/fuzz_gguf.py --iterations 130 --keep out/fuzz-ci
# a bounded campaign of mutated requests against `clover-gguf serve` (about half a minute; fails
# on a 5xx, hang, broken connection, death or traceback; failing requests land in out/fuzz-server-ci)
python tests/fuzz/fuzz_server.py --requests 1500 --keep out/fuzz-server-ci
