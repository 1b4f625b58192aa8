"""The A/B of evaldata/speed/passes-ab-backend-sampler: for each variant, each eval-passes ratio
(median over its runs) and Clover's own medians, against the old build (a-old-*).
    python evaldata/speed/passes-ab-backend-sampler/compare.py"""

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
runs: dict[str, dict] = {}
for d in sorted(p for p in HERE.iterdir() if (p / "passes.json").exists()):
    variant = d.name.rsplit("-", 1)[0] if d.name.startswith("a-old") else d.name
    for r in json.loads((d / "passes.json").read_text())["runs"]:
        runs.setdefault(variant, {}).setdefault((r["head"], r["threads"]), []).append(r)
RATIOS = ["commit", "denoise32", "denoise16", "denoise4", "prefill", "gen8_vs_tg", "gen16_vs_tg"]
CLOVER = [
    "commit/clover",
    "denoise32/clover",
    "denoise16/clover",
    "denoise4/clover",
    "prefill/clover",
    "gen8/clover",
    "gen16/clover",
]
old = runs.pop("a-old")
for variant, by in runs.items():
    print(f"\n## {variant} vs a-old ({len(next(iter(old.values())))} old runs)\n")
    print("ratios (Clover/upstream; gen: Clover tok/s over upstream tg), old → new\n")
    print("| lm_head, threads | " + " | ".join(RATIOS) + " |")
    print("|---" * (len(RATIOS) + 1) + "|")
    for cfg in sorted(by):
        cells = [
            f"{statistics.median(r['ratios'][k] for r in old[cfg]):.2f} → "
            f"{statistics.median(r['ratios'][k] for r in by[cfg]):.2f}"
            for k in RATIOS
        ]
        print(f"| {cfg[0]}, {cfg[1]} | " + " | ".join(cells) + " |")
    print("\nClover's medians (ms; prefill and gen tok/s), new/old\n")
    print("| lm_head, threads | " + " | ".join(CLOVER) + " |")
    print("|---" * (len(CLOVER) + 1) + "|")
    for cfg in sorted(by):
        cells = []
        for k in CLOVER:
            o = statistics.median(r["results"][k]["median"] for r in old[cfg])
            n = statistics.median(r["results"][k]["median"] for r in by[cfg])
            cells.append(f"{n / o:.3f}")
        print(f"| {cfg[0]}, {cfg[1]} | " + " | ".join(cells) + " |")
