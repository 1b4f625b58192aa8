"""report.md and memory.png of `clover-gguf eval memory` from its run dict."""

from __future__ import annotations

from pathlib import Path

from ...outputs import save_figure, write_text
from .helpers import config_markdown, md_table, pyplot


def _pct(s: dict | None) -> str:
    """A spread over seeds as "median [p10–p90]" in percent ("–": no value)."""
    if not s or not s.get("n"):
        return "–"
    if s["p10"] == s["p90"]:
        return f"{100 * s['median']:.0f}"
    return f"{100 * s['median']:.0f} [{100 * s['p10']:.0f}–{100 * s['p90']:.0f}]"


def _spread(s: dict | None, nd: int = 2) -> str:
    """A spread over seeds as "median [p10–p90]"."""
    if not s or not s.get("n"):
        return "–"
    if s["p10"] == s["p90"]:
        return f"{s['median']:+.{nd}f}"
    return f"{s['median']:+.{nd}f} [{s['p10']:+.{nd}f}, {s['p90']:+.{nd}f}]"


def _num(s: dict | None, nd: int = 2) -> str:
    if not s or not s.get("n"):
        return "–"
    return f"{s['median']:.{nd}f}"


def rows_of(run: dict):
    """(target name, mode, block size, {group: {N: figures}}) in the run's order."""
    for t in run["targets"]:
        for mode, by_b in t["modes"].items():
            for b, s in by_b.items():
                yield t["name"], mode, b, s


def n_values(run: dict) -> list[str]:
    return [str(n) for n in run["config"]["n_results"]]


def _distance_head(run: dict, group: str) -> dict:
    """{N: "N=16 (~1,950 tok)"} from the first row that has the group."""
    out = {}
    for _, _, _, s in rows_of(run):
        if group in s:
            for n in n_values(run):
                d = (s[group].get(n) or {}).get("distance_tokens")
                out[n] = f"N={n} (~{d['mean']:,.0f} tok)" if d else f"N={n}"
            break
    return out


def by_n_table(run: dict, group: str, key: str) -> str:
    """Rows file × decoding × block size; a column per N (and all N): median [p10–p90] % over
    seeds, with hits/traces pooled over seeds."""
    ns = n_values(run)
    head_n = _distance_head(run, group)
    rows = []
    for name, mode, b, s in rows_of(run):
        g = s.get(group)
        if not g:
            continue
        cells = []
        for n in [*ns, "all"]:
            f = g.get(n)
            c = f["counts"] if f else None
            cells.append(f"{_pct(f[key])} ({c['hits']}/{c['traces']})" if f else "–")
        rows.append([name, mode, b, *cells])
    return md_table(["file", "decoding", "B", *[head_n.get(n, f"N={n}") for n in ns], "all N"], rows)


def reliability_table(run: dict) -> str:
    """Fastest vs most reliable: per file, decoding and block size, the tokens per step of the
    replies beside recall, the probe's lift, compliance (and its control), valid calls, over every N."""
    rows = []
    for t in run["targets"]:
        for mode, by_b in t["modes"].items():
            for b, s in by_b.items():

                def fig(group, key, s=s):
                    return ((s.get(group) or {}).get("all") or {}).get(key)

                every = [s[g]["all"] for g in ("recall", "compliance", "control") if g in s]
                probe = ((t.get("probe") or {}).get(b) or {}).get("all") or {}
                rows.append(
                    [
                        t["name"],
                        mode,
                        b,
                        _num(fig("every", "tokens_per_step")),
                        _pct(fig("recall", "recall")),
                        _pct(fig("recall", "recall_path")),
                        _spread(probe.get("lift")),
                        _pct(fig("compliance", "compliance")),
                        _pct(fig("control", "compliance")),
                        _pct(fig("recall", "valid_calls")),
                        sum(f["counts"]["traces"] for f in every),
                    ]
                )
    head = ["file", "decoding", "B", "tok/step", "exact recall %", "path recalled %",
            "probe: lift, nats/token", "compliance %", "rule holds without the instruction %",
            "valid calls (recall traces) %", "replies"]  # fmt: skip
    return md_table(head, rows)


def probe_table(run: dict) -> str:
    """The likelihood probe per file and block size, a column per N: the lift (median [p10–p90]
    over seeds, nats per token; the traces with a positive lift), then how often the mentioned
    path scores first (two per trace)."""
    ns = n_values(run)
    head_n = _distance_head(run, "recall")
    rows = []
    for t in run["targets"]:
        for b, p in (t.get("probe") or {}).items():
            cells = []
            for n in [*ns, "all"]:
                f = p.get(n)
                if not f:
                    cells.append("–")
                    continue
                c = f["counts"]
                cells.append(
                    f"{_spread(f['lift'])} ({c['lift_positive']}/{c['traces']} > 0); "
                    f"{_pct(f['mentioned_first'])} ({c['mentioned_first']}/{2 * c['traces']})"
                )
            rows.append([t["name"], b, *cells])
    return md_table(["file", "B", *[head_n.get(n, f"N={n}") for n in ns], "all N"], rows)


