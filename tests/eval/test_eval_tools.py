"""`clover-gguf eval tools` (eval/quality/tools.py, stability.py; eval/render/tools.py): reading replies,
matching calls, the figures, and a real run of clover-tiny (PyTorch reference and a GGUF through
the runtime) on a held-out transcript."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from clover_gguf.cli import cli
from clover_gguf.eval.quality import tools as E
from clover_gguf.reference.generate import BlockStats, GenerationResult
from clover_gguf.train import toolset
from clover_gguf.train import transcripts as T
from clover_gguf.util import DEFAULT_MODEL

OFFERED = toolset.tool_schemas(["read_file", "grep"])
CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py", "start_line": 3}}\n</tool_call>'


def test_parse_sections():
    bad_json = '<tool_call>\n{"name": "grep", "arguments": {"pattern": "x"\n</tool_call>'
    bad_schema = '<tool_call>\n{"name": "grep", "arguments": {"pattern": 3, "path": "a.py"}}\n</tool_call>'
    not_offered = '<tool_call>\n{"name": "lint", "arguments": {"path": "a.py", "rules": []}}\n</tool_call>'
    s = E.parse_sections(
        "Let me look.\n" + "\n".join([CALL, bad_json, bad_schema, not_offered]) + "\n<tool_call>\n{", OFFERED
    )
    assert [(x["json"], x["schema"], x["closed"]) for x in s] == [
        (True, True, True),
        (False, False, True),
        (True, False, True),
        (True, False, True),
        (False, False, False),  # left open at the end of the turn
    ]
    assert s[0]["name"] == "read_file" and s[0]["arguments"] == {"path": "a.py", "start_line": 3}
    assert E.parse_sections("no calls here", OFFERED) == []


def test_split_turn_and_match_calls():
    r, c = E.split_turn("<think>\nread it\n</think>\n\n" + CALL + "<|im_end|>\nrest", thinking=True)
    assert r.strip() == "read it" and c == CALL
    assert E.split_turn("<think>x</think>" + CALL, thinking=False)[1].startswith("<think>")
    emitted = E.parse_sections(CALL + "\n" + CALL.replace("read_file", "grep"), OFFERED)
    exp = [{"name": "grep", "arguments": {}}, {"name": "read_file", "arguments": {}}, {"name": "grep", "arguments": {}}]
    m = E.match_calls(exp, emitted)
    assert [x and x["name"] for x in m] == ["grep", "read_file", None]


def test_token_labels_and_block_classes():
    pieces = [
        "<think>",
        "\nok\n",
        "</think>",
        "\n\n",
        "Sure",
        ".\n",
        "<tool_call>",
        '\n{"a"',
        "}\n",
        "</tool_call>",
        "<|im_end|>",
        "x",
    ]
    labels = E.token_labels(pieces, thinking=True)
    assert labels == ["think"] * 3 + ["prose"] * 3 + ["call"] * 4 + ["end"] * 2
    res = GenerationResult(list(range(12)), [BlockStats(0, 4, 2), BlockStats(1, 4, 1), BlockStats(2, 4, 4)], 0, 0, 0)
    # block 0: 3 think + 1 prose; block 1: 2 prose + 2 call (tie: call first); block 2: 2 call + 2 end
    assert E.block_steps(res, labels) == {"call": [8, 5], "prose": [0, 0], "think": [4, 2]}


def rec(tid, text, tools=OFFERED, expected=()):
    emitted = E.parse_sections(text, tools)
    blocks = {"call": [16, 4], "prose": [16, 8], "think": [0, 0]}
    return {
        "id": tid,
        "emitted": emitted,
        "outside_call": E.outside_call(text),
        "matched": E.match_calls(list(expected), emitted),
        "blocks": blocks,
    }


def test_outside_call():
    bare = '\n{"name": "read_file", "arguments": {"path": "a.py"}}'
    assert E.outside_call("Let me look." + bare)
    assert E.outside_call(CALL + "\n" + bare)  # after a closed section
    assert not E.outside_call(CALL)  # the JSON inside a section is not outside
    assert not E.outside_call(CALL + "\n<tool_call>\n" + bare)  # inside an open section
    assert not E.outside_call('The dict {"path": "a.py"} has no name.')


def test_figures():
    e_read = {"name": "read_file", "arguments": {"path": "a.py", "start_line": 3}}
    e_grep = {"name": "grep", "arguments": {"pattern": "x", "path": "a.py"}}
    turns = [
        {"id": "a", "expected": [e_read]},  # right call
        {"id": "b", "expected": [e_grep]},  # wrong name, valid for its tool
        {"id": "c", "expected": [e_read]},  # no call
        {"id": "d", "expected": []},  # a call where none is expected
        {"id": "e", "expected": []},  # none, right
    ]
    recs = [
        rec("a", CALL, expected=[e_read]),
        rec("b", CALL, expected=[e_grep]),
        rec("c", "I cannot.", expected=[e_read]),
        rec("d", CALL),
        rec("e", "Done."),
    ]
    ref = {"a": rec("a", CALL, expected=[e_read]), "b": rec("b", CALL.replace("3", "4"), expected=[e_grep])}
    f = E.figures(turns, recs, ref)
    assert f["expected_calls"] == 3 and f["turns_expecting_none"] == 2
    assert f["call_rate"] == pytest.approx(2 / 3)
    assert f["valid_calls"] == pytest.approx(2 / 3)  # a and b validate against read_file, which they name
    assert f["name_accuracy"] == pytest.approx(1 / 3)
    assert f["exact_arguments"] == pytest.approx(1 / 3)
    assert f["calls_where_none_expected"] == 0.5
    assert f["json_validity"] == 1.0 and f["sections"] == 3
    assert f["returned_calls"] == 3 and f["returned_calls_valid"] == 1.0
    assert f["cut_sections"] == 0 and f["turns_with_outside_call"] == 0
    assert f["same_call_as_bf16"] == 0.5 and f["compared_with_bf16"] == 2
    assert f["tokens_per_step_call"] == 4.0 and f["tokens_per_step_prose"] == 2.0 and f["tokens_per_step_think"] is None
    # a cut section is emitted and invalid, but not returned; a bare call is counted apart
    bad_schema = CALL.replace('"start_line": 3', '"start_line": "3"')
    cut = '<tool_call>\n{"name": "grep", "arguments": {"pattern": "x_is_is'
    g = E.figures(
        turns[:2],
        [rec("a", bad_schema + "\n" + cut, expected=[e_read]), rec("b", '{"name": "grep"}', expected=[e_grep])],
    )
    assert g["sections"] == 2 and g["schema_validity"] == 0.0
    assert g["returned_calls"] == 1 and g["returned_calls_valid"] == 0.0
    assert g["cut_sections"] == 1 and g["turns_with_outside_call"] == 1
    s = E.summarize([f, f, {**f, "valid_calls": 0.0}])
    assert s["valid_calls"]["n"] == 3 and s["valid_calls"]["median"] == pytest.approx(2 / 3)
    assert s["valid_calls"]["p10"] < s["valid_calls"]["median"]


def test_bad_options_are_one_line(tmp_path):
    r = CliRunner().invoke(cli, ["eval", "tools", "--reference", str(DEFAULT_MODEL), "--repeats", "2"])
    assert r.exit_code != 0 and "needs --temperature" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(cli, ["eval", "tools", "--reference", str(DEFAULT_MODEL), "--modes", "free,fast"])
    assert r.exit_code != 0 and "'fast' is not one of" in r.output
    (tmp_path / "h.jsonl").write_text('{"id": "x"}\n')
    r = CliRunner().invoke(
        cli, ["eval", "tools", "--reference", str(DEFAULT_MODEL), "--heldout", str(tmp_path / "h.jsonl")]
    )
    assert r.exit_code != 0 and "h.jsonl" in r.output and "Traceback" not in r.output


def one_transcript(tmp_path, row) -> str:
    """A held-out file of one transcript, tools.json beside it, as `--heldout` reads it."""
    held = tmp_path / "held"
    held.mkdir()
    (held / "heldout.jsonl").write_text(json.dumps(row) + "\n")
    shutil.copy(T.HELDOUT_DIR / "tools.json", held / "tools.json")
    return str(held / "heldout.jsonl")


@pytest.fixture(scope="module")
def tiny_q8(converted):
    return converted(DEFAULT_MODEL, "q8_0")


def test_run_on_clover_tiny(tiny_q8, tmp_path):
    """A real run: one held-out transcript, the reference (free) and a GGUF (free, constrained),
    the stability measure; JSON, Markdown and PNG written; every turn has a record."""
    rows, _ = T.load_heldout_set()
    cfg = E.ToolsConfig(heldout=one_transcript(tmp_path, rows[0]), max_new_tokens=24, stability_turns=1, threads=1)
    run = E.run_tools(DEFAULT_MODEL, [str(tiny_q8)], cfg, tmp_path / "out")
    n_turns = len(T.assistant_turns(rows[0]))
    assert [list(t["modes"]) for t in run["targets"]] == [["free"], ["free", "constrained"]]
    for t in run["targets"]:
        for mode, recs in t["records"].items():
            assert len(recs) == 1 and len(recs[0]) == n_turns
            counts = t["modes"][mode]["counts"]
            assert counts["turns"] == n_turns and counts["expected_calls"] >= 1
    stab = run["stability"]["clover-tiny-q8_0.gguf"]["schedules"]
    assert set(stab) == {"steps 4", "steps 8", "threshold 0.9"}
    assert all(s["blocks"] >= 1 and 0 <= s["blocks_revised"] <= s["blocks"] for s in stab.values())
    saved = json.loads((tmp_path / "out" / "tools.json").read_text())
    assert saved["kind"] == "tools" and (tmp_path / "out" / "tools.png").stat().st_size > 1000
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| clover-tiny-q8_0.gguf | constrained |" in md and "Formatting stability" in md
    # `clover-gguf report` renders the saved run again
    r = CliRunner().invoke(cli, ["report", str(tmp_path / "out" / "tools.json"), "-o", str(tmp_path / "again")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "again" / "report.md").read_text() == md


def test_constrained_rows_compare_with_the_first_files_constrained_replies(converted, tmp_path):
    """Constrained rows' "same call" is against the first file's constrained replies (a grammar
    unmasks calls left to right, so free replies differ): the same file given twice agrees on
    every call it writes. The v3 snapshot, since clover-tiny v2 never opens a call."""
    v3 = DEFAULT_MODEL.parent / "clover-tiny-v3-wip"
    gguf = str(converted(v3, "q8_0"))
    rows, _ = T.load_heldout_set()
    cfg = E.ToolsConfig(
        heldout=one_transcript(tmp_path, rows[1]),
        modes=("constrained",),
        max_new_tokens=64,
        stability_turns=0,
        threads=1,
    )
    run = E.run_tools(v3, [gguf, gguf], cfg, tmp_path / "out", names=["first", "again"])
    first, again = (t["modes"]["constrained"] for t in run["targets"][1:])
    assert first["counts"]["compared_with_bf16"] == 0 and "median" not in first["same_call_as_bf16"]
    # every call the first file wrote is compared, and greedy writes the same one again
    assert again["counts"]["compared_with_bf16"] == sum(
        s["json"] for r in run["targets"][1]["records"]["constrained"][0] for s in r["matched"] if s
    )
    assert again["counts"]["compared_with_bf16"] >= 1
    assert again["same_call_as_bf16"]["median"] == 1.0
