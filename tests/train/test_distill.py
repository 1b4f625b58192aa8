"""Self-distillation targets (clover_gguf/train/distill.py) and their batches in the trainer."""

import json

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
