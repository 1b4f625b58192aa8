#!/usr/bin/env bash
# The main job end to end on the bundled clover-tiny:
#   install -> build the patched llama.cpp -> convert BF16 safetensors to a Q4_K-expert GGUF
#   -> generate with llama.cpp (completion + speed) -> a small quality report against BF16.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
clover-gguf runtime build
mkdir -p out
clover-gguf convert models/clover-tiny -o out/clover-tiny-q4_k.gguf --recipe q4_k --force
clover-gguf inspect out/clover-tiny-q4_k.gguf
clover-gguf run out/clover-tiny-q4_k.gguf -p 'def fibonacci(n):' -n 64 --steps 8
clover-gguf eval quality --reference models/clover-tiny out/clover-tiny-q4_k.gguf \
    --windows 2 --blocks 8 --n-prompts 2 --max-new-tokens 32 --out out/quickstart-report
echo "report: out/quickstart-report/ (report.md for people, quality.json for machines, *.png)"
