#!/usr/bin/env bash
# The main job end to end on the bundled clover-tiny:
#   install -> build the patched llama.cpp -> convert BF16 safetensors to a Q4_K-expert GGUF
#   -> generate with llama.cpp (completion + speed) -> a small quality report against BF16.
# Works with any Python 3.11+ (PYTHON=/usr/bin/python3); VENV and OUT move the venv (.venv) and
# the outputs (out/). tests/test_quickstart.py runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${VENV:-.venv}/bin/activate"
OUT=${OUT:-out}
clover-gguf runtime build
mkdir -p "$OUT"
clover-gguf convert models/clover-tiny -o "$OUT/clover-tiny-q4_k.gguf" --recipe q4_k --force
clover-gguf inspect "$OUT/clover-tiny-q4_k.gguf"
clover-gguf run "$OUT/clover-tiny-q4_k.gguf" -p 'def fibonacci(n):' -n 64 --steps 8
clover-gguf eval quality --reference models/clover-tiny "$OUT/clover-tiny-q4_k.gguf" \
    --windows 2 --blocks 8 --n-prompts 2 --max-new-tokens 32 --out "$OUT/quickstart-report"
echo "report: $OUT/quickstart-report/ (report.md for people, quality.json for machines, *.png)"
