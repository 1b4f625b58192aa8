"""Render eval runs: JSON (machines) -> Markdown (people) + PNG plots (matplotlib, Agg).

``render(run, out_dir)`` writes ``report.md`` and the plots next to it, through the renderer of
the run's ``kind``; ``clover-gguf eval report RUN.json [-o DIR]`` calls it on a saved file. Kinds
"quality", "speed", "sensitivity" and "bundle" (``sections`` holding any of the three, the
baseline's) share one report, composed here from each section's renderer with a summary table
on top; "tools", "memory", "agent", "passes" and "throughput" have reports of their own (RENDERERS).
"""

from __future__ import annotations

import json
from pathlib import Path

from ...outputs import write_text
from .agent import render_agent
from .helpers import MiB, config_markdown, fmt_num, md_table
from .memory import render_memory
from .passes import render_passes
from .quality import quality_section
from .sensitivity import sensitivity_section
from .speed import speed_section
from .throughput import render_throughput
from .tools import render_tools

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


def render_sections(run: dict, out: Path, title: str | None = None) -> Path:
    """The report of a quality, speed or sensitivity run, or of a bundle of them."""
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
        md.append(quality_section(secs["quality"], out, plots))
    if "sensitivity" in secs:
        md.append(sensitivity_section(secs["sensitivity"], out, plots))
    if "speed" in secs:
        md.append(speed_section(secs["speed"], out, plots))
    envs = [(k, s["config"]["environment"]) for k, s in secs.items() if s.get("config", {}).get("environment")]
    for k, env in envs:
        c = config_markdown(env)
        md.append(c.replace("## Configuration", f"## Configuration ({k} run)", 1) if len(envs) > 1 else c)
    path = out / "report.md"
    write_text(path, "\n".join(md).rstrip() + "\n")
    return path


# The kinds with a report of their own; the others are quality, speed, sensitivity or a bundle.
RENDERERS = {
    "agent": render_agent,
    "memory": render_memory,
    "passes": render_passes,
    "throughput": render_throughput,
    "tools": render_tools,
}


def render(run: dict | str | Path, out_dir: str | Path | None = None, title: str | None = None) -> Path:
    """Write the Markdown report (report.md; throughput.md for a throughput run) and its PNG plots
    for a run (dict or JSON path) into out_dir (default: the JSON's folder), by the renderer of
    its kind. Returns the Markdown path."""
    src = None
    if not isinstance(run, dict):
        src = Path(run)
        run = json.loads(src.read_text())
    out = Path(out_dir) if out_dir else (src.parent if src else Path("."))
    out.mkdir(parents=True, exist_ok=True)
    renderer = RENDERERS.get(run.get("kind"))
    if renderer:
        return renderer(run, out)
    return render_sections(run, out, title)
