"""The quality run (`clover-gguf eval quality`): per-file tables against the BF16 reference, calibration,
drift and probes, the Pareto and drift plots."""

from __future__ import annotations

import math
from pathlib import Path

from ...outputs import save_figure
from .helpers import MiB, fmt_num, md_table, pyplot


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


def quality_section(q: dict, out: Path, plots: dict) -> str:
    """The quality section of a report: its plots written into out (and named in plots), its
    Markdown returned."""
    if q["models"]:
        plot_pareto(q, out / "pareto.png")
        plots["pareto"] = "pareto.png"
        plot_drift(q, out / "drift.png")
        plots["drift"] = "drift.png"
    return quality_markdown(q, plots)
