"""report.md and tools.png of `clover-gguf eval tools` from its run dict."""

from __future__ import annotations

from pathlib import Path

from .helpers import config_markdown, md_table, pyplot

PCT_FIGURES = [
    ("valid_calls", "valid calls %"),
    ("name_accuracy", "right name %"),
    ("call_rate", "call rate %"),
    ("json_validity", "JSON valid %"),
    ("schema_validity", "schema valid %"),
    ("returned_calls_valid", "returned calls valid %"),
    ("exact_arguments", "exact args (transcript) %"),
    ("same_call_as_bf16", "same call as BF16 %"),
    ("calls_where_none_expected", "calls where none expected %"),
]
TPS_FIGURES = [("tokens_per_step_call", "tok/step call"), ("tokens_per_step_prose", "tok/step prose"),
               ("tokens_per_step_think", "tok/step think")]  # fmt: skip


def _v(s: dict, scale: float = 1.0, nd: int = 1) -> str:
    if not s or not s.get("n"):
        return "–"
    if s["n"] == 1 or s["p10"] == s["p90"]:
        return f"{s['median'] * scale:.{nd}f}"
    return f"{s['median'] * scale:.{nd}f} [{s['p10'] * scale:.{nd}f}–{s['p90'] * scale:.{nd}f}]"


def figures_table(run: dict) -> str:
    rows = []
    for t in run["targets"]:
        for mode, s in t["modes"].items():
            c = s["counts"]
            rows.append(
                [t["name"], mode]
                + [_v(s[k], 100) for k, _ in PCT_FIGURES]
                + [_v(s[k], 1, 2) for k, _ in TPS_FIGURES]
                + [f"{c['expected_calls']} / {c['turns_expecting_none']}"]
                + [f"{c.get('cut_sections', '–')} / {c.get('turns_with_outside_call', '–')}"]
            )
    head = (
        ["file", "decoding"]
        + [h for _, h in PCT_FIGURES]
        + [h for _, h in TPS_FIGURES]
        + ["calls / no-call turns", "cut at the limit / call outside a section"]
    )
    return md_table(head, rows)


def stability_table(run: dict) -> str:
    def pct(a):
        return f"{100 * a['blocks_revised'] / a['blocks']:.1f} ({a['blocks']})" if a["blocks"] else "–"

    rows = []
    for name, st in run.get("stability", {}).items():
        for sched, a in st["schedules"].items():
            pos = 100 * a["positions_revised"] / a["positions_checked"] if a["positions_checked"] else float("nan")
            rows.append(
                [name, sched, pct(a)] + [pct(a["by_class"][k]) for k in ("call", "prose", "think")] + [f"{pos:.1f}"]
            )
    head = ["file", "schedule", "blocks revised % (blocks)", "call blocks", "prose blocks", "think blocks",
            "positions revised %"]  # fmt: skip
    return md_table(head, rows)


def examples(run: dict, n: int = 3) -> list[str]:
    """The first n turns that expect a call: the expected call and each file's free reply."""
    ref = run["targets"][0]["records"]["free"][0]
    ids = [r["id"] for r in ref if r["matched"]][:n]
    L = []
    for i in ids:
        L += [f"**{i}**", ""]
        for t in run["targets"]:
            recs = t["records"].get("free") or next(iter(t["records"].values()))
            r = next(x for x in recs[0] if x["id"] == i)
            L += [f"{t['name']}:", "", "```", r["text"][:600], "```", ""]
    return L


def tools_markdown(run: dict, plot: str | None) -> str:
    c = run["config"]
    sched = f"steps {c['steps']}" if c["steps"] else f"threshold {c['threshold']}"
    L = [
        "# Tool calls on held-out transcripts",
        "",
        f"{c['turns']} assistant turns of `{c.get('heldout') or 'evaldata/tools/heldout.jsonl'}` "
        f"(held-out stdlib modules, tool combinations never offered in training), each generated after its "
        f"history as the server renders it; {sched}, temperature {c['temperature']}, max {c['max_new_tokens']} "
        f"new tokens, {c['repeats']} repeat(s) (median [p10–p90] when they differ). free = no grammar; "
        "constrained = the server's tool_choice auto (the tool-call grammar from the first `<tool_call>` on). "
        "valid calls: expected calls answered by a section that parses and validates against the named, "
        "offered tool's schema; same call as BF16: the same name and arguments as the BF16 reference's free "
        "reply (constrained rows: as the first file's constrained reply, since a grammar unmasks a call left to "
        "right), where both wrote a parsable call. schema valid: of the sections emitted, one the token limit "
        "cut counting as invalid; returned calls valid: of the closed sections that parse as a call, the ones "
        "the server returns as tool_calls (constrained: what the grammar guarantees). cut at the limit: "
        "sections still open when the turn reached the token limit; call outside a section: replies that "
        "wrote a call's JSON without `<tool_call>` (the server returns it as text; a lazy grammar never sees "
        "it). tok/step: tokens per denoising step on the blocks mostly "
        "inside a tool call, in prose, in thinking.",
        "",
        figures_table(run),
        "",
    ]
    L += [f"> {n}\n" for n in run.get("notes", [])]
    if plot:
        L += [f"![tools]({plot})", ""]
    if run.get("stability"):
        n = next(iter(run["stability"].values()))["turns"]
        L += [
            "## Formatting stability inside a block",
            "",
            f"{n} turns that expect a call, greedy, 64 tokens each. A finished block is revised when some "
            "position unmasked before the block's last step, masked again alone with the rest of the finished "
            "block visible, gets another argmax than the token committed there (eval/quality/stability.py).",
            "",
            stability_table(run),
            "",
        ]
    L += ["## Examples", "", *examples(run)]
    if c.get("environment"):
        L.append(config_markdown(c["environment"]))
    return "\n".join(L)


def plot_tools(run: dict, path: Path) -> None:
    plt = pyplot()
    rows = [(f"{t['name']}\n{m}", s) for t in run["targets"] for m, s in t["modes"].items()]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 0.5 * len(rows) + 2.2))
    keys = [("valid_calls", "valid calls"), ("name_accuracy", "right name"), ("calls_where_none_expected", "calls where none expected")]  # fmt: skip
    h = 0.8 / len(keys)
    for j, (k, lab) in enumerate(keys):
        a1.barh([i + j * h for i in range(len(rows))], [100 * (s[k].get("median") or 0) for _, s in rows], h, label=lab)
    a1.axvline(80, color="gray", ls="--", lw=0.8)
    a1.axvline(70, color="gray", ls=":", lw=0.8)
    a1.set_xlabel("%")
    a1.set_yticks([i + h for i in range(len(rows))], [r for r, _ in rows], fontsize=7)
    a1.invert_yaxis()
    a1.legend(fontsize=7)
    h = 0.8 / len(TPS_FIGURES)
    for j, (k, lab) in enumerate(TPS_FIGURES):
        a2.barh([i + j * h for i in range(len(rows))], [s[k].get("median") or 0 for _, s in rows], h, label=lab)
    a2.set_yticks([])
    a2.invert_yaxis()
    a2.set_xlabel("tokens per denoising step")
    a2.legend(fontsize=7)
    fig.suptitle("Tool calls on held-out transcripts")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render_tools(run: dict, out_dir) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot_tools(run, out / "tools.png")
    md = out / "report.md"
    md.write_text(tools_markdown(run, "tools.png"))
    return md
