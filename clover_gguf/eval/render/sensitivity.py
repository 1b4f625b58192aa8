"""The sensitivity run (`clover-gguf eval sensitivity`): what quantizing one tensor group costs,
as a table and a bar plot."""

from __future__ import annotations

from pathlib import Path

from ...outputs import save_figure
from .helpers import MiB, fmt_num, md_table, pyplot


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


def sensitivity_section(s: dict, out: Path, plots: dict) -> str:
    """The sensitivity section of a report: its plot written into out (and named in plots), its
    Markdown returned."""
    plot_sensitivity(s, out / "sensitivity.png")
    plots["sensitivity"] = "sensitivity.png"
    return sensitivity_markdown(s, plots)
