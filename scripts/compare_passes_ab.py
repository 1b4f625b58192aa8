"""Compare `clover-gguf eval passes` runs of several builds kept in one folder: each subfolder
holding a passes.json is one run, named BUILD or BUILD-N (runs of one build share BUILD). For each
build against the base build: each ratio, median over the runs of each build (min–max over runs
beside it), and Clover's own medians new/old. Writes compare.md, compare.json and compare.png there.
    python scripts/compare_passes_ab.py evaldata/speed/passes-ab-series-0018
    python scripts/compare_passes_ab.py evaldata/speed/passes-ab-backend-sampler --base a-old"""

import argparse
import json
import re
import statistics
from pathlib import Path

RATIOS = ["commit", "denoise32", "denoise16", "denoise4", "prefill", "gen8_vs_tg", "gen16_vs_tg"]
LOWER_IS_BETTER = {"commit", "denoise32", "denoise16", "denoise4", "prefill"}  # time ratios
CLOVER = ["commit/clover", "denoise32/clover", "denoise16/clover", "denoise4/clover", "prefill/clover"]


def load(folder: Path) -> dict:
    runs: dict = {}
    for d in sorted(p for p in folder.iterdir() if (p / "passes.json").exists()):
        build = re.sub(r"-\d+$", "", d.name)
        for r in json.loads((d / "passes.json").read_text())["runs"]:
            key = (
                f"{r['layers']} layers, {r['head']}, {r['threads']}"
                if "layers" in r
                else f"{r['head']}, {r['threads']}"
            )
            runs.setdefault(build, {}).setdefault(key, []).append(r)
    return runs


def compare(old: dict, new: dict) -> tuple[dict, list[str]]:
    """One build against the base: per configuration, each ratio and Clover's own medians."""
    res: dict = {"configs": {}}
    md = ["| layers, lm_head, threads | " + " | ".join(RATIOS) + " |", "|---" * (len(RATIOS) + 1) + "|"]
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
        res["configs"][cfg] = {"ratios": c}
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
            res["configs"][cfg].setdefault("clover_new_over_old", {})[k] = n / o
            cells.append(f"{n / o:.3f}")
        md.append(f"| {cfg} | " + " | ".join(cells) + " |")
    res["worst_pct"] = 100 * worst
    md += ["", f"Worst ratio change: {100 * worst:+.1f} %."]
    return res, md


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--base", default="old", help="the build the others are compared with (default: old)")
    a = ap.parse_args()
    runs = load(a.folder)
    old = runs.pop(a.base)
    out: dict = {"base": a.base, "runs": {b: len(next(iter(v.values()))) for b, v in [(a.base, old), *runs.items()]}}
    md = [
        f"# eval passes A/B in {a.folder.name}: each build against {a.base}\n",
        "Runs: " + ", ".join(f"{b} {n}" for b, n in out["runs"].items()) + ". Each cell is the median over the runs "
        "of each build's median ratio (Clover/upstream; gen: tok/s over upstream tg), [min–max over runs]. "
        "Change: how much worse the build is (+) or better (−), in %.",
    ]
    out["builds"] = {}
    for build, new in runs.items():
        out["builds"][build], table = compare(old, new)
        md += ["", f"## {build} vs {a.base}", "", *table]
    (a.folder / "compare.md").write_text("\n".join(md) + "\n")
    (a.folder / "compare.json").write_text(json.dumps(out, indent=1) + "\n")
    plot(out, a.folder / "compare.png")
    print("\n".join(md))


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    builds = list(out["builds"])
    fig, axes = plt.subplots(len(builds), len(RATIOS), figsize=(3 * len(RATIOS), 3.2 * len(builds)), squeeze=False)
    for row, build in zip(axes, builds):
        cfgs = sorted(out["builds"][build]["configs"])
        for ax, k in zip(row, RATIOS):
            for i, cfg in enumerate(cfgs):
                c = out["builds"][build]["configs"][cfg]["ratios"][k]
                ax.scatter([i - 0.12] * len(c["old"]), c["old"], color="tab:gray", s=12)
                ax.scatter([i + 0.12] * len(c["new"]), c["new"], color="tab:blue", s=12)
            ax.set_xticks(range(len(cfgs)), cfgs, rotation=60, fontsize=7)
            ax.set_title(f"{build}: {k}", fontsize=9)
        row[0].set_ylabel(f"ratio per run (gray {out['base']}, blue {build})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
