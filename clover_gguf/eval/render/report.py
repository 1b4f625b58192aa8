"""Render eval runs: JSON (machines) -> Markdown (people) + PNG plots (matplotlib, Agg).

A run JSON has ``kind`` "quality", "speed", "sensitivity", or "bundle" (``sections`` holding
any of the three). ``render(run, out_dir)`` writes ``report.md`` and the plots next to it;
``clover-gguf report RUN.json [-o DIR]`` calls it on a saved file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ...outputs import save_figure, write_text
from .helpers import MiB, config_markdown, fmt_num, md_table, pyplot, spread_cell

# ---- quality ------------------------------------------------------------------------------


def _rows_quality(q):
    rows = []
    for m in q["models"]:
        for prov, r in m["providers"].items():
            rows.append((m, prov, r))
    return rows


def _bins(q: dict, key: str) -> list[str]:
    """Bin labels of r[key] over every (model, provider), in first-seen order."""
    bins: list[str] = []
    for _, _, r in _rows_quality(q):
        for b in r.get(key, {}):
            if b not in bins:
                bins.append(b)
    return bins


def _first_result(q: dict) -> dict:
    return q["models"][0]["providers"][q["config"]["providers"][0]]


def quality_table(q: dict) -> str:
    """One row per (file, provider): size, NLL, KL, top-1, Δp and generation agreement."""
    head = [
        "file",
        "MiB",
        "bpw",
        "provider",
        "NLL ref",
        "NLL q",
        "ΔNLL",
        "KL mean",
        "KL p99",
        "KL p99.9",
        "KL max",
        "same top-1 %",
        "RMS Δp %",
    ]
    gens = list(q["config"].get("generation", {}).get("schedules", {}) or {})
    for g in gens:
        head += [f"gen exact % ({g})", f"gen prefix ({g})"]
    if gens:
        head += [f"steps/block ({gens[-1]})"]
    rows = []
    for m, prov, r in _rows_quality(q):
        o = r["overall"]
        row = [
            m["name"],
            f"{m['bytes'] / MiB:.2f}",
            f"{m['bpw']:.2f}",
            prov,
            fmt_num(o["ref_nll_bits"]),
            fmt_num(o["q_nll_bits"]),
            f"{o['delta_nll_bits']:+.4f}",
            f"{fmt_num(o['kl_mean'], 5)} ± {fmt_num(o['kl_mean_se'], 5)}",
            fmt_num(o["kl_p99"]),
            fmt_num(o["kl_p999"]),
            fmt_num(o["kl_max"]),
            fmt_num(o["same_top1"], 4, pct=True),
            fmt_num(o["rms_dp"], 4, pct=True),
        ]
        gen = r.get("generation", {})
        for g in gens:
            a = gen.get(g, {})
            row += [fmt_num(a.get("exact_match"), 3, pct=True), fmt_num(a.get("mean_common_prefix"), 1)]
        if gens:
            a = gen.get(gens[-1], {})
            row += [f"{fmt_num(a.get('steps_per_block'), 2)} (ref {fmt_num(a.get('ref_steps_per_block'), 2)})"]
        rows.append(row)
    return md_table(head, rows)


def calibration_table(q: dict) -> str:
    """The compact-KL bound and the calibration (exact vs compact KL) per (file, provider)."""
    rows = []
    for m, prov, r in _rows_quality(q):
        cal = r.get("calibration", {})
        rows.append(
            [
                m["name"],
                prov,
                fmt_num(r["overall"]["kl_mean_bound"], 6),
                fmt_num(r["overall"]["kl_max_bound"], 6),
                cal.get("n", "–"),
                fmt_num(cal.get("kl_mean_full"), 6),
                fmt_num(cal.get("kl_mean_compact"), 6),
                fmt_num(cal.get("max_abs_error"), 6),
                cal.get("bracket_holds", "–"),
            ]
        )
    head = [
        "file",
        "provider",
        "mean-KL upper bound (+nats)",
        "max per-position bound",
        "calib n",
        "calib KL exact",
        "calib KL compact",
        "calib max abs error",
        "bracket holds",
    ]
    return md_table(head, rows)


def ratio_table(q: dict) -> str:
    """KL mean and same-top-1 per mask ratio."""
    ratios = [f"{r:g}" for r in q["config"]["ratios"]]
    return md_table(
        ["file", "provider"] + [f"ρ={r}" for r in ratios] + [f"same top-1 % ρ={r}" for r in ratios],
        [
            [m["name"], prov]
            + [fmt_num(r["by_ratio"][x]["kl_mean"], 5) for x in ratios]
            + [fmt_num(r["by_ratio"][x]["same_top1"], 3, pct=True) for x in ratios]
            for m, prov, r in _rows_quality(q)
        ],
    )


def drift_table(q: dict) -> str:
    """KL, same-top-1 and ΔNLL by committed history length."""
    bins, rows = _bins(q, "by_history"), _rows_quality(q)
    return md_table(
        ["file", "provider", "metric"] + bins,
        [
            [m["name"], prov, "KL mean"] + [fmt_num(r["by_history"].get(b, {}).get("kl_mean"), 5) for b in bins]
            for m, prov, r in rows
        ]
        + [
            [m["name"], prov, "same top-1 %"]
            + [fmt_num(r["by_history"].get(b, {}).get("same_top1"), 3, pct=True) for b in bins]
            for m, prov, r in rows
        ]
        + [
            [m["name"], prov, "ΔNLL bits"]
            + [f"{r['by_history'].get(b, {}).get('delta_nll_bits', float('nan')):+.4f}" for b in bins]
            for m, prov, r in rows
        ],
    )


def probes_table(q: dict) -> str:
    """KL and same-top-1 of the recall probes by distance."""
    bins, rows, first = _bins(q, "probes"), _rows_quality(q), _first_result(q)
    return md_table(
        ["file", "provider", "metric"] + [f"{b} (n={first['probes'][b].get('n', 0)})" for b in bins],
        [
            [m["name"], prov, "KL mean"] + [fmt_num(r["probes"].get(b, {}).get("kl_mean"), 5) for b in bins]
            for m, prov, r in rows
        ]
        + [
            [m["name"], prov, "same top-1 %"]
            + [fmt_num(r["probes"].get(b, {}).get("same_top1"), 3, pct=True) for b in bins]
            for m, prov, r in rows
        ],
    )


def quality_markdown(q: dict, plots: dict) -> str:
    c, s, ref = q["config"], q["samples"], q["reference"]
    L = ["## Quality against the BF16 reference", ""]
    provs = ", ".join(c["providers"])
    L.append(
        f"Reference: `{c['reference']}` (PyTorch, float32 compute on the BF16 weights), "
        f"NLL {ref['nll_bits']:.4f} bits/token. Quantized models run through: **{provs}** "
        f"({'reference-dequant = the PyTorch reference on the GGUF weights dequantized with gguf-py; ' if 'reference-dequant' in provs else ''}"
        f"{'runtime = the patched llama.cpp' if 'runtime' in provs else 'the llama.cpp runtime was not used'})."
    )
    for n in q.get("notes", []):
        L.append(f"\n> {n}")
    corpus = s.get("corpus", "")
    if s.get("corpus_note"):
        corpus += f" ({s['corpus_note']})"
    L += [
        "",
        f"Samples: {corpus}; {s.get('documents', '?')} documents, {s.get('tokens', '?')} tokens; "
        f"{s['n_windows']} windows of up to {max(s['blocks_per_window'] or [0])} blocks of {s['block_size']} tokens "
        f"(random block-aligned offsets, seed {s['seed']}), every block scored at mask ratios "
        f"{', '.join(f'{r:g}' for r in s['ratios'])} with the clean earlier blocks of its window as committed "
        f"history: {s['scored_positions']} scored positions. KL in nats (reference ‖ quantized), NLL in bits/token, "
        f"mask token excluded from both distributions.",
        "",
    ]
    L += [quality_table(q), ""]
    cm = ref.get("compact", {})
    if cm.get("tail_mass_max") == 0.0:
        L.append(
            f"Reference logits: the whole vocabulary is kept (top-{cm.get('top_k')}: every token but the "
            "mask), so the KL figures are exact (the bound below is 0)."
        )
    L.append(
        f"Reference logits are stored compactly (top-{cm.get('top_k')} logits + log-sum-exp + true-token "
        f"log-prob per position). KL is computed with the tail beyond the top-k lumped into one outcome, a lower "
        f"bound; the true mean KL lies in [KL mean, KL mean + bound] with the bound below (reference tail mass: "
        f"mean {fmt_num(cm.get('tail_mass_mean'), 5)}, p99 {fmt_num(cm.get('tail_mass_p99'), 5)})."
    )
    L.append(
        "Calibration: on up to 1024 positions of the first window the full reference logits are kept, so the "
        "exact KL can be set next to the compact-form value and its bound."
    )
    L += ["", calibration_table(q), ""]
    if "pareto" in plots:
        L += [f"![size vs KL]({plots['pareto']})", ""]
    L += ["### KL mean by mask ratio", "", ratio_table(q), ""]
    bins = _bins(q, "by_history")
    L += [
        "### Long-history drift: by committed history (blocks before the scored block)",
        "",
        drift_table(q),
        "",
        "Positions per bin: " + ", ".join(f"{b}: {_first_result(q)['by_history'][b]['n']}" for b in bins)
        if q["models"]
        else "",
        "",
    ]
    if "drift" in plots:
        L += [f"![drift]({plots['drift']})", ""]
    if _bins(q, "probes"):
        pr = s.get("probes", {})
        L += [
            "### Recall probes: identifiers last seen far back",
            "",
            f"Rule: {pr.get('rule', '')}. Columns: distance in tokens (n positions).",
            "",
            probes_table(q),
            "",
        ]
    return "\n".join(L)


def plot_pareto(q: dict, path: Path, sens: dict | None = None) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    pts = []
    for m, prov, r in _rows_quality(q):
        kl = max(r["overall"]["kl_mean"], 1e-7)
        pts.append((m["bytes"] / MiB, kl, m["name"], prov))
    for prov in dict.fromkeys(p[3] for p in pts):
        xs = [p[0] for p in pts if p[3] == prov]
        ys = [p[1] for p in pts if p[3] == prov]
        ax.scatter(xs, ys, label=prov, zorder=3)
        for p in pts:
            if p[3] == prov:
                ax.annotate(p[2], (p[0], p[1]), textcoords="offset points", xytext=(4, 4), fontsize=8)
        # Pareto frontier: smallest KL for each size
        fr, best = [], math.inf
        for x, y in sorted(zip(xs, ys)):
            if y < best:
                fr.append((x, y))
                best = y
        if len(fr) > 1:
            ax.plot([a for a, _ in fr], [b for _, b in fr], "--", alpha=0.5)
    ax.set_yscale("log")
    ax.set_xlabel("file size (MiB)")
    ax.set_ylabel("mean KL ref‖q (nats, log scale; 1e-7 = identical)")
    ax.set_title("Size vs KL (Pareto frontier dashed)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def plot_drift(q: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m, prov, r in _rows_quality(q):
        bins = list(r["by_history"])
        ys = [r["by_history"][b]["kl_mean"] for b in bins]
        es = [r["by_history"][b].get("kl_mean_se", 0) for b in bins]
        if max(ys) <= 1e-9:
            continue
        ax.errorbar(range(len(bins)), ys, yerr=es, marker="o", capsize=3, label=f"{m['name']} ({prov})")
        ax.set_xticks(range(len(bins)), bins)
    ax.set_xlabel("committed history before the scored block (blocks)")
    ax.set_ylabel("mean KL ref‖q (nats) ± s.e.")
    ax.set_title("Drift vs history length")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


# ---- sensitivity ----------------------------------------------------------------------------


def sensitivity_table(s: dict) -> str:
    """One row per group: its bytes at both types and the KL of quantizing it alone."""
    c = s["config"]
    rows = []
    for g in s["groups"]:
        o = g["overall"]
        rows.append(
            [
                g["group"],
                g["n_tensors"],
                ", ".join(f"{k}×{v}" for k, v in g["types"].items()),
                f"{g['group_bytes_base'] / MiB:.3f}",
                f"{g['group_bytes_q'] / MiB:.3f}",
                f"{(g['group_bytes_base'] - g['group_bytes_q']) / MiB:.3f}",
                fmt_num(o["kl_mean"], 6),
                fmt_num(o["kl_p99"], 5),
                fmt_num(o["same_top1"], 3, pct=True),
                f"{o['delta_nll_bits']:+.5f}",
                fmt_num(g.get("kl_per_mib_saved"), 6),
            ]
        )
    head = [
        "group",
        "tensors",
        "types",
        f"MiB {c['base']}",
        f"MiB {c['qtype']}",
        "MiB saved",
        "KL mean",
        "KL p99",
        "same top-1 %",
        "ΔNLL bits",
        "KL per MiB saved",
    ]
    return md_table(head, rows)


def sensitivity_markdown(s: dict, plots: dict) -> str:
    c = s["config"]
    L = [
        "## Sensitivity: one tensor group quantized at a time",
        "",
        f"Base: every 2-D weight {c['base'].upper()} (1-D tensors F32); one group (constants.TENSOR_GROUPS) at a time "
        f"set to **{c['qtype'].upper()}** with convert's `tensor_types` override; scored like the quality run "
        f"({c.get('provider', 'reference-dequant')}, same samples and reference logits).",
        "",
        sensitivity_table(s),
        "",
    ]
    if "sensitivity" in plots:
        L += [f"![sensitivity]({plots['sensitivity']})", ""]
    return "\n".join(L)


def plot_sensitivity(s: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    gs = s["groups"]
    ax.bar([g["group"] for g in gs], [max(g["overall"]["kl_mean"], 1e-9) for g in gs])
    ax.set_yscale("log")
    ax.set_ylabel(f"mean KL (nats), group at {s['config']['qtype']}")
    for i, g in enumerate(gs):
        ax.annotate(
            f"{(g['group_bytes_base'] - g['group_bytes_q']) / MiB:.2f} MiB saved",
            (i, max(g["overall"]["kl_mean"], 1e-9)),
            ha="center",
            va="bottom",
            fontsize=7,
        )
    ax.set_title("Per-group sensitivity")
    plt.setp(ax.get_xticklabels(), rotation=25, ha="right")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


# ---- speed ------------------------------------------------------------------------------------

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


# ---- summary (the README table) ----------------------------------------------------------------


def summary_table(secs: dict) -> str:
    """One row per GGUF: size, KL and agreement from the best provider (runtime when it ran,
    else reference-dequant), generation speed from the speed section when present."""
    q = secs.get("quality")
    if not q:
        return ""
    speed = {}
    for t in (secs.get("speed") or {}).get("targets", []):
        g = (t.get("base") or {}).get("gen_tps") or {}
        if g.get("n"):
            speed[(t["name"], t["backend"])] = g
    ref_tps = next((v for (n, b), v in speed.items() if b == "reference-bf16"), None)
    gens = list(q["config"].get("generation", {}).get("schedules", {}) or {})
    head = ["file", "MiB", "bpw", "scored by", "KL mean", "KL p99", "same top-1 %", "ΔNLL bits"]
    if gens:
        head.append(f"gen exact % ({gens[-1]})")
    if speed:
        head += ["gen tok/s (backend)"]
    rows = []
    for m in q["models"]:
        prov = "runtime" if "runtime" in m["providers"] else next(iter(m["providers"]))
        o = m["providers"][prov]["overall"]
        row = [
            m["name"],
            f"{m['bytes'] / MiB:.2f}",
            f"{m['bpw']:.2f}",
            prov,
            fmt_num(o["kl_mean"], 5),
            fmt_num(o["kl_p99"], 4),
            fmt_num(o["same_top1"], 3, pct=True),
            f"{o['delta_nll_bits']:+.4f}",
        ]
        if gens:
            row.append(
                fmt_num(m["providers"][prov].get("generation", {}).get(gens[-1], {}).get("exact_match"), 3, pct=True)
            )
        if speed:
            sp = next(((v, b) for (n, b), v in speed.items() if n == m["name"] and b == "runtime"), None) or next(
                ((v, b) for (n, b), v in speed.items() if n == m["name"]), None
            )
            row.append(f"{sp[0]['median']:.1f} ({sp[1]})" if sp else "–")
        rows.append(row)
    if ref_tps:
        rows.append(
            ["PyTorch reference (BF16 safetensors)", "", "16", "–", "0", "0", "100.0", "+0.0000"]
            + (["100.0"] if gens else [])
            + [f"{ref_tps['median']:.1f} (reference-bf16)"]
        )
    return md_table(head, rows)


# ---- entry points ---------------------------------------------------------------------------------


def sections(run: dict) -> dict:
    if run.get("kind") == "bundle":
        return run["sections"]
    return {run["kind"]: run}


def render(run: dict | str | Path, out_dir: str | Path | None = None, title: str | None = None) -> Path:
    """Write report.md and PNG plots for a run (dict or JSON path) into out_dir (default:
    the JSON's folder). Returns the Markdown path."""
    src = None
    if not isinstance(run, dict):
        src = Path(run)
        run = json.loads(src.read_text())
    out = Path(out_dir) if out_dir else (src.parent if src else Path("."))
    out.mkdir(parents=True, exist_ok=True)
    if run.get("kind") == "agent":
        from ..agent import render_agent

        return render_agent(run, out)
    if run.get("kind") == "tools":
        from ..tools_report import render_tools

        return render_tools(run, out)
    if run.get("kind") == "passes":
        from ..passes import render_passes

        return render_passes(run, out)
    secs = sections(run)
    if not secs or not set(secs) <= {"quality", "speed", "sensitivity"}:
        raise ValueError(f"not an eval run: kind={run.get('kind')!r}")
    plots: dict[str, str] = {}
    md = [f"# {title or run.get('title') or 'clover-gguf eval report'}", ""]
    if run.get("summary"):
        md += [run["summary"], ""]
    st = summary_table(secs)
    if st and len(secs) > 1:
        md += ["## Summary", "", st, ""]
    if "quality" in secs:
        q = secs["quality"]
        if q["models"]:
            plot_pareto(q, out / "pareto.png")
            plots["pareto"] = "pareto.png"
            plot_drift(q, out / "drift.png")
            plots["drift"] = "drift.png"
        md.append(quality_markdown(q, plots))
    if "sensitivity" in secs:
        plot_sensitivity(secs["sensitivity"], out / "sensitivity.png")
        plots["sensitivity"] = "sensitivity.png"
        md.append(sensitivity_markdown(secs["sensitivity"], plots))
    if "speed" in secs:
        if plot_speed(secs["speed"], out / "speed-block-size.png"):
            plots["speed"] = "speed-block-size.png"
        md.append(speed_markdown(secs["speed"], plots))
    envs = [(k, s["config"]["environment"]) for k, s in secs.items() if s.get("config", {}).get("environment")]
    for k, env in envs:
        c = config_markdown(env)
        md.append(c.replace("## Configuration", f"## Configuration ({k} run)", 1) if len(envs) > 1 else c)
    path = out / "report.md"
    write_text(path, "\n".join(md).rstrip() + "\n")
    return path
