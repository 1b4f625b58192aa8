"""The A/B of this folder: each `eval passes` ratio, old series vs new, median over the runs of
each build (min–max over runs beside it), and Clover's own medians new/old. Writes compare.md,
compare.json and compare.png here.
    python evaldata/speed/passes-ab-series-0018/compare.py"""

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
RATIOS = ["commit", "denoise32", "denoise16", "denoise4", "prefill", "gen8_vs_tg", "gen16_vs_tg"]
LOWER_IS_BETTER = {"commit", "denoise32", "denoise16", "denoise4", "prefill"}  # time ratios
CLOVER = ["commit/clover", "denoise32/clover", "denoise16/clover", "denoise4/clover", "prefill/clover"]


def load() -> dict:
    runs: dict = {}
    for d in sorted(p for p in HERE.iterdir() if (p / "passes.json").exists()):
        build = d.name.split("-")[0]
        for r in json.loads((d / "passes.json").read_text())["runs"]:
            runs.setdefault(build, {}).setdefault(f"{r['head']}, {r['threads']}", []).append(r)
    return runs


def main() -> None:
    runs = load()
    old, new = runs["old"], runs["new"]
    out: dict = {"runs": {b: len(next(iter(v.values()))) for b, v in runs.items()}, "configs": {}}
    md = [
        "# eval passes A/B: series with the pick as a backend sampler (new) vs before (old)\n",
        f"{out['runs']['old']} runs of old, {out['runs']['new']} of new, interleaved; each cell is the median over "
        "the runs of each build's median ratio (Clover/upstream; gen: tok/s over upstream tg), "
        "[min–max over runs]. Change: how much worse new is (+) or better (−), in %.\n",
        "| lm_head, threads | " + " | ".join(RATIOS) + " |",
        "|---" * (len(RATIOS) + 1) + "|",
    ]
    worst = 0.0
    for cfg in sorted(new):
        cells, c = [], {}
        for k in RATIOS:
            o = [r["ratios"][k] for r in old[cfg]]
            n = [r["ratios"][k] for r in new[cfg]]
            mo, mn = statistics.median(o), statistics.median(n)
            worse = (mn / mo - 1) if k in LOWER_IS_BETTER else (mo / mn - 1)
            worst = max(worst, worse)
            c[k] = {"old": o, "new": n, "old_median": mo, "new_median": mn, "worse_pct": 100 * worse}
            cells.append(
                f"{mo:.2f} [{min(o):.2f}–{max(o):.2f}] → {mn:.2f} [{min(n):.2f}–{max(n):.2f}] ({100 * worse:+.1f} %)"
            )
        out["configs"][cfg] = {"ratios": c}
        md.append(f"| {cfg} | " + " | ".join(cells) + " |")
    md += [
        "",
        "Clover's own medians (ms, prefill tok/s), new/old (median over runs)\n",
        "| lm_head, threads | " + " | ".join(CLOVER) + " |",
        "|---" * (len(CLOVER) + 1) + "|",
    ]
    for cfg in sorted(new):
        cells = []
        for k in CLOVER:
            o = statistics.median(r["results"][k]["median"] for r in old[cfg])
            n = statistics.median(r["results"][k]["median"] for r in new[cfg])
            out["configs"][cfg].setdefault("clover_new_over_old", {})[k] = n / o
            cells.append(f"{n / o:.3f}")
        md.append(f"| {cfg} | " + " | ".join(cells) + " |")
    out["worst_pct"] = 100 * worst
    md += ["", f"Worst ratio change: {100 * worst:+.1f} %."]
    (HERE / "compare.md").write_text("\n".join(md) + "\n")
    (HERE / "compare.json").write_text(json.dumps(out, indent=1) + "\n")
    plot(out)
    print("\n".join(md))


def plot(out: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfgs = sorted(out["configs"])
    fig, axes = plt.subplots(1, len(RATIOS), figsize=(3 * len(RATIOS), 3.2), sharey=False)
    for ax, k in zip(axes, RATIOS):
        for i, cfg in enumerate(cfgs):
            c = out["configs"][cfg]["ratios"][k]
            ax.scatter([i - 0.12] * len(c["old"]), c["old"], color="tab:gray", s=12)
            ax.scatter([i + 0.12] * len(c["new"]), c["new"], color="tab:blue", s=12)
        ax.set_xticks(range(len(cfgs)), cfgs, rotation=60, fontsize=7)
        ax.set_title(k, fontsize=9)
    axes[0].set_ylabel("ratio per run (gray old, blue new)")
    fig.tight_layout()
    fig.savefig(HERE / "compare.png", dpi=110)


if __name__ == "__main__":
    main()
