"""The report of `clover-gguf eval passes`: Clover's passes against upstream llama.cpp's, per
model pair and thread count, a per-step breakdown and the ratios' plot."""

from __future__ import annotations

from pathlib import Path

from ...outputs import save_figure, write_text
from .helpers import config_markdown, md_table, pyplot, spread_cell

ABOUT = """For a synthetic Clover-35B-A3B (real shapes, random quantized weights, `synth --gguf`) and its
Qwen3-MoE twin (the same embedding, attention, router, expert and output bytes; upstream has no
memory, conv or shared expert), interleaved round by round:

- commit: Clover folds a 32-token block into its memory (no outputs) | upstream decodes 32 tokens
  without logits (then forgets them);
- denoising step with n masked rows: Clover's step (candidates on the device) | upstream decodes
  32 tokens with logits for n rows;
- prefill of P tokens: Clover commits them (several blocks per graph) | upstream decodes them;
- generation tok/s at steps 8 and 16 (block 32) | upstream autoregressive tg, one token per pass;
- Clover's per-step breakdown (graph build, compute, host work, other) from clover_perf.

Timings are medians with p10/p90 over the rounds; ratios are Clover's time over upstream's."""


def _row(label: str, res: dict, key: str, unit_scale: float = 1.0, nd: int = 1) -> list:
    return [
        label,
        spread_cell(res.get(f"{key}/clover"), unit_scale, nd),
        spread_cell(res.get(f"{key}/upstream"), unit_scale, nd),
    ]


def passes_table(run: dict, cfg: dict) -> str:
    res, rat = run["results"], run["ratios"]
    rows = [_row("commit, 32 tokens (ms)", res, "commit") + [f"{rat['commit']:.2f}", "≤ 1.00"]]
    for n in cfg["masked"]:
        rows.append(
            _row(f"denoising step, {n} masked rows (ms)", res, f"denoise{n}") + [f"{rat[f'denoise{n}']:.2f}", "≤ 1.10"]
        )
    rows.append(_row(f"prefill, {cfg['prefill']} tokens (tok/s)", res, "prefill") + [f"{rat['prefill']:.2f}", "≤ 1.05"])

    for st in cfg["steps"]:
        rows.append(
            [
                f"generation, steps {st} (tok/s) vs upstream tg",
                spread_cell(res.get(f"gen{st}/clover")),
                spread_cell(res.get("tg/upstream")),
                f"{1 / rat[f'gen{st}_vs_tg']:.2f}",
                "–",
            ]
        )
    head = ["pass", "Clover median [p10–p90]", "upstream median [p10–p90]", "time ratio Clover/upstream", "target"]
    return md_table(head, rows)


def breakdown_table(runs: list[dict]) -> str:
    rows = []
    for r in runs:
        for k, b in r["results"]["breakdown"].items():
            rows.append(
                [
                    f"{r['layers']} layers, {r['head']}, {r['threads']} thr, {k}",
                    f"{b['ms_per_step']:.2f}",
                    f"{b['graph_build_ms']:.3f}",
                    f"{b['compute_ms']:.2f}",
                    f"{b['host_ms']:.3f}",
                    f"{b['other_ms']:.3f}",
                    f"{b['graphs_built']:.0f} / {b['steps']:.0f}",
                    f"{b['steps_on_device']:.0f}",
                    f"{b['commit_ms_per_block']:.1f}",
                ]
            )
    head = [
        "run",
        "ms/step",
        "graph build",
        "compute",
        "host",
        "other (outputs, sync)",
        "graphs built / steps",
        "steps on device",
        "commit ms/block",
    ]
    return md_table(head, rows)


def plot_passes(bundle: dict, path: Path) -> None:
    plt = pyplot()
    runs = bundle["runs"]
    keys = [k for k in runs[0]["ratios"] if not k.startswith("gen")]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(keys) * len(runs) / 2), 4))
    w = 0.8 / len(runs)
    for i, r in enumerate(runs):
        ax.bar(
            [j + i * w for j in range(len(keys))],
            [r["ratios"][k] for k in keys],
            w,
            label=f"{r['layers']}L {r['head']} {r['threads']}t",
        )
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.1, color="r", lw=0.8, ls="--", label="step target 1.1")
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(keys))], keys)
    ax.set_ylabel("time, Clover / upstream llama.cpp")
    ax.set_title("Clover's passes vs llama.cpp's own (Qwen3-MoE twin), same build")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def render_passes(bundle: dict, out: Path) -> Path:
    cfg = bundle["config"]
    md = ["# Clover's passes vs llama.cpp's own", "", ABOUT, ""]
    for r in bundle["runs"]:
        md += [f"## {r['layers']} layers, lm_head {r['head']}, {r['threads']} thread(s)", "", passes_table(r, cfg), ""]
    md += ["## Per-step breakdown (medians)", "", breakdown_table(bundle["runs"]), ""]
    plot_passes(bundle, out / "passes.png")
    md += ["![ratios](passes.png)", ""]
    md.append(config_markdown(bundle["environment"]))
    end = bundle.get("environment_end", {}).get("cpu", {}).get("loadavg_at_start")
    md.append(f"- load average at the end: {end}\n")
    path = out / "report.md"
    write_text(path, "\n".join(md).rstrip() + "\n")
    return path
