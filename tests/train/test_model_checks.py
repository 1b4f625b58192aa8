"""clover-tiny's quality checks (clover_gguf/train/model_checks.py)."""

from __future__ import annotations

import numpy as np
import pytest
from testdata import TINY

from clover_gguf.train import data
from clover_gguf.train import model_checks as Q
from clover_gguf.train import trainer as T
from tests.train.test_train import tiny_config


@pytest.mark.parametrize(
    "completion, finished, body",
    [
        ("    return a + b\n\n\ndef g():\n    pass\n", False, "    return a + b\n\n\n"),
        ("    x = 1\n    return x", True, "    x = 1\n    return x\n"),
        ("    x = 1\n    return x +", False, "    x = 1\n"),  # the token limit cut the last line
        ("class A:\n", False, ""),
        ("", True, ""),
    ],
)
def test_function_body(completion, finished, body):
    assert Q.function_body(completion, finished) == body


@pytest.mark.parametrize(
    "prompt, body, ok",
    [
        ("def f(a, b):\n", "    return a + b\n", True),
        ("def f(a, b):\n", "    return a +\n", False),
        ("def f(a, b):\n", "\n", False),
        ('def f():\n    """doc"""\n', "    # nothing\n", False),  # parses, but adds no statement
        ('def f():\n    """doc"""\n', "    return 1\n", True),
        ("def f():\n", "    if x:\n", False),
        ("def f():\n", "    s = '\x00'\n", False),  # null byte: ValueError on 3.11
    ],
)
def test_body_parses(prompt, body, ok):
    assert Q.body_parses(prompt, body) is ok


def test_function_prompts_file():
    prompts = Q.load_function_prompts()
    assert len(prompts) == 20 and len(set(prompts)) == 20
    assert all(p.startswith("def ") and p.endswith("\n") for p in prompts)


def test_unigram_log2p_is_add_one():
    lp = data.unigram_log2p([0, 0, 1], 4)
    assert np.allclose(2.0**lp, [3 / 7, 2 / 7, 1 / 7, 1 / 7])


def test_wheel_is_read_not_installed():
    src = Q.wheel_sources(Q.THIRDPARTY_WHEEL)
    assert len(src) >= 20 and all(n.startswith("boltons/") and n.endswith(".py") for n, _ in src)
    import importlib.util

    assert importlib.util.find_spec("boltons") is None


class _ByteTok:
    eos_id = 0

    def encode(self, text):
        return [2 + b % 62 for b in text.encode()]


def test_thirdparty_quality_splits_and_scores():
    m = T.new_model(tiny_config(), 0)
    ev = Q.thirdparty_quality(m, _ByteTok(), max_tokens=512)
    assert set(ev["fit_files"]).isdisjoint(ev["scored_files"])
    assert len(ev["fit_files"]) - len(ev["scored_files"]) in (0, 1)
    assert ev["n_tokens"] == 512 and ev["ratio"] == ev["bits_per_token"] / ev["unigram_bits_per_token"]
    assert len(ev["wheel_sha256"]) == 64


def test_function_completions_and_targets():
    m = T.new_model(tiny_config(), 0)

    class Tok(_ByteTok):
        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    res = Q.function_completions(m, Tok(), ["def f():\n"], max_new_tokens=8, block_size=4)
    assert res["n_prompts"] == 1 and len(res["rows"]) == 1 and res["n_parse"] in (0, 1)
    t = Q.targets({"heldout": {"ratio": 0.7}, "thirdparty": {"ratio": 0.85}, "functions": res | {"fraction": 0.5}})
    assert t["heldout_ratio"]["met"] and not t["thirdparty_ratio"]["met"] and t["functions_parse"]["met"]


def test_threshold_speed_and_issue_23_targets():
    m = T.new_model(tiny_config(), 0)
    s = Q.threshold_speed(m, _ByteTok(), ["def f():\n", "x = 1\n"], threshold=0.0, max_new_tokens=8, block_size=4)
    # threshold 0 unmasks every position at the first step: 4 tokens a step, 2 blocks per prompt
    assert s["tokens"] == 16 and s["steps"] == 4 and s["tokens_per_step"] == 4.0
    s = Q.threshold_speed(m, _ByteTok(), ["def f():\n"], threshold=1.0, max_new_tokens=8, block_size=4)
    assert s["tokens_per_step"] == 1.0  # nothing reaches probability 1: one token a step
    t = Q.targets(
        {
            "function_speed": {"tokens_per_step": 1.4},
            "tools": {"valid_calls": 0.85, "name_accuracy": 0.6, "tokens_per_step_call": None},
        }
    )
    assert not t["functions_tokens_per_step"]["met"] and t["tools_valid_calls"]["met"]
    assert not t["tools_right_name"]["met"] and not t["tools_call_tokens_per_step"]["met"]


def test_in_context_copy_counts_against_the_span():
    m = T.new_model(tiny_config(), 0)
    held = np.arange(2, 60) % 50 + 2
    res = Q.in_context_copy(m, _ByteTok(), held, n=3, span=12, repeat=8)
    assert res["tokens"] == 3 * 4 and len(res["rows"]) == 3
    assert all(
        0 <= r["start"] <= len(held) - 12 and 0 <= r["with_copy"] <= 4 and 0 <= r["alone"] <= 4 for r in res["rows"]
    )
    assert res["accuracy_with_copy"] == sum(r["with_copy"] for r in res["rows"]) / 12
    assert res["accuracy_alone"] == sum(r["alone"] for r in res["rows"]) / 12


def test_in_context_copy_scores_a_perfect_copier_one(monkeypatch):
    """A generator that continues a repeated prefix from its first occurrence (induction) scores
    1 with the repeat; without it, it has nothing to copy and scores 0."""
    from types import SimpleNamespace

    from clover_gguf.generation import loader

    def generate(self, ids, cfg):
        k = cfg.max_new_tokens
        for p in range(1, len(ids)):  # the earliest earlier occurrence of the last token
            if ids[p - 1] == ids[-1] and p < len(ids) - 1:
                return SimpleNamespace(tokens=ids[p : p + k])
        return SimpleNamespace(tokens=[1] * k)

    monkeypatch.setattr(loader.TorchGenerator, "generate", generate)
    held = np.arange(100) + 2  # no token repeats inside a span
    res = Q.in_context_copy(T.new_model(tiny_config(), 0), _ByteTok(), held, n=4, span=12, repeat=8)
    assert res["accuracy_with_copy"] == 1.0 and res["accuracy_alone"] == 0.0


def test_tool_call_quality_on_a_fresh_draw(tmp_path):
    """seed: the figures come from a new draw of the held-out set, not the committed one."""
    from clover_gguf.eval.quality.tools import load_turns
    from clover_gguf.train.transcripts import write_heldout_set

    write_heldout_set(tmp_path, n=1, seed=24)
    fresh, _ = load_turns(tmp_path / "heldout.jsonl")
    committed, _ = load_turns(None, limit=1)
    assert [t["transcript"]["messages"] for t in fresh] != [t["transcript"]["messages"] for t in committed]
    q = Q.tool_call_quality(TINY, limit=1, max_new_tokens=8, seed=24)
    assert q["heldout_seed"] == 24 and q["turns"] == len(fresh)
    assert q["expected_calls"] == sum(len(t["expected"]) for t in fresh)
    assert Q.tool_call_quality(TINY, limit=1, max_new_tokens=8)["heldout_seed"] == 23
