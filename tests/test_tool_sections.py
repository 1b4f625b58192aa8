"""Where a `<tool_call>` section ends, for every parser of replies (the server's, streamed and
not, and eval tools'): at the first `</tool_call>` outside a JSON string. The tag is one token
that a constrained or free decode may also write inside an argument; the call must stay whole."""

from __future__ import annotations

import json

import pytest

from clover_gguf.eval.quality import tools as eval_tools
from clover_gguf.eval.quality.tool_blocks import token_labels
from clover_gguf.serve.tools import CallStreamer, split_calls
from clover_gguf.tokenizer import END_TOOL_CALL, TOOL_CALL, tool_call_sections

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "grep",
            "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}}, "required": ["pattern"]},
        },
    }
]


def section(args: dict) -> str:
    return f"{TOOL_CALL}\n" + json.dumps({"name": "grep", "arguments": args}) + f"\n{END_TOOL_CALL}"


# an argument holding the end tag, an escaped quote before it, and a second call after it
TRICKY = {"pattern": 'a\\" </tool_call> b'}
REPLY = "Looking.\n" + section(TRICKY) + "\n" + section({"pattern": "def main"})


def test_sections_end_outside_strings():
    s = tool_call_sections(REPLY)
    assert len(s) == 2 and all(j is not None for _, _, j in s)
    assert [json.loads(REPLY[b:j])["arguments"] for _, b, j in s] == [TRICKY, {"pattern": "def main"}]
    assert tool_call_sections(REPLY + TOOL_CALL + '{"name": "gr')[-1][2] is None  # left open


def test_reply_keeps_the_call_whole():
    r = split_calls(REPLY)
    assert r.content == "Looking."
    assert [json.loads(c["function"]["arguments"]) for c in r.tool_calls] == [TRICKY, {"pattern": "def main"}]


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_stream_equals_the_reply(chunk):
    cs, content, calls = CallStreamer(), [], []
    pieces = [REPLY[i : i + chunk] for i in range(0, len(REPLY), chunk)]
    for k, p in enumerate(pieces):
        text, got = cs.feed(p, last=k == len(pieces) - 1)
        content.append(text)
        calls += got
    whole = split_calls(REPLY)
    assert "".join(content) == whole.content
    assert [c["function"]["arguments"] for c in calls] == [c["function"]["arguments"] for c in whole.tool_calls]
    assert [c["index"] for c in calls] == [0, 1]


def test_eval_counts_one_valid_call_per_section():
    s = eval_tools.parse_sections(REPLY, TOOLS)
    assert [(x["closed"], x["json"], x["schema"], x["arguments"]) for x in s] == [
        (True, True, True, TRICKY),
        (True, True, True, {"pattern": "def main"}),
    ]


def test_block_labels_cover_the_whole_call():
    pieces = list(REPLY)
    labels = token_labels(pieces, thinking=False)
    start = REPLY.index(TOOL_CALL)
    end = REPLY.index(END_TOOL_CALL, REPLY.index("def main")) + len(END_TOOL_CALL)
    # the end tag inside the first call's argument is still part of a call block
    inner = REPLY.index("</tool_call> b")
    assert labels[inner] == "call" and labels[inner + len(END_TOOL_CALL)] == "call"
    assert set(labels[start:end]) - {"call"} <= {"prose"}  # the newline between the two sections
    assert labels[:start] == ["prose"] * start