def kinds_table(run: dict) -> str:
    """Per kind, all N pooled: recall (recall kinds) or compliance (compliance kinds), and a
    compliance kind's rate on its controls (the same traces without the instruction)."""
    from ...train.memory_traces import KINDS, RECALL_KINDS

    cols = []
    for k in KINDS:
        if any(k in s for *_, s in rows_of(run)):
            cols.append((k, k, "recall" if k in RECALL_KINDS else "compliance"))
            if any(f"control_{k}" in s for *_, s in rows_of(run)):
                cols.append((f"control_{k}", f"{k} without the instruction", "compliance"))
    rows = []
    for name, mode, b, s in rows_of(run):
        cells = []
        for g, _, key in cols:
            f = (s.get(g) or {}).get("all")
            cells.append(f"{_pct(f[key])} ({f['counts']['hits']}/{f['counts']['traces']})" if f else "–")
        rows.append([name, mode, b, *cells])
    return md_table(["file", "decoding", "B", *[h for _, h, _ in cols]], rows)


def examples(run: dict, n_show: int = 4) -> list[str]:
    """The first traces of each kind at the largest N: each file's reply at the model's block size."""
    from ...train.memory_traces import KINDS

    big = str(max(run["config"]["n_results"]))
    L = []
    for kind in KINDS:
        ids = [t["id"] for t in run["traces"] if t["kind"] == kind and not t["control"] and str(t["n_results"]) == big]
        if not ids:
            continue
        tid = ids[0]
        tr = next(t for t in run["traces"] if t["id"] == tid)
        L += [f"**{tid}** ({kind}; expected: `{tr['check']}`; {tr['distance']} tokens from the fact)", ""]
        for t in run["targets"][:n_show]:
            for mode, by_b in t["records"].items():
                b = "16" if "16" in by_b else next(iter(by_b))
                r = next((x for x in by_b[b] if x["id"] == tid), None)
                if r:
                    sc = {k: v for k, v in r["score"].items() if k != "recall_by_argument"}
                    L += [f"{t['name']}, {mode}, B={b}: `{sc}`", "", "```", r["text"], "```", ""]
    return L


def probe_section(run: dict) -> list[str]:
    """The likelihood probe's heading, its reading and its table (none without probe records)."""
    if not any(t.get("probe") for t in run["targets"]):
        return []
    chance = next(
        (f["chance"] for t in run["targets"] for p in (t.get("probe") or {}).values() for f in p.values()), None
    )
    return [
        "## Likelihood probe: does an early mention raise a path's probability?",
        "",
        "Exact recall needs the whole path written right; the probe asks less. On each recall trace the "
        'prompt and the expected reply up to the path (`<tool_call>` ... `{"path": "`) are prefilled in '
        f"blocks of B, and the fact's path and {round(1 / chance) - 1 if chance else '–'} held-out paths the "
        "trace never mentions are scored by the mean log-probability per token of writing them left to "
        "right in the next block (each token with the ones before it visible, the rest masked). The same "
        "is scored on the swapped trace, where the first distractor takes the fact's place in the history "
        "and the fact is never mentioned, so each path's prior cancels out. lift: how much being the path "
        "mentioned early raises a path's score (nats per token; the mean of the fact's gain and the "
        "distractor's; 0 = the memory keeps nothing of the mention), median [p10, p90] over seeds of the "
        "seed's mean, with the traces whose lift is positive (half, by chance); then how often the "
        f"mentioned path scores first of the five, % (chance {100 * (chance or 0):.0f} %), over both "
        "traces. A trace is the same at every N but for the fillers: a lift falling with N is memory "
        "fading. The same for every decoding mode (no sampling).",
        "",
        probe_table(run),
        "",
    ]


