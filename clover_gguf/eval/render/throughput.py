"""The report of `clover-gguf eval throughput`: tokens per second of `clover-gguf serve
--parallel N` for each N, with the grouping the server did (throughput.md)."""

from __future__ import annotations

import json
from pathlib import Path

from ...outputs import write_text
from .helpers import spread_cell


def throughput_markdown(run: dict) -> str:
    c, res = run["config"], run["results"]
    env = c.get("environment", {})
    base = res[0]["tok_per_s"]["median"] if res else 0
    lines = [
        "# Serving throughput: `clover-gguf serve --parallel N`",
        "",
        f"Model `{Path(c['model']).name}`; N concurrent clients x {c['requests_per_client']} greedy completions "
        f"each of up to {c['max_tokens']} tokens, state reuse off; {c['runs']} runs per N; server args "
        f"`{' '.join(c['server_args']) or '(none)'}`; clover {json.dumps(c['clover'])}.",
        f"Machine: {env.get('cpu', {}).get('model', '?')}, {env.get('cpu', {}).get('usable_cores', '?')} usable cores; "
        f"load average at the start {env.get('cpu', {}).get('loadavg_at_start')}.",
        "",
        "| N | tok/s median [p10–p90] | × N=1 | request latency s | denoising graphs / sequence steps "
        "| largest group | replies = N=1's | load average (1, 5, 15 min) after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res:
        ratio = r["tok_per_s"]["median"] / base if base else 0
        gs = f"{r['denoise_graphs']} / {r['sequence_steps']}"
        lines.append(
            f"| {r['parallel']} | {spread_cell(r['tok_per_s'], nd=1)} | {ratio:.2f} | {spread_cell(r['latency_s'], nd=2)} | {gs} "
            f"| {r['largest_group']} | {'yes' if r['same_replies_as_first'] else '**no**'} "
            f"| {', '.join(str(x) for x in r['loadavg_after'] or [])} |"
        )
    lines += [
        "",
        "tok/s counts completion tokens (up to an end token) over each run's wall time, all clients together. "
        "Fewer denoising graphs than sequence steps means that grouped requests shared graphs.",
        "",
    ]
    return "\n".join(lines)


def render_throughput(run: dict, out_dir: str | Path) -> Path:
    """Write throughput.md (the run's own report name) into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "throughput.md"
    write_text(path, throughput_markdown(run))
    return path
