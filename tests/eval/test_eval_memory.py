"""`clover-gguf eval memory` (train/memory_traces.py, eval/quality/memory.py, eval/render/memory.py):
the trace generator, the scoring of hand-made replies, the figures over seeds, the options, and a
real run of clover-tiny v3 (the PyTorch reference and a GGUF through the runtime)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from clover_gguf.cli import cli
from clover_gguf.eval.quality import memory as MM
from clover_gguf.eval.quality import tools as E
from clover_gguf.tokenizer import CloverTokenizer
from clover_gguf.train import memory_traces as MT
from clover_gguf.train import toolset
from clover_gguf.train.corpus_facts import split_corpus
from clover_gguf.util import DEFAULT_MODEL

V3 = DEFAULT_MODEL.parent / "clover-tiny-v3-wip"  # the snapshot that makes tool calls (v2 never opens one)


@pytest.fixture(scope="module")
def tok():
    return CloverTokenizer.from_dir(V3)


def _mentions(trace: dict, s: str) -> list[int]:
    """The messages whose text or calls contain s."""
    return [i for i, m in enumerate(trace["messages"]) if s in json.dumps(m)]


# ----------------------------------------------------------------------------- the generator


def test_traces_are_deterministic_and_talk_about_heldout_files_only():
    held = split_corpus("heldout")
    heldout = {f.path for f in held.files} | set(held.dirs)  # files, and list_dir's package folders
    train = {f.path for f in split_corpus("train").files}
    for i in range(len(MT.KINDS) * 2):
        a, b = MT.make_trace(7, i, 16), MT.make_trace(7, i, 16)
        assert a == b
        assert a["kind"] == MT.KINDS[i % len(MT.KINDS)] and a["n_results"] == 16
        assert MT.make_trace(8, i, 16)["messages"] != a["messages"]  # another seed, another trace
        assert toolset.heldout_combination(a["tools"]) and 2 <= len(a["tools"]) <= toolset.MAX_OFFERED
        paths = [
            v
            for m in a["messages"]
            for c in m.get("tool_calls") or []
            for k, v in c["function"]["arguments"].items()
            if k == "path"
        ]
        assert paths and all(p in heldout and p not in train for p in paths)
        # every call the history and the expected turn make is offered and fits its schema
        offered = toolset.tool_schemas(a["tools"])
        for m in a["messages"]:
            for c in m.get("tool_calls") or []:
                assert not toolset.schema_errors(c["function"]["name"], c["function"]["arguments"], offered)
        assert sum(m["role"] == "tool" for m in a["messages"]) == 16 + (a["kind"] == "recall_result")


def test_the_fact_is_early_once_and_the_expected_call_uses_it():
    for i, kind in enumerate(MT.KINDS):
        t = MT.make_trace(3, i, 16)
        fact = t["fact"]
        assert fact["message"] <= 3  # in the first request, or the first tool result
        assert _mentions(t, fact["text"])[0] == fact["message"]
        final = t["messages"][-1]
        chk = t["check"]
        if kind in MT.RECALL_KINDS:
            path = chk["arguments"]["path"]
            # the path is in the fact's message (and its call) and in the expected call only: the
            # final request does not name it, no filler mentions it or the probe's distractors
            assert _mentions(t, path) in ([fact["message"], len(t["messages"]) - 1], [fact["message"] - 1, fact["message"], len(t["messages"]) - 1])  # fmt: skip
            assert path not in t["messages"][-2]["content"]
            args = final["tool_calls"][0]["function"]["arguments"]
            assert all(args[k] == v for k, v in chk["arguments"].items())
            assert t["probe"]["value"] == path and len(t["probe"]["distractors"]) == MT.N_DISTRACTORS
            assert path not in t["probe"]["distractors"]
            assert not any(_mentions(t, d) for d in t["probe"]["distractors"])
        else:
            assert fact["text"] in t["messages"][1]["content"] and t["probe"] is None
        if kind == "comply_tests":
            args = final["tool_calls"][0]["function"]["arguments"]
            assert all(args[k] == v for k, v in chk["arguments"].items())
            assert not any(c["function"]["name"] == "run_tests" for m in t["messages"][:-1] for c in m.get("tool_calls") or [])  # fmt: skip
        if kind == "comply_grep":
            assert {"grep", "find_symbol", "read_file"} <= set(t["tools"])
            used = {c["function"]["name"] for m in t["messages"][:-1] for c in m.get("tool_calls") or []}
            assert not used & {"find_symbol", "read_file"}
        if kind == "comply_sentence":
            assert not final.get("tool_calls") and MT.one_sentence(final["content"])


def test_n_changes_only_the_fillers_and_distances_grow(tok):
    for i in range(len(MT.KINDS)):
        traces = [MT.make_trace(0, i, n) for n in (1, 4, 16)]
        a, b, c = (t["messages"] for t in traces)
        head = 2 + 2 * (traces[0]["kind"] == "recall_result")  # system, request (, the fact's call and result)
        assert a[:head] == b[:head] == c[:head]
        assert b[: head + 8] == c[: head + 8]  # N=4's fillers are N=16's first four
        assert a[-2:] == b[-2:] == c[-2:]  # the same final request and expected turn
        dist = [MM.fact_distance(tok, t) for t in traces]
        assert dist[0][1] < dist[1][1] < dist[2][1]
        assert all(0 < d < n for n, d in dist)
    with pytest.raises(ValueError, match="recall kind"):
        MT.make_trace(0, 0, 4, control=True)


def test_swap_fact_puts_a_distractor_in_the_facts_place():
    for i in (0, 1):
        t = MT.make_trace(2, i, 4)
        w = MT.swap_fact(t)
        f, d = t["probe"]["value"], t["probe"]["distractors"][0]
        head, whead = t["messages"][:-1], w["messages"][:-1]
        assert not _mentions({"messages": whead}, f) and _mentions({"messages": head}, f)
        assert _mentions({"messages": whead}, d) == _mentions({"messages": head}, f)  # the same place
        assert w["messages"][-1] == t["messages"][-1] and w["tools"] == t["tools"]
        assert json.dumps(whead).replace(d, f) == json.dumps(head)  # nothing else changed
    with pytest.raises(ValueError, match="not a recall trace"):
        MT.swap_fact(MT.make_trace(2, 2, 4))


def test_controls_drop_only_the_instruction():
    for i in (2, 3, 4):
        t, c = MT.make_trace(1, i, 4), MT.make_trace(1, i, 4, control=True)
        assert t["fact"]["text"] in t["messages"][1]["content"]
        assert t["fact"]["text"] not in c["messages"][1]["content"] and c["messages"][1]["content"]
        assert c["fact"] is None and c["control"] and c["check"] == t["check"]
        assert t["messages"][2:] == c["messages"][2:] and t["tools"] == c["tools"]


# ----------------------------------------------------------------------------- scoring


def _call(tool, **args):
    return f"<tool_call>\n{json.dumps({'name': tool, 'arguments': args})}\n</tool_call>"


def _score(trace, text, ended=True):
    tools = toolset.tool_schemas(trace["tools"])
    return MT.score_reply(trace, E.parse_sections(text, tools), text, ended)


def test_one_sentence():
    assert MT.one_sentence("I looked at three files, and os.path is the one to read.")
    assert MT.one_sentence("It is 3.5 times faster")
    assert MT.one_sentence("  Nothing needs a change!  ")
    assert not MT.one_sentence("I looked at three files. The first is os.py.")
    assert not MT.one_sentence("Done.\nNext, read os.py.")
    assert not MT.one_sentence("")
    assert not MT.one_sentence("Really? Yes.")


def test_score_recall_and_compliance_on_hand_made_replies():
    req = next(MT.make_trace(0, i, 1) for i in range(0, 50, 5) if MT.make_trace(0, i, 1)["check"]["name"] == "count_lines")  # fmt: skip
    p = req["check"]["arguments"]["path"]
    s = _score(req, _call("count_lines", path=p))
    assert s == {
        "called": True,
        "valid": True,
        "right_tool": True,
        "recall_by_argument": {"path": True},
        "recall": True,
    }
    assert not _score(req, _call("count_lines", path="other.py"))["recall"]
    s = _score(req, "Let me count.\n" + _call("git_log", path=p))  # the fact, the wrong tool
    assert not s["recall"] and not s["right_tool"] and s["called"]
    assert not _score(req, "It has 300 lines.")["called"]

    res = MT.make_trace(0, 1, 1)  # recall_result: path and start line
    a = res["check"]["arguments"]
    assert _score(res, _call("read_file", path=a["path"], start_line=a["start_line"], end_line=a["start_line"] + 9))["recall"]  # fmt: skip
    s = _score(res, _call("read_file", path=a["path"], start_line=str(a["start_line"])))  # a string, not the line
    assert not s["recall"] and s["recall_by_argument"] == {"path": True, "start_line": False} and not s["valid"]

    tests = MT.make_trace(0, 2, 1)  # comply_tests
    rule, m = tests["check"]["arguments"], tests["messages"][-1]["tool_calls"][0]["function"]["arguments"]["target"]
    assert _score(tests, _call("run_tests", target=m, **rule))["compliance"]
    assert not _score(tests, _call("run_tests", target=m))["compliance"]
    wrong = {k: (False if v is True else v + 1) for k, v in rule.items()}
    assert not _score(tests, _call("run_tests", target=m, **wrong))["compliance"]

    grep = MT.make_trace(0, 3, 1)  # comply_grep
    assert _score(grep, _call("grep", pattern="x", path="a.py"))["compliance"]
    assert not _score(grep, _call("find_symbol", name="x", kind="function"))["compliance"]
    assert not _score(grep, _call("grep", pattern="x", path="a.py") + "\n" + _call("read_file", path="a.py"))["compliance"]  # fmt: skip
    assert not _score(grep, "It is defined on line 3.")["compliance"]

    sent = MT.make_trace(0, 4, 1)  # comply_sentence
    assert _score(sent, "I read four files, and none needs a change.")["compliance"]
    assert not _score(sent, "I read four files. None needs a change.")["compliance"]
    assert not _score(sent, "I read four files, and", ended=False)["compliance"]  # cut at the limit
    assert not _score(sent, _call("grep", pattern="x", path="a.py"))["compliance"]


def _rec(seed, n, kind, hit, control=False, dist=100):
    key = "recall" if kind in MT.RECALL_KINDS else "compliance"
    score = {key: hit, "called": True, "valid": hit, "right_tool": True}
    if key == "recall":
        score["recall_by_argument"] = {"path": hit}
    return {"seed": seed, "n_results": n, "kind": kind, "control": control, "score": score, "prompt_tokens": dist + 50,
            "distance": None if control else dist, "committed": 32, "steps": 16}  # fmt: skip


def test_summarize_spreads_over_seeds():
    recs = [
        _rec(0, 4, "recall_request", True),
        _rec(1, 4, "recall_request", False),
        _rec(2, 4, "recall_request", False),
    ]
    recs += [_rec(s, 4, "recall_result", False, dist=300) for s in range(3)]
    recs += [_rec(s, 4, "comply_tests", s == 0) for s in range(3)] + [_rec(s, 4, "comply_tests", True, True) for s in range(3)]  # fmt: skip
    s = MM.summarize(recs, [0, 1, 2])
    r = s["recall"]["4"]
    assert r["recall"]["values"] == [0.5, 0.0, 0.0] and r["recall"]["median"] == 0.0
    assert r["recall"]["p90"] == pytest.approx(0.4)
    assert r["counts"] == {"traces": 6, "hits": 1, "per_seed": 2}
    assert r["distance_tokens"] == {"mean": 200, "min": 100, "max": 300}
    assert r["tokens_per_step"]["median"] == 2.0
    assert s["recall_request"]["all"]["recall"]["values"] == [1.0, 0.0, 0.0]
    assert s["compliance"]["4"]["compliance"]["values"] == [1.0, 0.0, 0.0]
    assert s["control"]["4"]["compliance"]["values"] == [1.0, 1.0, 1.0]
    assert s["control_comply_tests"]["all"]["compliance"]["values"] == [1.0, 1.0, 1.0]
    assert s["every"]["all"]["counts"]["traces"] == len(recs) and s["every"]["all"]["counts"]["hits"] is None
    assert s["control"]["4"]["distance_tokens"] is None  # a control has no fact


def test_bad_options_are_one_line():
    base = ["eval", "memory", "--reference", str(V3)]
    for extra, words in [
        (["--modes", "free,fast"], "'fast' is not one of"),
        (["--kinds", "recall_request,recall_all"], "'recall_all' is not one of"),
        (["--block-sizes", "8,0"], "--block-sizes 8,0"),
        (["--block-sizes", "8,x"], "comma-separated integers"),
        (["--n-results", "4,2000"], "--n-results 4,2000"),
        (["--block-sizes", "8,16", "--steps", "16"], "--steps 16: must be at most the smallest block size (8)"),
    ]:
        r = CliRunner().invoke(cli, base + extra)
        assert r.exit_code != 0 and words in r.output and "Traceback" not in r.output, (extra, r.output)
        assert len(r.output.strip().splitlines()) <= 3, r.output  # click's usage line + the one error line


# ----------------------------------------------------------------------------- a real run


def test_run_on_clover_tiny_v3(converted, tmp_path):
    """The command end to end: two kinds (a recall kind and a compliance kind with its control), N 1
    and 4, one block size, the reference (free) and a GGUF (free and constrained); JSON, Markdown and
    PNG written; every reply has a record; the prompts are the same tokens in both providers."""
    gguf = str(converted(V3, "q8_0"))
    out = tmp_path / "out"
    args = ["eval", "memory", "--reference", str(V3), gguf, "--block-sizes", "16", "--n-results", "1,4",
            "--seeds", "1", "--kinds", "recall_request,comply_sentence", "--threads", "1", "--name", "Q8_0",
            "--out", str(out)]  # fmt: skip
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    run = json.loads((out / "memory.json").read_text())
    assert run["kind"] == "memory" and run["config"]["traces_per_file_mode_block"] == 6  # 2 + 2x2 (control)
    assert [(t["name"], list(t["modes"])) for t in run["targets"]] == [
        ("BF16 (PyTorch reference)", ["free"]),
        ("Q8_0", ["free", "constrained"]),
    ]
    by_id = {}
    for t in run["targets"]:
        for mode, by_b in t["records"].items():
            recs = by_b["16"]
            assert len(recs) == 6 and {r["mode"] for r in recs} == {mode}
            for x in recs:
                by_id.setdefault(x["id"], set()).add(x["prompt_tokens"])
                assert x["steps"] >= 1 and x["committed"] >= x["steps"]
            s = t["modes"][mode]["16"]
            assert s["recall"]["1"]["counts"]["traces"] == 1 and s["control"]["all"]["counts"]["traces"] == 2
            assert 0 <= s["recall"]["all"]["recall"]["median"] <= 1
        probe = t["probe_records"]["16"]
        assert len(probe) == 2 and all(len(p["distractors"]) == MT.N_DISTRACTORS for p in probe)
        for p in probe:
            assert p["margin"] == pytest.approx(p["fact"] - sum(p["distractors"]) / 4)
            assert len(p["swapped"]) == 1 + MT.N_DISTRACTORS
            gain_fact, gain_distractor = p["fact"] - p["swapped"][0], p["swapped"][1] - p["distractors"][0]
            assert p["lift"] == pytest.approx((gain_fact + gain_distractor) / 2)
        assert t["probe"]["16"]["all"]["counts"]["traces"] == 2
    assert all(len(v) == 1 for v in by_id.values())  # the runtime's prompt is the reference's, token for token
    d = {t["id"]: t["distance"] for t in run["traces"]}
    assert d["memory-0-0-n1"] < d["memory-0-0-n4"] and d["memory-0-4-n4-control"] is None
    assert (out / "memory.png").stat().st_size > 1000
    md = (out / "report.md").read_text()
    assert "| Q8_0 | constrained | 16 |" in md and "Fastest vs most reliable" in md and "Likelihood probe" in md
    # `clover-gguf report` renders the saved run again
    r = CliRunner().invoke(cli, ["report", str(out / "memory.json"), "-o", str(tmp_path / "again")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "again" / "report.md").read_text() == md
