"""The chat transcript generator of clover-tiny v3 (train/transcripts.py, intents.py, toolset.py):
determinism, every call valid against its tool's schema, split separation (modules and tool
combinations), and the chat template round trip (training text, prompts, the server's parser)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clover_gguf.serve.tools import chat_message
from clover_gguf.tokenizer import CloverTokenizer
from clover_gguf.train import data, toolset
from clover_gguf.train import transcripts as T
from clover_gguf.util import DEFAULT_MODEL

N_TRAIN, N_HELD = 300, 120


@pytest.fixture(scope="module")
def tok():
    return CloverTokenizer.from_dir(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def train_set():
    return [T.make_transcript("train", 0, i) for i in range(N_TRAIN)]


@pytest.fixture(scope="module")
def held_set():
    return [T.make_transcript("heldout", 0, i) for i in range(N_HELD)]


@pytest.fixture(scope="module")
def heldout_modules():
    return set(data.load_heldout_manifest()["modules"])


def calls_of(t):
    return [c["function"] for m in t["messages"] for c in m.get("tool_calls") or []]


def test_deterministic_from_the_seed(train_set):
    again = [T.make_transcript("train", 0, i) for i in range(20)]
    assert again == train_set[:20]
    other = [T.make_transcript("train", 1, i) for i in range(20)]
    assert sum(a != b for a, b in zip(other, train_set[:20])) >= 18


def test_every_call_validates_against_its_offered_tool(train_set, held_set):
    n = 0
    for t in train_set + held_set:
        offered = toolset.tool_schemas(t["tools"])
        assert len(set(t["tools"])) == len(t["tools"]) <= toolset.MAX_OFFERED
        for fn in calls_of(t):
            assert fn["name"] in t["tools"]
            assert toolset.schema_errors(fn["name"], fn["arguments"], offered) == [], (t["id"], fn)
            n += 1
    assert n > N_TRAIN + N_HELD  # more than one call a transcript on average


def test_schema_errors_catch_wrong_calls():
    assert toolset.schema_errors("read_file", {"path": "a.py", "start_line": 3}) == []
    assert toolset.schema_errors("read_file", {"path": "a.py", "start_line": "3"})  # a string for an integer
    assert toolset.schema_errors("read_file", {"start_line": 3})  # required path missing
    assert toolset.schema_errors("find_symbol", {"name": "x", "kind": "module"})  # not in the enum
    assert toolset.schema_errors("read_file", {"path": "a.py", "lines": 3})  # no such argument
    edit = {"line": 1, "old": "a", "new": "b"}
    assert toolset.schema_errors("apply_patch", {"path": "a.py", "edits": [edit]}) == []
    assert toolset.schema_errors("apply_patch", {"path": "a.py", "edits": [{"line": 1, "old": "a"}]})
    assert toolset.schema_errors("nope", {}) == ["no tool named 'nope'"]
    assert toolset.schema_errors("grep", {"pattern": "x", "path": "a"}, offered=[toolset.TOOLS["read_file"]])


def test_variety(train_set):
    """Tool counts 1-8, 1-6 assistant turns, parallel calls, thinking modes, every tool and
    every argument type."""
    sizes = {len(t["tools"]) for t in train_set}
    assert set(range(1, 9)) <= sizes
    turns = {len(T.assistant_turns(t)) for t in train_set}
    assert set(range(1, 7)) <= turns
    assert any(len(m.get("tool_calls") or []) >= 2 for t in train_set for m in t["messages"])
    assert {t["mode"] for t in train_set} == set(T.MODES)
    names = {fn["name"] for t in train_set for fn in calls_of(t)}
    assert names == set(toolset.TOOL_NAMES)
    values = [v for t in train_set for fn in calls_of(t) for v in fn["arguments"].values()]
    for typ in (str, int, bool, list, dict):
        assert any(type(v) is typ for v in values), typ
    no_call = [m for t in train_set for m in t["messages"] if m["role"] == "assistant" and not m.get("tool_calls")]
    assert len(no_call) > N_TRAIN  # every exchange ends in an answer; some answer without calls


def test_calls_name_real_corpus_things(train_set):
    """Paths and line ranges in the calls are real files and lines of the corpus."""
    root = data.stdlib_root()
    for t in train_set[:100]:
        for fn in calls_of(t):
            a = fn["arguments"]
            if fn["name"] == "read_file":
                lines = (root / a["path"]).read_text(encoding="utf-8").splitlines()
                assert 1 <= a.get("start_line", 1) <= a.get("end_line", len(lines)) <= len(lines)
            if fn["name"] == "apply_patch":
                lines = (root / a["path"]).read_text(encoding="utf-8").splitlines()
                for e in a["edits"]:
                    assert e["old"] in lines[e["line"] - 1]


def test_split_separation(train_set, held_set, heldout_modules):
    """Training transcripts talk about train modules and never offer a reserved tool set;
    held-out ones talk about held-out modules with reserved sets (2+ tools) only."""
    for t in train_set:
        assert t["module"].split(".")[0] not in heldout_modules
        assert not toolset.heldout_combination(t["tools"])
        for fn in calls_of(t):
            p = fn["arguments"].get("path")
            if p is not None:
                assert data.unit_of(p) not in heldout_modules, (t["id"], p)
    for t in held_set:
        assert t["module"].split(".")[0] in heldout_modules
        assert len(t["tools"]) >= 2 and toolset.heldout_combination(t["tools"])
        for fn in calls_of(t):
            p = fn["arguments"].get("path")
            if p is not None:
                assert data.unit_of(p) in heldout_modules, (t["id"], p)
    train_sets = {frozenset(t["tools"]) for t in train_set}
    assert not train_sets & {frozenset(t["tools"]) for t in held_set}


def test_heldout_combination_rule():
    assert not toolset.heldout_combination(["grep"])  # single tools are never reserved
    pairs = [(a, b) for i, a in enumerate(toolset.TOOL_NAMES) for b in toolset.TOOL_NAMES[i + 1 :]]
    reserved = [p for p in pairs if toolset.heldout_combination(p)]
    assert 0.03 < len(reserved) / len(pairs) < 0.3
    assert all(toolset.heldout_combination(reversed(p)) for p in reserved)  # order does not matter


def test_template_round_trip(tok, train_set):
    """The training text is the template's rendering and tokenizes and decodes back to itself;
    each assistant turn, rendered after its history, is its prompt (as the server renders the
    request) followed by a completion from which the server's parser reads the expected calls
    (and, thinking, the reasoning the template shows)."""
    end = "<|im_end|>"
    for t in train_set[:80]:
        text = T.render_training_text(tok, t)
        assert tok.decode(tok.encode(text)) == text
        tools, msgs = T.request_tools(t), t["messages"]
        last = T.assistant_turns(t)[-1]
        assert text.startswith(T.render_prompt(tok, t, last))
        if t["mode"] != "nothink":
            assert text == tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=False)
        for k in T.assistant_turns(t):
            if t["mode"] == "nothink" and k != last:
                continue  # the training text shows the empty think block at the last turn only
            upto = (
                text if k == last else tok.apply_chat_template(msgs[: k + 1], tools=tools, add_generation_prompt=False)
            )
            prompt = T.render_prompt(tok, t, k)
            assert upto.startswith(prompt), (t["id"], k)
            completion = upto[len(prompt) :].split(end)[0]
            msg = chat_message(completion, thinking=t["mode"] != "nothink", parse_calls=True)
            got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])]
            want = [(c["name"], c["arguments"]) for c in T.expected_calls(msgs[k])]
            assert got == want, (t["id"], k)
            if t["mode"] == "think":  # every turn thinks, seen from its own request
                # (the server keeps the newline before </think>: serve/text.py only strips leading ones)
                assert msg["reasoning_content"].rstrip("\n") == msgs[k]["reasoning_content"]
            else:
                assert msg.get("reasoning_content") in (None, "")


def test_nothink_prompt_has_the_empty_think_block(tok, train_set):
    t = next(t for t in train_set if t["mode"] == "nothink")
    k = T.assistant_turns(t)[-1]
    assert T.render_prompt(tok, t, k).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert T.render_training_text(tok, t).count("<think>") == 1


def test_transcript_tokens_stream(tok, tmp_path):
    ids, starts, assistant = T.transcript_tokens(tok, "train", 0, 12, tmp_path)
    assert starts[0] == 0 and len(starts) == 12 and ids[-1] == tok.eos_id and assistant.shape == ids.shape
    assert all(ids[s - 1] == tok.eos_id for s in starts[1:])
    first = T.make_transcript("train", 0, 0)
    text = T.render_training_text(tok, first)
    assert tok.decode(ids[: starts[1] - 1]) == text
    # the assistant mask covers exactly what the assistant writes, each turn through <|im_end|>
    spans = T.assistant_spans(text)
    assert len(spans) == len(T.assistant_turns(first))
    written = "".join(text[a:e] for a, e in spans)
    assert tok.decode(ids[: starts[1]][assistant[: starts[1]]]) == written
    assert all(text[a:e].endswith("<|im_end|>") for a, e in spans)
    assert not assistant[starts].any() and 0.05 < assistant.mean() < 0.6
    again = T.transcript_tokens(tok, "train", 0, 12, tmp_path)  # from the cache
    assert np.array_equal(again[0], ids) and np.array_equal(again[2], assistant)
    assert len(list(tmp_path.glob("chat-train-*.npz"))) == 1


def test_assistant_spans_leave_the_nothink_block_to_the_prompt(tok, train_set):
    t = next(t for t in train_set if t["mode"] == "nothink" and t["messages"][-1].get("content"))
    text = T.render_training_text(tok, t)
    a, e = T.assistant_spans(text)[-1]
    assert text[:a].endswith("<think>\n\n</think>\n\n") and text[a:e] == t["messages"][-1]["content"] + "<|im_end|>"


def test_committed_heldout_set(heldout_modules, tmp_path):
    """evaldata/tools/heldout.jsonl: held-out modules, reserved tool sets, every expected call
    valid against tools.json; on the stdlib it was made from, exactly what the generator writes."""
    rows, schemas = T.load_heldout_set()
    assert len(rows) >= 100
    n_turns = 0
    for t in rows:
        assert t["module"].split(".")[0] in heldout_modules and toolset.heldout_combination(t["tools"])
        offered = [schemas[n] for n in t["tools"]]
        for k in T.assistant_turns(t):
            n_turns += 1
            for c in T.expected_calls(t["messages"][k]):
                assert toolset.schema_errors(c["name"], c["arguments"], offered) == []
    assert n_turns >= 300
    manifest = data.load_heldout_manifest()
    if manifest["python_version"] == data.python_version():
        T.write_heldout_set(tmp_path, n=len(rows))
        assert (tmp_path / "heldout.jsonl").read_text() == (T.HELDOUT_DIR / "heldout.jsonl").read_text()
        assert (tmp_path / "tools.json").read_text() == (T.HELDOUT_DIR / "tools.json").read_text()
