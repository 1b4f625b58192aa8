#!/usr/bin/env bash
# The committed clover-tiny baseline (evaldata/baseline/clover-tiny), stage by stage, on a quiet
# machine; then the summary (written by hand from the figures) goes in with the bundle.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p out/baseline
. .venv/bin/activate
export PYTHONUNBUFFERED=1
step() { echo "=== $(date +%T) $*"; }
step imatrix
cat clover_gguf/convert/*.py clover_gguf/eval/*.py > out/baseline/calib.txt
clover-gguf imatrix models/clover-tiny -f out/baseline/calib.txt -o out/baseline/clover-tiny.imatrix.gguf --ctx 256 --chunks 16
step baseline-quality
rm -rf out/eval/baseline-v2
for stage in files quality sensitivity; do
  clover-gguf eval baseline --reference models/clover-tiny --out evaldata/baseline/clover-tiny --work out/eval/baseline-v2 \
    --windows 4 --blocks 64 --n-prompts 8 --max-new-tokens 32 --sens-windows 1 --threads 2 --runtime-threads 2 --stage $stage
done
step baseline-speed
clover-gguf eval baseline --reference models/clover-tiny --out evaldata/baseline/clover-tiny --work out/eval/baseline-v2 \
  --windows 4 --blocks 64 --n-prompts 8 --max-new-tokens 64 --runs 5 --threads 1 --runtime-threads 1 \
  --sweep block_size=8,16,32,64 --sweep threshold=0.5,0.7,0.9 --stage speed
step baseline-bundle  # add --summary-file SUMMARY.md once it is written
clover-gguf eval baseline --reference models/clover-tiny --out evaldata/baseline/clover-tiny --work out/eval/baseline-v2 --stage bundle
step baseline-add
clover-gguf eval baseline --reference models/clover-tiny --out evaldata/baseline/clover-tiny --work out/eval/baseline-add-v2 \
  --windows 4 --blocks 64 --n-prompts 8 --max-new-tokens 32 --threads 2 --runtime-threads 2 \
  --add Q3_K-experts --add IQ3_S-experts --add IQ2_M-experts --imatrix out/baseline/clover-tiny.imatrix.gguf
step sens-q4
clover-gguf eval sensitivity --reference models/clover-tiny --type q4_0 --type q4_k --group experts_gate_up --group experts_down \
  --windows 1 --threads 2 --out out/baseline/sens-q4
step done