def memory_markdown(run: dict, plot: str | None) -> str:
    c = run["config"]
    sched = f"steps {c['steps']}" if c["steps"] else f"threshold {c['threshold']}"
    per_cell = len([t for t in run["traces"] if str(t["n_results"]) == str(c["n_results"][0])])
    L = [
        "# Memory: instructions and facts after N tool results",
        "",
        f"Synthetic agent traces (`clover_gguf/train/memory_traces.py`, generator {c['trace_generator']}; "
        "held-out stdlib files only, tool sets reserved for held-out transcripts): the first request holds an "
        "instruction or a fact, N filler tool calls and their results follow, then a request that needs it. "
        f"{c['seeds']} seed(s) (independent draws of the traces) x {c['traces']} trace(s) per kind "
        f"({', '.join(c['kinds'])}), each at N = {', '.join(map(str, c['n_results']))}"
        f"{', compliance kinds also without their instruction (controls)' if c['controls'] else ''}: "
        f"{per_cell} replies per N, file, decoding and block size. The final turn is generated after the "
        f"trace's history as the server renders it (thinking off); {sched}, temperature {c['temperature']}, "
        f"max {c['max_new_tokens']} new tokens; the prompt is prefilled in blocks of B (the block size) too. "
        "free = no grammar; constrained = the server's tool_choice auto (the tool-call grammar from the first "
        "`<tool_call>` on).",
        "",
        "Figures: median [p10–p90] over seeds of the rate within a seed, then (hits/replies) pooled over "
        "seeds. **The counts per cell are small**: a cell's rate moves in steps of one reply over the "
        "replies of its seed. exact recall: the call with the expected name carries the fact exactly (the "
        "path; for recall_result the path and the start line); path recalled: the path alone. compliance: "
        "the rule holds (run_tests with verbose / the timeout; only grep; one sentence, no call); rule holds "
        "without the instruction: the same rule on the control traces. valid calls: the reply's first call "
        "fits its offered tool's schema. N=k (~t tok): the mean distance in tokens from the fact (or the "
        "instruction) to the end of the prompt. tok/step: tokens committed per denoising step, over the "
        "replies.",
        "",
        "## Exact recall by distance",
        "",
        by_n_table(run, "recall", "recall"),
        "",
        "## Compliance by distance",
        "",
        by_n_table(run, "compliance", "compliance"),
        "",
    ]
    if any("control" in s for *_, s in rows_of(run)):
        L += ["Without the instruction (controls; the rule's base rate):", "", by_n_table(run, "control", "compliance"), ""]  # fmt: skip
    L += probe_section(run)
    L += [
        "## Fastest vs most reliable",
        "",
        "Per block size, over every N: what a step commits beside what the replies get right.",
        "",
        reliability_table(run),
        "",
        "## By kind (every N)",
        "",
        kinds_table(run),
        "",
    ]
    if plot:
        L += [f"![memory]({plot})", ""]
    L += ["## Examples", "", *examples(run)]
    L.append(f"Run time: {run.get('seconds', 0) / 60:.1f} min.\n")
    if c.get("environment"):
        L.append(config_markdown(c["environment"]))
    return "\n".join(L)


def plot_memory(run: dict, path: Path) -> None:
    plt = pyplot()
    bs = [str(b) for b in run["config"]["block_sizes"]]
    groups = [("recall", "recall", "exact recall %"), ("compliance", "compliance", "compliance %")]
    if any(t.get("probe") for t in run["targets"]):
        groups.append(("probe", "fact_first", "probe: lift, nats/token"))
    fig, axes = plt.subplots(
        len(groups), len(bs), figsize=(3.6 * len(bs) + 1, 3.2 * len(groups)), squeeze=False, sharey="row"
    )
    lines = [(t["name"], m, by_b) for t in run["targets"] for m, by_b in t["modes"].items()]
    # the probe has one line per file (no decoding mode); its distances are the recall traces'
    probe_lines = [(t["name"], "probe", t.get("probe") or {}, next(iter(t["modes"].values()))) for t in run["targets"]]
    for gi, (group, key, label) in enumerate(groups):
        for bi, b in enumerate(bs):
            ax = axes[gi][bi]
            for j, (name, mode, by_b, dist_b) in enumerate(
                probe_lines if group == "probe" else [(*x, x[2]) for x in lines]
            ):
                g = (by_b.get(b) or {}) if group == "probe" else (by_b.get(b) or {}).get(group) or {}
                dg = (dist_b.get(b) or {}).get("recall" if group == "probe" else group) or {}
                pts = []
                for n in n_values(run):
                    f, d = g.get(n), (dg.get(n) or {}).get("distance_tokens")
                    if f and d and f[key].get("n"):
                        s, k = f[key], 1 if group == "probe" else 100
                        pts.append((d["mean"], k * s["median"], k * s["p10"], k * s["p90"]))
                if not pts:
                    continue
                x = [p[0] * (1 + 0.025 * (j - len(lines) / 2)) for p in pts]  # spread the markers apart
                y = [p[1] for p in pts]
                err = [[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]]
                lab = name if group == "probe" else f"{name} ({mode})"
                ax.errorbar(x, y, yerr=err, marker="o", ms=3, lw=1, capsize=2, label=lab)
            if group == "probe":
                ax.axhline(0, color="gray", ls=":", lw=0.8)
            ax.set_xscale("log")
            if group != "probe":
                ax.set_ylim(-5, 105)
            ax.set_title(f"B={b}", fontsize=9)
            if gi == len(groups) - 1:
                ax.set_xlabel("distance from the fact, tokens")
            if bi == 0:
                ax.set_ylabel(label)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=7)
    fig.suptitle("Memory: median and p10–p90 over seeds, by distance and block size")
    fig.tight_layout(rect=(0, 0.04 + 0.03 * ((len(lines) + 2) // 3), 1, 0.96))
    save_figure(fig, path)
    plt.close(fig)


def render_memory(run: dict, out_dir) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot_memory(run, out / "memory.png")
    md = out / "report.md"
    write_text(md, memory_markdown(run, "memory.png"))
    return md
