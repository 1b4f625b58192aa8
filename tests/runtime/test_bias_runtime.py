"""OpenAI's logit_bias, presence_penalty and frequency_penalty (GenerationConfig; clover.h's
clover_batch_set_bias with llama.cpp's logit_bias and penalties samplers): the runtime gives the
PyTorch reference's tokens, token for token and step for step, on clover-tiny (F32 GGUF); off, every
path is today's."""

from __future__ import annotations

import pytest
import torch
from testdata import TINY

from clover_gguf.reference.generate import GenerationConfig, TorchBackend, generate

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


@pytest.fixture(scope="module")
def tiny(converted):
    from clover_gguf.reference.model import CloverModel
    from clover_gguf.runtime.runtime import CloverRuntime

    rt = CloverRuntime(converted(TINY, "f32"), n_threads=1)
    ref = CloverModel.from_pretrained(TINY, dtype=torch.float32).eval()
    yield rt, ref, rt.tokenize(PROMPT)
    rt.close()


def _cfg(rt, **kw) -> GenerationConfig:
    return GenerationConfig(
        **{"max_new_tokens": 32, "block_size": 16, "mask_token_id": rt.mask_token_id, "eos_token_id": rt.eos_token_id}
        | kw
    )


def _both(tiny, **kw):
    """The runtime's result, asserted equal to the reference's (tokens and steps); and whether
    every denoising step ran on the device."""
    rt, ref, prompt = tiny
    cfg = _cfg(rt, **kw)
    want = generate(TorchBackend(ref, "blockwise"), prompt, cfg)
    got = rt.generate(prompt, cfg)
    assert got.tokens == want.tokens, kw
    assert [b.tokens_per_step for b in got.blocks] == [b.tokens_per_step for b in want.blocks], kw
    perf = rt.last_perf
    return got, perf["n_steps_device"] == perf["n_steps"]


SCHEDULES = [dict(steps=8), dict(threshold=0.5), dict()]  # dict(): threshold 0.9
SAMPLING = [dict(), dict(temperature=0.8, seed=3)]


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "temp"])
@pytest.mark.parametrize(
    "off", [dict(presence_penalty=0.0, frequency_penalty=0.0), dict(logit_bias={}), dict(logit_bias={5: 0.0})]
)
def test_off_is_todays_path(tiny, sampling, off):
    """0 / empty: the same tokens, probabilities and steps as without the fields, on the device."""
    rt, _, prompt = tiny
    for sched in SCHEDULES:
        today = rt.generate(prompt, _cfg(rt, **sched, **sampling))
        got = rt.generate(prompt, _cfg(rt, **sched, **sampling, **off))
        assert rt.last_perf["n_steps_device"] == rt.last_perf["n_steps"] > 0
        assert got.tokens == today.tokens
        assert [(b.tokens_per_step, b.probs) for b in got.blocks] == [
            (b.tokens_per_step, b.probs) for b in today.blocks
        ]


@pytest.mark.parametrize("sched", SCHEDULES, ids=["steps8", "thr0.5", "thr0.9"])
def test_logit_bias_bans_the_greedy_choice(tiny, sched):
    """-100 on the greedy reply's first three distinct tokens: they never appear, the reply
    changes, and runtime == reference (on the host)."""
    today, _ = _both(tiny, **sched)
    banned = list(dict.fromkeys(today.tokens))[:3]
    got, on_device = _both(tiny, **sched, logit_bias={t: -100.0 for t in banned})
    assert not on_device
    assert got.tokens and not set(banned) & set(got.tokens)
    assert got.tokens != today.tokens


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "temp"])
def test_plus_100_fills_every_position(tiny, sampling):
    """+100 on one token: every position is that token, each block in one step (confidence ~1 >=
    the 0.9 threshold)."""
    rt, _, _ = tiny
    t = rt.tokenize(" the")[0]
    got, _ = _both(tiny, **sampling, logit_bias={t: 100.0})
    assert got.tokens == [t] * 32
    assert [b.tokens_per_step for b in got.blocks] == [[16], [16]]


@pytest.mark.parametrize("penalty", ["frequency_penalty", "presence_penalty"])
@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "temp"])
@pytest.mark.parametrize("sched", SCHEDULES, ids=["steps8", "thr0.5", "thr0.9"])
def test_penalties_match_the_reference_and_change_the_reply(tiny, penalty, sampling, sched):
    today, _ = _both(tiny, **sched, **sampling)
    got, on_device = _both(tiny, **sched, **sampling, **{penalty: 1.5})
    assert not on_device
    assert got.tokens != today.tokens


