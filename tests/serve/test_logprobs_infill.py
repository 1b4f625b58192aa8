"""`logprobs` / `top_logprobs` (the probability of each token at the step that unmasked it) and
`/infill` (the suffix fixed inside the denoised block), against the runtime run in-process."""

from __future__ import annotations

import json
import math

import openai
import pytest
from test_server import raw

from clover_gguf.reference.generate import GenerationConfig

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def _expect(rt, ids, n, **kw):
    """Tokens and per-token (probability, top) of a fresh run, up to the first end token."""
    rt.reset()
    res = rt.generate(ids, GenerationConfig(max_new_tokens=n, block_size=rt.default_block_size, **kw), reset=False)
    probs = [p for b in res.blocks for p in b.probs]
    top = [t for b in res.blocks for t in b.top]
    cut = next((i for i, t in enumerate(res.tokens) if t in rt.eog), len(res.tokens))
    return res.tokens[:cut], probs[:cut], top[:cut]


def test_chat_logprobs_are_the_runtime_probabilities(client, model_id, rt):
    msgs = [{"role": "user", "content": "Write a loop"}]
    r = client.chat.completions.create(
        model=model_id, messages=msgs, logprobs=True, top_logprobs=3, max_tokens=24, extra_body=NO_THINK
    )
    content = r.choices[0].logprobs.content
    ids = rt.tokenize(rt.chat_prompt(msgs, enable_thinking=False))
    toks, probs, top = _expect(rt, ids, 24, n_probs=3)
    assert "".join(e.token for e in content) == r.choices[0].message.content
    assert len(content) == len(toks) == r.usage.completion_tokens
    for e, t, p, alts in zip(content, toks, probs, top):
        assert e.token == rt.detokenize([t]) and e.logprob == pytest.approx(math.log(p), abs=1e-6)
        assert [a.token for a in e.top_logprobs] == [rt.detokenize([a]) for a, _ in alts]
        assert all(x.logprob >= y.logprob for x, y in zip(e.top_logprobs, e.top_logprobs[1:]))
        assert e.top_logprobs[0].token == e.token  # greedy: the chosen token is the most probable


def test_completion_logprobs_streamed_and_not(client, model_id):
    kw = dict(model=model_id, prompt="def fibonacci(n):", logprobs=2, max_tokens=40)
    r = client.completions.create(**kw)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(d) <= 2 for d in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)
    streamed = []
    for ch in client.completions.create(stream=True, **kw):
        if ch.choices and ch.choices[0].logprobs:
            streamed += ch.choices[0].logprobs.tokens
    assert streamed[: len(lp.tokens)] == lp.tokens


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": 3}, "logprobs"),
    ],
)
def test_bad_logprobs_fields(client, model_id, extra, param):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "x"}], max_tokens=2, extra_body=extra
        )
    assert ei.value.body["param"] == param


def test_infill_generates_the_middle_before_a_fixed_suffix(server, rt):
    prefix, suffix, n = "def add(a, b):\n    return ", "\n\n\ndef sub(a, b):\n    return a - b\n", 6
    status, r = raw(
        server, "POST", "/infill", json.dumps({"input_prefix": prefix, "input_suffix": suffix, "n_predict": n}).encode()
    )
    assert status == 200, r
    s = rt.tokenize(suffix)
    rt.reset()
    res = rt.generate(
        rt.tokenize(prefix),
        GenerationConfig(max_new_tokens=n + len(s), block_size=16, first_block=[rt.mask_token_id] * n + s),
        reset=False,
    )
    mid = res.tokens[:n]
    cut = next((i for i, t in enumerate(mid) if t in rt.eog), n)
    assert r["content"] == rt.detokenize(mid[:cut]) and r["tokens_predicted"] == cut <= n
    assert res.tokens[n : n + len(s)] == s or cut < n  # the suffix stayed where it was put


def test_infill_errors(server):
    long_suffix = "x = 1\n" * 200
    status, r = raw(server, "POST", "/infill", json.dumps({"input_prefix": "a", "input_suffix": long_suffix}).encode())
    assert status == 400 and r["error"]["param"] == "input_suffix", r
    status, r = raw(server, "POST", "/infill", json.dumps({"input_prefix": 3}).encode())
    assert status == 400 and r["error"]["param"] == "input_prefix", r
    status, r = raw(server, "POST", "/infill", json.dumps({"input_prefix": "a", "stream": True}).encode())
    assert status == 400 and r["error"]["param"] == "stream", r


def test_infill_fields(server):
    base = {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n", "n_predict": 8}
    status, full = raw(server, "POST", "/infill", json.dumps(base).encode())
    assert status == 200, full
    text = full["content"]
    assert len(text) > 1, full
    # a stop string cuts the middle before it
    status, r = raw(server, "POST", "/infill", json.dumps(base | {"stop": [text[1:]]}).encode())
    assert status == 200 and r["content"] == text[:1] and r["stop_type"] == "word", r
    status, r = raw(server, "POST", "/infill", json.dumps(base | {"cache_prompt": False}).encode())
    assert status == 200 and r["content"] == text
    for name, value, code in (("n_indent", 4, "unsupported_parameter"),
                              ("input_extra", [{"text": "x"}], "unsupported_parameter")):  # fmt: skip
        status, r = raw(server, "POST", "/infill", json.dumps(base | {name: value}).encode())
        assert status == 400 and r["error"]["param"] == name and r["error"]["code"] == code, r
