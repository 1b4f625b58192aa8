"""The end of a run (train/final_eval.py, export.py): the final evaluation of a saved model
folder on small limits, and train_log.json's compaction and reading."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from testdata import TINY

from clover_gguf.config import preset
from clover_gguf.tokenizer import CloverTokenizer
from clover_gguf.train import TrainError
from clover_gguf.train import trainer as T
from clover_gguf.train.export import compact_log, read_train_log, write_train_log
from clover_gguf.train.final_eval import final_eval


def test_final_eval_of_a_saved_model(tmp_path):
    c = preset("clover-tiny", num_hidden_layers=1, num_experts=2, num_experts_per_tok=1)
    T.save_hf(T.new_model(c, 0), tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, tmp_path / name)
    tok = CloverTokenizer.from_dir(tmp_path)
    rng = np.random.default_rng(0)
    train_ids, held_ids = rng.integers(2, c.vocab_size, 4000), rng.integers(2, c.vocab_size, 2000)
    lines = []
    res = final_eval(tmp_path, tok, train_ids, held_ids, {"x": 1}, max_tokens=256, tools_limit=1, log=lines.append)
    assert res["heldout"]["n_tokens"] <= 256 and res["thirdparty"]["n_tokens"] <= 256
    assert res["functions"]["n_prompts"] == len(res["functions"]["rows"]) == 20
    assert res["tools"]["turns"] >= 1 and res["data"] == {"x": 1}
    assert set(res["targets"]) >= {"heldout_ratio", "thirdparty_ratio", "functions_parse", "tools_valid_calls"}
    assert res["unigram"]["vocab_size"] == c.vocab_size
    i = next(i for i, ln in enumerate(lines) if ln.startswith("heldout: "))  # after the tools eval's own lines
    assert lines[i + 1].startswith("thirdparty: ") and lines[i + 4].startswith("tools: {'valid_calls': ")
    assert f"functions: {res['functions']['n_parse']}/20 bodies parse" in lines
    assert sum(ln.startswith(("ok ", "BAD ")) for ln in lines) == 20


def test_compact_log_keeps_the_last_step_and_every_speed_figure(tmp_path):
    steps = [{"step": i + 1, "loss": 1.0} for i in range(1000)]
    for i in (9, 503, 998):
        steps[i]["tok_per_s"] = 10.0
    log = {"steps": steps, "step": 1000}
    small = compact_log(log, max_points=100)
    kept = [r["step"] for r in small["steps"]]
    assert small["steps_subsampled_every"] == 10 and kept[:2] == [1, 10] and 504 in kept and 999 in kept
    assert kept[-1] == 1000 and len(kept) == 100 + 3 + 1  # every 10th, the speed rows, the last
    assert log["steps"] is steps and len(steps) == 1000  # the log itself is left as it was
    write_train_log(tmp_path, log)
    assert read_train_log(tmp_path) == json.loads(json.dumps(compact_log(log)))


def test_a_broken_train_log_is_one_line(tmp_path):
    (tmp_path / "train_log.json").write_text('{"steps": [')
    with pytest.raises(TrainError, match=r"train_log\.json: not JSON"):
        read_train_log(tmp_path)
