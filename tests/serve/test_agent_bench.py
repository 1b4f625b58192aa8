"""`clover-gguf eval agent`: the shipped traces' tool steps do what they say, and a real run
against the test server separates cold from warm and writes JSON + Markdown + PNG."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import API_KEY

from clover_gguf.eval.bench.agent import AGENT_TRACES, load_traces, run_agent_bench, run_tool


@pytest.mark.parametrize("trace", load_traces(), ids=lambda t: t["name"])
def test_shipped_traces_replay_for_real(trace, tmp_path):
    ws = tmp_path / "ws"
    shutil.copytree(trace["workspace"], ws)
    outs = [run_tool(step, ws) for step in trace["steps"]]
    runs = [o for s, o in zip(trace["steps"], outs) if s["tool"] == "run"]
    assert "(exit code 1)" in runs[0] and "Error" in runs[0], "the trace's first test run should fail"
    assert runs[-1].endswith("all tests passed\n(exit code 0)"), runs[-1]
    edits = [o for s, o in zip(trace["steps"], outs) if s["tool"] == "edit"]
    assert edits and all(e.startswith("--- a/") and "\n+" in e for e in edits), "edits report a unified diff"
    assert all(str(tmp_path) not in o for o in outs), "tool output must not depend on where the workspace is"


def test_load_traces_names_the_problem(tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"name": "x", "workspace": "nowhere", "system": "", "task": "", "steps": []}))
    with pytest.raises(ValueError, match="workspace 'nowhere'"):
        load_traces([bad])
    bad.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="missing key 'workspace'"):
        load_traces([bad])


def test_agent_bench_against_the_server(server, tmp_path):
    run = run_agent_bench(
        server.url,
        tmp_path / "out",
        traces=[AGENT_TRACES / "fix-mean.json"],
        repeats=1,
        max_tokens=16,
        clover={"steps": 4},
        api_key=API_KEY,
        log=lambda *a: None,
    )
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"agent.json", "report.md", "timeline.png"}
    saved = json.loads((tmp_path / "out" / "agent.json").read_text())
    assert saved["summary"] == json.loads(json.dumps(run["summary"]))
    cold, warm = run["replays"]
    assert (cold["mode"], warm["mode"]) == ("cold", "warm") and len(cold["turns"]) == 6
    for t in cold["turns"] + warm["turns"]:
        assert t["prefill_tokens"] + t["reused_tokens"] == t["prompt_tokens"]
        assert t["ttfb_ms"] > 0 and t["model_ms"] >= t["ttfb_ms"] and t["events"] == t["blocks"] + 1
    assert all(t["reused_tokens"] == 0 for t in cold["turns"])
    assert all(t["reused_tokens"] > 0 for t in warm["turns"][1:]), "each later warm turn reuses the last"
    assert warm["prefill_tokens"] < cold["prefill_tokens"]
    assert run["summary"]["identical_replies"] == {"replays": 1, "identical": 1}
    assert sum(t["tool_ms"] for t in cold["turns"]) > 0 and 0 < cold["model_share"] < 1
    md = (tmp_path / "out" / "report.md").read_text()
    assert "Replies identical cold vs warm: 1 of 1" in md and "timeline.png" in md
    assert run["config"]["server"]["config"]["ctx_cache"] == 32 and run["config"]["environment"]["cpu"]


def test_throughput_bench(tiny_gguf, tmp_path):
    """`clover-gguf eval throughput`: one server per N, replies equal N = 1's, and at N = 2 the two
    clients' requests share denoising graphs."""
    from click.testing import CliRunner

    from clover_gguf.cli import cli

    out = tmp_path / "thr"
    args = ["eval", "throughput", str(tiny_gguf), "-t", "1", "--parallel", "1,2", "--runs", "2", "--max-tokens", "16"]
    r = CliRunner().invoke(cli, args + ["--requests", "1", "--out", str(out)])
    assert r.exit_code == 0, r.output
    run = json.loads((out / "throughput.json").read_text())
    one, two = run["results"]
    assert (one["parallel"], two["parallel"]) == (1, 2) and two["same_replies_as_first"]
    assert one["denoise_graphs"] == one["sequence_steps"] > 0
    assert two["largest_group"] == 2 and two["denoise_graphs"] < two["sequence_steps"]
    assert all(x["tok_per_s"]["n"] == 2 and x["tok_per_s"]["median"] > 0 for x in (one, two))
    md = (out / "throughput.md").read_text()
    assert "| 2 |" in md and "load average" in md
    bad = CliRunner().invoke(cli, ["eval", "throughput", str(tiny_gguf), "--parallel", "0"])
    assert bad.exit_code != 0 and "each must be an integer in [1, 64]" in bad.output
