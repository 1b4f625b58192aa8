"""clover-tiny's model card (clover_gguf/train/card.py), written from the committed train_log."""

from __future__ import annotations

import json

from testdata import TINY

from clover_gguf.train.card import write_model_card


def test_card_from_the_committed_train_log(tmp_path):
    log = json.loads((TINY / "train_log.json").read_text())
    text = write_model_card(tmp_path, log).read_text()
    assert text.startswith("# clover-tiny\n")
    assert f"| vocab_size | {log['model_config']['vocab_size']} |" in text
    assert f"Trained {log['step']:,} steps, {log['tokens']:,} tokens" in text
    fn = log["final"]["functions"]
    assert f"| {fn['n_parse']} / {fn['n_prompts']} |" in text  # the quality table
    assert "`clover_gguf/train/model_checks.py`" in text


def test_card_without_final_figures(tmp_path):
    log = json.loads((TINY / "train_log.json").read_text())
    log.pop("final")
    text = write_model_card(tmp_path, log).read_text()
    assert "(not measured: run with --eval-only)" in text
