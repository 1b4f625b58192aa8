#!/usr/bin/env bash
# Native build (the default) against a portable one (--portable, GGML_NATIVE=OFF), side by side:
# llama-clover-cli (its speed lines) on one GGUF, rounds interleaved, 1 and 2 threads; prints medians.
#
#   clover-gguf runtime build --portable --root /tmp/rt-portable --no-install --targets llama,ggml,llama-clover-cli
#   bash scripts/bench_native.sh MODEL.gguf /tmp/rt-portable [ROUNDS]
# Run it on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/.."
M=$1; PORTABLE=$2; ROUNDS=${3:-6}
NATIVE=$(.venv/bin/python -c 'from clover_gguf.runtime.build import runtime_paths; print(runtime_paths()["bin_dir"])')
IDS=$(python3 -c "print(','.join(str(i) for i in range(300, 556)))")
LOG=$(mktemp)
uptime
for r in $(seq "$ROUNDS"); do
    for b in native portable; do
        BIN=$NATIVE; [ $b = portable ] && BIN=$PORTABLE/bin
        for t in 1 2; do
            echo "$b t$t: $("$BIN/llama-clover-cli" -m "$M" --prompt-ids "$IDS" -n 64 --diffusion-threshold 0 --diffusion-steps 8 -t $t 2>&1 >/dev/null \
                | grep -E 'prompt:|generation:|steps:' | tr '\n' ' ')" >> "$LOG"
        done
    done
done
uptime
python3 - "$LOG" <<'PY'
import re, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    m = re.match(r"(\w+) t(\d): prompt:.*?([\d.]+) tok/s generation:.*?([\d.]+) tok/s .*?([\d.]+) ms per step", line)
    if m:
        rows.setdefault((m[1], m[2]), []).append(tuple(float(m[i]) for i in (3, 4, 5)))
print("| build | threads | prompt tok/s | generation tok/s (steps 8) | ms/step |\n|---|---|---|---|---|")
for (b, t), v in sorted(rows.items()):
    cell = lambda i: "%.1f [%.1f-%.1f]" % (statistics.median(x[i] for x in v), min(x[i] for x in v), max(x[i] for x in v))  # noqa: E731
    print(f"| {b} | {t} | {cell(0)} | {cell(1)} | {cell(2)} |")
PY
