"""The report of `clover-gguf eval agent`: model time against tool time per run and per turn,
cold and warm, and the timeline plot."""

from __future__ import annotations

import json
from pathlib import Path

from ...outputs import save_figure, write_text
from .helpers import config_markdown, md_table, pyplot, spread_cell

RUN_HEAD = ["mode", "wall s", "model s", "tool s", "other s", "model share %", "prefill tokens", "reused tokens",
            "first block ms (all turns)"]  # fmt: skip
TURN_HEAD = ["turn", "tool before it", "cold first block ms", "cold prefill / reused", "cold model ms",
             "warm first block ms", "warm prefill / reused", "warm model ms", "tool ms", "tokens/step"]  # fmt: skip


def intro(run: dict) -> list[str]:
    """The title, what was run and how to read the figures, and whether cold and warm agree."""
    c, s = run["config"], run["summary"]
    sc = c.get("server", {}).get("config", {})
    return [
        "# Agent loop: model time vs tool time",
        "",
        f"Server `{c['url']}`, model `{c['model']}`; server threads {sc.get('threads')}, GPU layers "
        f"{sc.get('n_gpu_layers')}, parallel {sc.get('parallel')}, ctx-cache {sc.get('ctx_cache')} snapshots. "
        f"{c['repeats']} repeat(s) of {len(c['traces'])} trace(s), each replayed cold (no state reuse) and warm "
        f"(state reuse); greedy, max_tokens {c['max_tokens']}, thinking off, clover {json.dumps(c['clover'])}. "
        "Figures: median [p10–p90] over the repeats. Times are the client's (openai, streaming): first block = "
        "request sent to first SSE event; model = request sent to last event; tool = the real tool step "
        "before the turn.",
        "",
        f"Replies identical cold vs warm: {s['identical_replies']['identical']} of {s['identical_replies']['replays']} replays.",
        "",
    ]


def per_run_table(summary: dict) -> str:
    """One row per mode (cold, warm): a whole replay's times and tokens."""
    rows = []
    for mode in ("cold", "warm"):
        m = summary["by_mode"][mode]
        rows.append(
            [mode]
            + [spread_cell(m[k], nd=nd) for k, nd in (("wall_s", 2), ("model_s", 2), ("tool_s", 3), ("other_s", 3))]
            + [spread_cell(m["model_share"], 100, 1)]
            + [spread_cell(m[k], nd=0) for k in ("prefill_tokens", "reused_tokens", "ttfb_ms")]
        )
    return md_table(RUN_HEAD, rows)


def per_turn_table(run: dict, name: str, modes: dict) -> str:
    """One row per turn of trace `name`: cold and warm side by side, then the tool before it."""
    trace = next(t for t in run["config"]["traces"] if t["name"] == name)
    first = next(r for r in run["replays"] if r["trace"] == name)
    rows = []
    for i in range(trace["steps"] + 1):
        row = [i, first["turns"][i]["tool"] or "(task)"]
        for mode in ("cold", "warm"):
            t = modes[mode]["turns"][i]
            row += [
                spread_cell(t["ttfb_ms"], nd=0),
                f"{spread_cell(t['prefill_tokens'], nd=0)} / {spread_cell(t['reused_tokens'], nd=0)}",
                spread_cell(t["model_ms"], nd=0),
            ]
        warm = modes["warm"]["turns"][i]
        row += [spread_cell(warm["tool_ms"], nd=1), spread_cell(warm["tokens_per_step"], nd=2)]
        rows.append(row)
    return md_table(TURN_HEAD, rows)


def agent_markdown(run: dict, timeline: str | None) -> str:
    c, s = run["config"], run["summary"]
    L = intro(run) + ["## Per run", "", per_run_table(s), ""]
    if timeline:
        L += [f"![timeline]({timeline})", ""]
    L += ["## Per turn", ""]
    for name, modes in s["by_trace"].items():
        L += [f"### {name}", "", per_turn_table(run, name, modes), ""]
    env = c.get("environment")
    if env:
        L.append(config_markdown(env))
    L += ["Server configuration (`/props`):", "", "```json", json.dumps(c.get("server", {}), indent=1), "```", ""]
    return "\n".join(L)


def plot_timeline(run: dict, path: Path) -> None:
    """Repeat 0 of every trace, cold and warm: tool steps, prefill (the server's), the rest of the
    wait for the first block (its denoising), the later blocks."""
    from matplotlib.patches import Patch

    plt = pyplot()
    rs = [r for r in run["replays"] if r.get("repeat", 0) == 0]
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(rs) + 1.8))
    parts = {"tool": ("#9e9e9e", "tool step"), "prefill": ("#d62728", "prefill (server)"),
             "first": ("#ff9800", "first block"), "gen": ("#1f77b4", "later blocks")}  # fmt: skip
    for y, r in enumerate(rs):
        for t in r["turns"]:
            tl = t["timeline"]
            if tl["tool"]:
                ax.barh(y, tl["tool"][1] - tl["tool"][0], left=tl["tool"][0], color=parts["tool"][0], height=0.6)
            a, b, e = tl["request"]
            p = min(b, a + t["server_ms"]["prefill_ms"] / 1e3)
            for k, x0, x1 in (("prefill", a, p), ("first", p, b), ("gen", b, e)):
                ax.barh(y, x1 - x0, left=x0, color=parts[k][0], height=0.6)
    ax.set_yticks(range(len(rs)), [f"{r['trace']} ({r['mode']})" for r in rs])
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the start of the replay")
    ax.set_title("Agent loop timeline (repeat 0)")
    ax.legend(handles=[Patch(color=c, label=lab) for c, lab in parts.values()], loc="lower right", fontsize=8)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def render_agent(run: dict, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot_timeline(run, out / "timeline.png")
    md = out / "report.md"
    write_text(md, agent_markdown(run, "timeline.png"))
    return md
