"""`clover-gguf serve` on 127.0.0.1 with clover-tiny, through the real openai client (and raw
HTTP where a client would not send such a request). Every answer is checked against what the
runtime alone computes for the same prompt (conftest `expect`)."""

from __future__ import annotations

import http.client
import json
import math
import signal
import statistics
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from conftest import API_KEY, CTX, SIGTERM_EXIT, TIMEOUT

from clover_gguf.serve.text import split_reasoning

PROMPTS = [
    "def add(a, b):\n",
    "import sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n",
]


def raw(server, method, path, body=None, headers=None, key=API_KEY):
    h = {"Content-Type": "application/json"}
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    h.update(headers or {})
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
    try:
        conn.request(method, path, body=body, headers=h)
        r = conn.getresponse()
        data = r.read()
    finally:
        conn.close()
    return r.status, json.loads(data) if data else None


def props(server):
    return raw(server, "GET", "/props")[1]


def test_health_models_props(server, client, model_id, rt):
    assert raw(server, "GET", "/health", key=None) == (200, {"status": "ok"})
    models = client.models.list().data
    assert [m.id for m in models] == [model_id]
    p = props(server)
    assert p["config"]["ctx_size"] == CTX and p["config"]["parallel"] == 2 and p["config"]["api_key"] is True
    assert p["model"]["block_size"] == rt.default_block_size


# ----------------------------------------------------------------------------- completions


def test_completions_match_the_runtime(client, model_id, rt, expect):
    B = rt.default_block_size
    for prompt in PROMPTS[:2]:
        ids = rt.tokenize(prompt)
        toks, text = expect(ids, 40)
        r = client.completions.create(model=model_id, prompt=prompt, max_tokens=40)
        ch = r.choices[0]
        assert ch.text == text
        assert ch.finish_reason == ("length" if len(toks) == 40 else "stop")
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(toks))
        c = r.usage.clover
        assert c["block_size"] == B and c["schedule"] == "threshold=0.9"
        assert c["blocks"] == math.ceil(c["generated_tokens"] / B) and c["steps"] >= c["blocks"]
        assert c["tokens_per_step"] == pytest.approx(c["generated_tokens"] / c["steps"])
        assert c["prefill_tokens"] + c["reused_tokens"] == len(ids)
        timings = {"queue_ms", "prefill_ms", "first_block_ms", "generation_ms", "history_ms", "total_ms"}
        assert set(c["timings"]) == timings and c["sequence"] == 0
    # a prompt given as token ids, and the steps schedule of the extension object
    ids = rt.tokenize(PROMPTS[2])
    r = client.completions.create(model=model_id, prompt=ids, max_tokens=32, extra_body={"clover": {"steps": 4}})
    assert r.choices[0].text == expect(ids, 32, steps=4)[1]
    assert r.usage.clover["schedule"] == "steps=4" and r.usage.clover["steps"] == 4 * r.usage.clover["blocks"]
    # sampling: temperature, top_k, top_p and seed reach the runtime; a seed repeats an answer
    kw = dict(temperature=0.9, top_k=50, top_p=0.9, seed=7)
    want = expect(ids, 32, **kw)[1]
    for _ in range(2):
        r = client.completions.create(
            model=model_id,
            prompt=ids,
            max_tokens=32,
            **{k: v for k, v in kw.items() if k != "top_k"},
            extra_body={"top_k": 50},
        )
        assert r.choices[0].text == want
    assert want != expect(ids, 32, **{**kw, "seed": 8})[1]


