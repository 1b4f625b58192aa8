"""Self-distillation targets (clover_gguf/train/distill.py) and their batches in the trainer."""

import json
import re

import pytest

from clover_gguf.train import TrainError
from clover_gguf.train.distill import distill_stream, train_signatures
from clover_gguf.train.model_checks import load_function_prompts


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_stream_keeps_prompts_clean_and_scores_the_continuations(tmp_path):
    rows = [
        {"prompt": "a", "prompt_ids": [5, 6], "ids": [7, 8, 9], "parses": True},
        {"prompt": "b", "prompt_ids": [10], "ids": [11, 12], "parses": False},
        {"prompt": "c", "prompt_ids": [13, 14, 15], "ids": [16], "parses": True},
    ]
    ids, starts, scored = distill_stream(write_rows(tmp_path / "t.jsonl", rows))
    assert ids.tolist() == [5, 6, 7, 8, 9, 13, 14, 15, 16]  # the row that does not parse is left out
    assert starts.tolist() == [0, 5]
    assert scored.tolist() == [False, False, True, True, True, False, False, False, True]
    ids, starts, _ = distill_stream(tmp_path / "t.jsonl", only_parsing=False)
    assert starts.tolist() == [0, 5, 8] and ids.numel() == 12


@pytest.mark.parametrize(
    "text", ["", '{"prompt": "a", "prompt_ids": [1], "ids": [2], "parses": false}\n', "{not json\n"]
)
def test_nothing_to_train_on_is_one_error_naming_the_file(tmp_path, text):
    p = tmp_path / "t.jsonl"
    p.write_text(text)
    with pytest.raises(TrainError, match=f"--distill {p}: "):
        distill_stream(p)


def test_signatures_come_from_the_train_split_and_leave_the_held_out_prompts_out():
    sigs = train_signatures()
    assert len(sigs) > 1000 and len(set(sigs)) == len(sigs)
    assert all(s.startswith("def ") and s.endswith(":\n") and s.count("\n") == 1 for s in sigs)
    assert not set(sigs) & set(load_function_prompts())


def _pieces(text):
    """A reply cut into token-like pieces (the special tokens whole, the rest in 3-character bits)."""
    out = []
    for part in re.split(r"(</?tool_call>|<\|im_end\|>|</?think>)", text):
        special = part.startswith("<") and part.endswith(">")
        out += [part] if special else [part[i : i + 3] for i in range(0, len(part), 3)]
    return out


READ = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'
GREP = '<tool_call>\n{"name": "grep", "arguments": {"pattern": "x", "path": "a.py"}}\n</tool_call>'
EXPECT_ONE = [{"name": "read_file", "arguments": {"path": "b.py"}}]


@pytest.mark.parametrize(
    "reply, expected, target",
    [
        (READ + "<|im_end|>", EXPECT_ONE, READ),  # right as it is
        (READ + "\n" + GREP + "\n" + READ, EXPECT_ONE, READ),  # goes on calling: cut after the first call
        ("<think>\nread it\n</think>\n\n" + READ + "<|im_end|>", EXPECT_ONE, "<think>\nread it\n</think>\n\n" + READ),
        (READ + "\n" + GREP + "<|im_end|>", EXPECT_ONE * 2, READ + "\n" + GREP),  # two calls, the second another tool
        (READ.replace('"path"', '"file"') + "<|im_end|>", EXPECT_ONE, None),  # misses a required argument
        (READ.replace("}}", "}") + "<|im_end|>", EXPECT_ONE, None),  # not JSON
        (READ.replace("read_file", "write_file") + "<|im_end|>", EXPECT_ONE, None),  # no such tool
        (READ + "<|im_end|>", EXPECT_ONE * 2, None),  # one call short
        ("It is in a.py.<|im_end|>", EXPECT_ONE, None),  # no call where the transcript makes one
        ("It is in a.py.<|im_end|>", [], None),  # prose turns are not targets
        (READ[:-3], EXPECT_ONE, None),  # cut off inside the closing tag
    ],
)
def test_a_reply_is_a_target_up_to_its_expected_calls_when_they_are_all_valid(reply, expected, target):
    from clover_gguf.train.distill import right_reply
    from clover_gguf.train.toolset import tool_schemas

    pieces = _pieces(reply)
    thinking = reply.startswith("<think>")
    cut = right_reply(pieces, thinking, tool_schemas(["read_file", "grep"]), expected)
    assert (None if cut is None else "".join(pieces[:cut])) == target