def test_a_negative_penalty_and_a_bias_together(tiny):
    """Both samplers in one chain (logit_bias first), negative penalties favour repeats."""
    rt, _, _ = tiny
    t = rt.tokenize(" the")[0]
    _both(tiny, steps=8, frequency_penalty=-0.5, presence_penalty=-1.0, logit_bias={t: 2.5, 0: -100.0})
    _both(tiny, temperature=1.0, top_k=20, top_p=0.9, seed=7, frequency_penalty=0.5, presence_penalty=2.0)


def test_tokens_of_one_step_do_not_penalise_each_other(tiny):
    """steps=1 unmasks a whole block in one step: the first block has nothing before it to count
    (the prompt does not count), so it is the unpenalised block; the second block counts the first."""
    today, _ = _both(tiny, steps=1)
    got, _ = _both(tiny, steps=1, presence_penalty=2.0, frequency_penalty=2.0)
    assert got.tokens[:16] == today.tokens[:16]
    assert got.tokens[16:] != today.tokens[16:]


def test_batch_with_and_without_bias_equals_alone(tiny):
    """Biased (host) and plain (device) sequences decoded together give what each gives alone."""
    from clover_gguf.runtime.runtime import CloverRuntime

    rt, _, prompt = tiny
    cfgs = [
        _cfg(rt, steps=8, frequency_penalty=1.5),
        _cfg(rt, steps=8),
        _cfg(rt, temperature=0.8, seed=3, presence_penalty=1.5, logit_bias={0: -100.0}),
    ]
    with CloverRuntime(rt.path, n_threads=1, n_seq_max=3) as r3:
        together = [r.tokens for r in r3.generate_batch([prompt] * 3, cfgs)]
    assert together == [rt.generate(prompt, c).tokens for c in cfgs]


def test_validate_refuses_out_of_range(tiny):
    rt, _, prompt = tiny
    with pytest.raises(ValueError, match=r"logit_bias: token id 4100: must be an integer in \[0, 4099\]"):
        rt.generate(prompt, _cfg(rt, logit_bias={rt.n_vocab: 1.0}))
    with pytest.raises(ValueError, match="presence_penalty"):
        rt.generate(prompt, _cfg(rt, presence_penalty=2.5))


def test_a_lazy_grammar_with_penalties(tiny):
    """Before its trigger a lazy grammar writes what free decoding writes, with the same penalties;
    after a trigger given in the first block the call is complete and valid (the bias comes before
    the grammar's filter, which keeps the output in the grammar)."""
    import json

    from clover_gguf.runtime.grammar import tool_call_grammar

    rt, _, _ = tiny
    ids = rt.tokenize(rt.chat_prompt([{"role": "user", "content": "Give me a JSON record"}], enable_thinking=False))
    tool = {
        "type": "function",
        "function": {
            "name": "read_file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }
    g, trig = tool_call_grammar([tool], parallel=False), [rt.token_id("<tool_call>")]
    pen = dict(max_new_tokens=48, frequency_penalty=1.5, presence_penalty=0.5)
    free = rt.generate(ids, _cfg(rt, **pen))
    lazy = rt.generate(ids, _cfg(rt, **pen, grammar=g, grammar_triggers=trig))
    assert trig[0] not in free.tokens
    end = next((i for i, t in enumerate(free.tokens) if t in rt.eog), len(free.tokens))
    assert lazy.tokens[:end] == free.tokens[:end]
    assert free.tokens != rt.generate(ids, _cfg(rt, max_new_tokens=48)).tokens

    m = rt.mask_token_id
    res = rt.generate(
        ids,
        _cfg(
            rt,
            **(pen | dict(max_new_tokens=96)),
            grammar=g,
            grammar_triggers=trig,
            first_block=[m] * 5 + trig + [m] * 10,
        ),
    )
    after = rt.detokenize([t for t in res.tokens[6:] if t not in rt.eog])
    assert after.startswith("\n") and after.endswith("}\n</tool_call>")
    call = json.loads(after[1 : -len("\n</tool_call>")])
    assert call["name"] == "read_file" and isinstance(call["arguments"]["path"], str)
