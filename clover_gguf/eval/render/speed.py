"""The speed run (`clover-gguf eval speed`): tokens per second per backend, the sweeps and their
plot."""

from __future__ import annotations

from pathlib import Path

from ...outputs import save_figure
from .helpers import fmt_num, md_table, pyplot, spread_cell

SPEED_FIELDS = [
    ("load_cold_s", "load cold s", 1.0, 3),
    ("load_warm_s", "load warm s", 1.0, 3),
    ("prompt_tps", "prompt tok/s", 1.0, 1),
    ("gen_tps", "gen tok/s", 1.0, 1),
    ("ms_per_step", "ms/step", 1.0, 2),
    ("steps_per_block", "steps/block", 1.0, 2),
    ("tokens_per_step", "tok/step", 1.0, 2),
    ("ttfb_ms", "first block ms", 1.0, 1),
    ("peak_rss_mib", "peak RSS MiB", 1.0, 0),
]


def speed_table(sp: dict) -> str:
    """One row per (file, backend): the SPEED_FIELDS and the speedup over the PyTorch reference."""
    ref_gen = None
    for t in sp["targets"]:
        if t["backend"] == "reference-bf16":
            ref_gen = ((t.get("base") or {}).get("gen_tps") or {}).get("median")
    rows = []
    for t in sp["targets"]:
        b = t.get("base") or {}
        if t.get("error"):
            rows.append([t["name"], t["backend"]] + ["error"] * (len(SPEED_FIELDS) + 1))
            continue
        row = [t["name"], t["backend"]]
        for key, _, sc, nd in SPEED_FIELDS:
            v = t.get(key) if key in ("load_cold_s", "load_warm_s", "peak_rss_mib") else b.get(key)
            row.append(spread_cell(v, sc, nd) if isinstance(v, dict) else fmt_num(v, nd))
        g = (b.get("gen_tps") or {}).get("median")
        row.append(f"{g / ref_gen:.2f}×" if g and ref_gen else "–")
        rows.append(row)
    return md_table(["file", "backend"] + [h for _, h, _, _ in SPEED_FIELDS] + ["gen speedup vs PyTorch BF16"], rows)


def sweep_table(param: str, pts: list[dict]) -> str:
    """One row per value of a swept parameter."""
    return md_table(
        [param, "prompt tok/s", "gen tok/s", "ms/step", "steps/block", "tok/step", "first block ms"],
        [
            [
                p["value"],
                spread_cell(p["prompt_tps"], 1, 1),
                spread_cell(p["gen_tps"], 1, 1),
                spread_cell(p["ms_per_step"], 1, 2),
                spread_cell(p["steps_per_block"], 1, 2),
                spread_cell(p["tokens_per_step"], 1, 2),
                spread_cell(p["ttfb_ms"], 1, 1),
            ]
            for p in pts
        ],
    )


def speed_markdown(sp: dict, plots: dict) -> str:
    c = sp["config"]
    L = [
        "## Speed",
        "",
        f"Each figure: median [p10–p90] over {c['runs']} runs after {c.get('warmup', 1)} warm-up run(s) (no best-of); "
        f"cold load = first load in a fresh process (subprocess), warm = second load in that process. "
        f"Threads: PyTorch {c['threads']}, llama.cpp {c.get('runtime_threads', c['threads'])}; llama.cpp GPU layers "
        f"{c.get('n_gpu_layers', 0)}; prompt: {c.get('prompt_source', '?')}; decoding: "
        + ", ".join(f"{k}={v}" for k, v in c["decoding"].items())
        + ".",
        "",
    ]
    for n in sp.get("notes", []):
        L.append(f"> {n}\n")
    L += [speed_table(sp), ""]
    for t in sp["targets"]:
        for param, pts in (t.get("sweeps") or {}).items():
            L += [f"#### {t['name']} ({t['backend']}): sweep over {param}", "", sweep_table(param, pts), ""]
    if "speed" in plots:
        L += [f"![speed vs block size]({plots['speed']})", ""]
    L += [
        "Files: "
        + "; ".join(f"{t['name']}: sha256 {t.get('sha256', '–')[:16]}…" for t in sp["targets"] if t.get("sha256")),
        "",
    ]
    return "\n".join(L)


def plot_speed(sp: dict, path: Path) -> bool:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    any_ = False
    for t in sp["targets"]:
        pts = (t.get("sweeps") or {}).get("block_size")
        if not pts:
            continue
        xs = [p["value"] for p in pts]
        med = [p["gen_tps"]["median"] for p in pts]
        lo = [p["gen_tps"]["median"] - p["gen_tps"]["p10"] for p in pts]
        hi = [p["gen_tps"]["p90"] - p["gen_tps"]["median"] for p in pts]
        ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=4, label=f"{t['name']} ({t['backend']})")
        any_ = True
    if not any_:
        plt.close(fig)
        return False
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("block size")
    ax.set_ylabel("generation tokens/s (median, p10–p90 bars)")
    ax.set_title("Speed vs block size")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return True


def speed_section(sp: dict, out: Path, plots: dict) -> str:
    """The speed section of a report: its plot written into out when there is a sweep to draw
    (and named in plots), its Markdown returned."""
    if plot_speed(sp, out / "speed-block-size.png"):
        plots["speed"] = "speed-block-size.png"
    return speed_markdown(sp, plots)