def test_completions_stream_one_event_per_block(client, model_id, rt, expect):
    ids = rt.tokenize(PROMPTS[3])
    toks, text = expect(ids, 40)
    chunks = list(
        client.completions.create(
            model=model_id, prompt=PROMPTS[3], max_tokens=40, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(toks)  # include_usage
    events = chunks[:-1]
    usage = chunks[-1].usage
    assert all(c.usage is None for c in events)  # usage comes once, on its own chunk
    assert events[-1].choices[0].finish_reason in ("length", "stop")
    assert len(events) == usage.clover["blocks"] + 1  # one per block, then the finish event
    assert "".join(c.choices[0].text for c in events) == text


# ----------------------------------------------------------------------------- chat, thinking


@pytest.mark.parametrize("think", [False, True])
def test_chat_thinking_on_off(client, model_id, rt, expect, think):
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Add two numbers."}]
    ids = rt.tokenize(rt.chat_prompt(msgs, enable_thinking=think))
    toks, text = expect(ids, 32)
    kw = dict(
        model=model_id, messages=msgs, max_tokens=32, extra_body={"chat_template_kwargs": {"enable_thinking": think}}
    )
    r = client.chat.completions.create(**kw)
    m = r.choices[0].message
    assert r.usage.prompt_tokens == len(ids) and m.role == "assistant"
    reasoning, content = split_reasoning(text) if think else (None, text)
    assert m.content == content and (m.model_extra or {}).get("reasoning_content") == reasoning
    # streamed: the same message, block by block
    parts = {"content": "", "reasoning_content": ""}
    for ch in client.chat.completions.create(**kw, stream=True):
        d = ch.choices[0].delta
        parts["content"] += d.content or ""
        parts["reasoning_content"] += (d.model_extra or {}).get("reasoning_content") or ""
    assert parts == {"content": content, "reasoning_content": reasoning or ""}


def test_thinking_off_puts_an_empty_think_block_in_the_prompt(client, model_id, rt):
    msgs = [{"role": "user", "content": "hi"}]
    n = {}
    for think in (False, True):
        r = client.chat.completions.create(
            model=model_id, messages=msgs, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": think}}
        )
        n[think] = r.usage.prompt_tokens
    assert n[False] - n[True] == len(rt.tokenize("<think>\n\n</think>\n\n"))


# ----------------------------------------------------------------------------- stop sequences


def test_stop_sequences(client, model_id, rt, expect):
    B = rt.default_block_size

    # the first prompt whose completion has a 3-character string that first occurs a little way in
    for prompt in PROMPTS:
        toks, full = expect(rt.tokenize(prompt), 48)
        k = next(
            (i for i in range(4, len(full) - 3) if full[i : i + 3].strip() and full.find(full[i : i + 3]) == i), None
        )
        if k is not None:
            break
    else:
        pytest.fail("no completion holds a string to stop at")
    stop = full[k : k + 3]
    r = client.completions.create(model=model_id, prompt=prompt, max_tokens=48, stop=[stop, "never-seen-xyz"])
    assert r.choices[0].text == full[:k] and r.choices[0].finish_reason == "stop"
    # generation stopped at the block that completed the stop string
    n = next(i for i in range(1, len(toks) + 1) if stop in rt.detokenize(toks[:i]))
    assert r.usage.clover["blocks"] == math.ceil(n / B)
    # completion_tokens counts the tokens of the text returned, not the block run past the stop string
    returned = next(i for i in range(len(toks) + 1) if len(rt.detokenize(toks[:i])) >= k)
    assert r.usage.completion_tokens == returned < r.usage.clover["generated_tokens"]
    streamed = client.completions.create(model=model_id, prompt=prompt, max_tokens=48, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full[:k]


# ----------------------------------------------------------------------------- bad requests

C, CH = "/v1/completions", "/v1/chat/completions"
BAD = [
    ("bad JSON", C, b'{"prompt": "x",', None, "invalid_json"),
    ("non-UTF-8", C, b'{"prompt": "\xff\xfe"}', None, "invalid_encoding"),
    ("not an object", C, b"[1, 2]", None, "invalid_json"),
    ("model not a string", C, {"model": 5, "prompt": "x"}, "model", None),
    ("negative max_tokens", C, {"prompt": "x", "max_tokens": -1}, "max_tokens", None),
    ("max_tokens not an integer", C, {"prompt": "x", "max_tokens": "5"}, "max_tokens", None),
    ("top_p 0", C, {"prompt": "x", "top_p": 0}, "top_p", None),
    ("top_p above 1", C, {"prompt": "x", "top_p": 1.5}, "top_p", None),
    ("temperature", C, {"prompt": "x", "temperature": -0.5}, "temperature", None),
    ("prompt over the context", C, {"prompt": "x " * (2 * CTX)}, "prompt", "context_length_exceeded"),
    ("token id outside the vocabulary", C, {"prompt": [5, 10**7]}, "prompt", None),
    ("stop", C, {"prompt": "x", "stop": 5}, "stop", None),
    ("n", C, {"prompt": "x", "n": 2}, "n", "unsupported_parameter"),
    ("clover both schedules", C, {"prompt": "x", "clover": {"steps": 2, "threshold": 0.5}}, "clover.steps", None),
    ("clover block size", C, {"prompt": "x", "clover": {"block_size": 0}}, "clover.block_size", None),
    ("clover unknown field", C, {"prompt": "x", "clover": {"blocks": 2}}, "clover.blocks", None),
    (
        "messages over the context",
        CH,
        {"messages": [{"role": "user", "content": "y " * (2 * CTX)}]},
        "messages",
        "context_length_exceeded",
    ),  # fmt: skip
    ("no messages", CH, {"messages": []}, "messages", None),
    ("bad role", CH, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", None),
    (
        "chat negative max_completion_tokens",
        CH,
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3},
        "max_completion_tokens",
        None,
    ),  # fmt: skip
    (
        "chat_template_kwargs",
        CH,
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": "no"}},
        "chat_template_kwargs.enable_thinking",
        None,
    ),  # fmt: skip
]


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_request(server, case):
    _, path, body, param, code = case
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, err = raw(server, "POST", path, data)
    assert status == 400, err
    e = err["error"]
    assert e["type"] == "invalid_request_error" and e["message"]
    assert e["param"] == param and (code is None or e["code"] == code), e


def test_bad_request_through_the_openai_client(client, model_id):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=model_id, prompt="x", top_p=1.5)
    assert ei.value.status_code == 400 and ei.value.body["param"] == "top_p"


def test_body_size_limit(server):
    from clover_gguf.serve.http import MAX_BODY_BYTES

    status, err = raw(server, "POST", C, None, headers={"Content-Length": str(MAX_BODY_BYTES + 1)})
    assert status == 413 and "limit" in err["error"]["message"]


def test_api_key(server, client, model_id):
    assert raw(server, "GET", "/v1/models", key=None)[0] == 401
    status, err = raw(server, "POST", C, json.dumps({"prompt": "x"}).encode(), key="wrong")
    assert status == 401 and err["error"]["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=client.base_url, api_key="wrong", timeout=TIMEOUT, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=model_id, prompt="x", max_tokens=1)
    assert raw(server, "GET", "/v1/models", key=None, headers={"X-Api-Key": API_KEY})[0] == 200


# ----------------------------------------------------------------------------- lifecycle and load


def test_client_disconnect_cancels_at_the_next_block(server, client, model_id):
    before = props(server)["stats"]
    stream = client.completions.create(model=model_id, prompt="def main():\n", max_tokens=CTX - 16, stream=True)
    next(iter(stream))  # one block has arrived
    stream.close()
    deadline = time.monotonic() + 30
    while props(server)["stats"]["cancelled"] == before["cancelled"]:
        assert time.monotonic() < deadline, "the server did not cancel the generation of a closed stream"
        time.sleep(0.05)
    r = client.completions.create(model=model_id, prompt="x = 1\n", max_tokens=8)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_parallel_clients_get_what_they_get_alone(server, client, model_id, rt, expect):
    want = {p: expect(rt.tokenize(p), 24)[1] for p in PROMPTS}
    work = PROMPTS * 2

    def one(p):
        return client.completions.create(model=model_id, prompt=p, max_tokens=24, temperature=0).choices[0].text

    with ThreadPoolExecutor(len(work)) as ex:
        got = list(ex.map(one, work, timeout=4 * TIMEOUT))
    assert got == [want[p] for p in work]
    assert props(server)["stats"]["largest_group"] == 2  # --parallel 2: waiting requests went as groups


def test_load_run(server, client, model_id, rt, expect):
    """A bounded load: 3 clients x 4 requests (completions and chat, some streamed), all checked."""
    ext = {"clover": {"steps": 4}}
    msgs = [{"role": "user", "content": "Sort a list."}]
    chat_ids = rt.tokenize(rt.chat_prompt(msgs, enable_thinking=False))
    want_chat = expect(chat_ids, 16, steps=4)[1]
    want = {p: expect(rt.tokenize(p), 16, steps=4)[1] for p in PROMPTS}
    lat: list[float] = []
    errors: list[str] = []

    def client_loop(c):
        for i in range(4):
            t0 = time.perf_counter()
            if (c + i) % 3 == 0:
                r = client.chat.completions.create(
                    model=model_id,
                    messages=msgs,
                    max_tokens=16,
                    extra_body={**ext, "chat_template_kwargs": {"enable_thinking": False}},
                )
                got, exp = r.choices[0].message.content, want_chat
            else:
                p = PROMPTS[(c + i) % len(PROMPTS)]
                if i % 2:
                    s = client.completions.create(model=model_id, prompt=p, max_tokens=16, stream=True, extra_body=ext)
                    got = "".join(ch.choices[0].text for ch in s)
                else:
                    got = (
                        client.completions.create(model=model_id, prompt=p, max_tokens=16, extra_body=ext)
                        .choices[0]
                        .text
                    )
                exp = want[p]
            lat.append(time.perf_counter() - t0)
            if got != exp:
                errors.append(f"client {c} request {i}: {got!r} != {exp!r}")

    threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a load client hung"
    assert not errors, errors
    assert len(lat) == 12
    q = statistics.quantiles(lat, n=10)
    print(f"\nload run: 12 requests from 3 clients; latency p50 {statistics.median(lat) * 1e3:.0f} ms, "
          f"p90 {q[-1] * 1e3:.0f} ms, max {max(lat) * 1e3:.0f} ms")  # fmt: skip


# ----------------------------------------------------------------------------- state reuse


def test_turn2_prefills_only_the_new_tokens(client, model_id, rt, expect, eog):
    """Token-id prompts: turn 1 = P (2 blocks), reply G (1 block); turn 2 = P + G + X. Turn 2
    prefills exactly X, and its reply equals a fresh run on the whole history."""
    B = rt.default_block_size
    P = rt.tokenize("def parse_args(argv):\n    parser = argparse.ArgumentParser(description='Tool')\n")
    P = (P * 4)[: 2 * B]
    G, text = expect(P, B)
    assert len(G) == B and not set(G) & eog, "precondition: turn 1 fills one block without an end token"
    r1 = client.completions.create(model=model_id, prompt=P, max_tokens=B)
    assert r1.choices[0].text == text and r1.usage.clover["reused_tokens"] == 0
    X = rt.tokenize("\n    parser.add_argument('--verbose')\n    return parser")
    hist = P + G + X
    r2 = client.completions.create(model=model_id, prompt=hist, max_tokens=2 * B)
    c2 = r2.usage.clover
    assert c2["reused_tokens"] == len(P) + len(G) and c2["prefill_tokens"] == len(X)
    assert r2.usage.prompt_tokens_details.cached_tokens == len(P) + len(G)
    fresh = client.completions.create(
        model=model_id, prompt=hist, max_tokens=2 * B, extra_body={"clover": {"cache_prompt": False}}
    )
    assert fresh.usage.clover["reused_tokens"] == 0 and fresh.usage.clover["prefill_tokens"] == len(hist)
    assert r2.choices[0].text == fresh.choices[0].text == expect(hist, 2 * B)[1]


def test_chat_turn2_prefills_only_the_new_messages(client, model_id, rt):
    """A two-turn chat (thinking off): turn 2 restores the snapshot of turn 1's conversation with
    its reply (as the template renders it in turn 2, up to a full block), prefills the rest (the
    new message and fewer than B tokens before it), and answers what a fresh run answers."""
    B = rt.default_block_size
    kw = {"chat_template_kwargs": {"enable_thinking": False}}
    msgs = [
        {"role": "system", "content": "You are a coding agent. Reply with one action."},
        {"role": "user", "content": "The tests in test_stats.py fail. What do you do first?"},
    ]
    r1 = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=24, extra_body=kw)
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content}]
    before = rt.tokenize(rt.chat_prompt(msgs, enable_thinking=False, add_generation_prompt=False))
    msgs += [{"role": "user", "content": "Tool result (run test_stats.py):\nAssertionError: mean = 6.0\nNext?"}]
    p2 = rt.tokenize(rt.chat_prompt(msgs, enable_thinking=False))
    assert p2[: len(before)] == before
    r2 = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=24, extra_body=kw)
    c2 = r2.usage.clover
    assert c2["reused_tokens"] == len(before) // B * B
    new = len(p2) - len(before)
    assert c2["prefill_tokens"] == len(p2) - c2["reused_tokens"] and new <= c2["prefill_tokens"] < new + B
    fresh = client.chat.completions.create(
        model=model_id, messages=msgs, max_tokens=24, extra_body={**kw, "clover": {"cache_prompt": False}}
    )
    assert fresh.usage.clover["reused_tokens"] == 0
    assert r2.choices[0].message.content == fresh.choices[0].message.content


# ----------------------------------------------------------------------------- SIGTERM


def test_sigterm_finishes_in_flight_requests_and_exits(tiny_gguf, rt, expect, tmp_path):
    from clover_gguf.serve.local import LocalServer

    ids = rt.tokenize(PROMPTS[1])
    _, text = expect(ids, 128)
    srv = LocalServer(tiny_gguf, "-t", "1", "-c", str(CTX), log_path=tmp_path / "server.log").start()
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
        it = iter(c.completions.create(model=tiny_gguf.name, prompt=PROMPTS[1], max_tokens=128, stream=True))
        parts = [next(it).choices[0].text]
        srv.proc.send_signal(signal.SIGTERM)
        rest = list(it)
        parts += [ch.choices[0].text for ch in rest]
        assert rest and rest[-1].choices[0].finish_reason in ("length", "stop")
        assert "".join(parts) == text
        assert srv.proc.wait(30) in SIGTERM_EXIT, srv.log_tail()
        assert "Waiting for connections to close" in srv.log_tail()
    finally:
        srv.stop(10)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(srv.url + "/health", timeout=5)
