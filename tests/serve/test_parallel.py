"""`clover-gguf serve --parallel 4`: requests are decoded together (one sequence each, one graph
per denoising step, new ones joining between steps), and each gets what it gets alone; a finished
conversation's snapshot is stored before the request is reported done."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import API_KEY, CTX, SIGTERM_EXIT, TIMEOUT

N = 4


@pytest.fixture(scope="module")
def server4(tiny_gguf, tmp_path_factory):
    from clover_gguf.serve.local import LocalServer

    log = tmp_path_factory.mktemp("serve-np4") / "server.log"
    args = ("-t", "1", "--api-key", API_KEY, "--parallel", str(N), "--ctx-cache", "32", "-c", str(CTX))
    srv = LocalServer(tiny_gguf, *args, log_path=log).start()
    yield srv
    assert srv.stop(timeout=30) in SIGTERM_EXIT, srv.log_tail()


@pytest.fixture(scope="module")
def client4(server4):
    from openai import OpenAI

    return OpenAI(base_url=server4.url + "/v1", api_key=API_KEY, timeout=TIMEOUT, max_retries=0)


def stats(server) -> dict:
    req = urllib.request.Request(server.url + "/props", headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
        return json.loads(r.read())["stats"]


def test_requests_decoded_together_give_what_they_give_alone(server4, client4, tiny_gguf, rt, expect):
    """A long request is decoding when 4 others arrive: they join it at the next step, as many as
    there are free sequences, the last one when a sequence frees (continuous batching); different
    prompts, lengths (a short last block), block sizes, schedules and a seeded sample."""
    B = rt.default_block_size
    work = [
        ("def add(a, b):\n", 3 * B, {}, {}),
        ("import sys\n\n\ndef main(argv):\n", 2 * B + 5, {}, {}),
        ("class Stack:\n    def __init__(self):\n", 24, {"block_size": B // 2, "steps": 4}, {}),
        ("for i in range(10):\n", 2 * B, {"steps": 8}, {"temperature": 0.8, "seed": 11}),
    ]

    def want(p, n, ext, kw):
        gen = {"temperature": kw.get("temperature", 0.0), "seed": kw.get("seed", 0)}
        gen |= {"steps": ext["steps"]} if "steps" in ext else {}
        from clover_gguf.reference.generate import GenerationConfig

        cfg = GenerationConfig(max_new_tokens=n, block_size=ext.get("block_size", B), **gen)
        rt.reset()
        toks = rt.generate(rt.tokenize(p), cfg, reset=False).tokens
        eog = {t for t in range(rt.n_vocab) if rt._lib.lc.llama_vocab_is_eog(rt.vocab, t)}
        cut = next((i for i, t in enumerate(toks) if t in eog), len(toks))
        return rt.detokenize(toks[:cut])

    expected = [want(*w) for w in work]
    before = stats(server4)
    blocker = client4.completions.create(
        model=tiny_gguf.name, prompt="def main():\n", max_tokens=8 * B, stream=True, extra_body={"clover": {"steps": B}}
    )
    it = iter(blocker)
    next(it)  # it is decoding

    def one(w):
        p, n, ext, kw = w
        r = client4.completions.create(model=tiny_gguf.name, prompt=p, max_tokens=n, extra_body={"clover": ext}, **kw)
        return r.choices[0].text, r.usage.clover

    with ThreadPoolExecutor(N) as ex:
        futs = [ex.submit(one, w) for w in work]
        time.sleep(0.3)
        for _ in it:
            pass
        got = [f.result(timeout=4 * TIMEOUT) for f in futs]
    assert [g[0] for g in got] == expected
    after = stats(server4)
    assert after["largest_group"] == N  # the blocker and three of them, the fourth when one ends
    assert all(0 <= g[1]["sequence"] < N for g in got)
    graphs = after["denoise_graphs"] - before["denoise_graphs"]
    steps = after["sequence_steps"] - before["sequence_steps"]
    assert graphs < steps, (graphs, steps)  # steps of several requests shared graphs


def test_max_tokens_0_generates_nothing(client4, tiny_gguf):
    t0 = time.monotonic()
    r = client4.completions.create(model=tiny_gguf.name, prompt="x = 1\n", max_tokens=0)
    assert r.choices[0].text == "" and r.usage.completion_tokens == 0 and r.usage.clover["blocks"] == 0
    assert r.choices[0].finish_reason == "length" and time.monotonic() - t0 < 10


def test_next_turn_finds_the_snapshot_even_when_the_queue_is_never_empty(server4, client4, tiny_gguf, rt, expect, eog):
    """Other clients keep the queue busy; a conversation's turn 2, sent the moment turn 1 is
    done, still restores turn 1's history (its snapshot is stored before turn 1 is reported)."""
    B = rt.default_block_size
    stop = threading.Event()

    def noise():
        while not stop.is_set():
            client4.completions.create(model=tiny_gguf.name, prompt="import os\n", max_tokens=B)

    bg = [threading.Thread(target=noise, daemon=True) for _ in range(3)]
    for t in bg:
        t.start()
    ran = 0
    try:
        for head in ("def parse_args(argv):\n    parser = argparse.ArgumentParser(description='Tool')\n",
                     "def handler(event, context):\n    payload = event['body']\n",
                     "class Config:\n    def __init__(self, path):\n"):  # fmt: skip
            P = (rt.tokenize(head) * 4)[: 2 * B]
            G, text = expect(P, B)
            if len(G) < B or set(G) & eog:
                continue  # turn 1 must fill one block without an end token
            r1 = client4.completions.create(model=tiny_gguf.name, prompt=P, max_tokens=B)
            assert r1.choices[0].text == text
            X = rt.tokenize("\n    return payload")
            r2 = client4.completions.create(model=tiny_gguf.name, prompt=P + G + X, max_tokens=B)
            c2 = r2.usage.clover
            assert c2["reused_tokens"] == 3 * B and c2["prefill_tokens"] == len(X), (head, c2)
            ran += 1
    finally:
        stop.set()
        for t in bg:
            t.join(4 * TIMEOUT)
    assert ran >= 1, "no prompt met the precondition"
    assert stats(server4)["largest_group"] >= 2


def test_a_long_prompt_is_prefilled_between_the_steps_of_others(tiny_gguf, tmp_path, rt, expect):
    """A 40,000-token prompt is committed a chunk between the denoising steps of the sequences
    that decode (llama-server's chunked prefill): a short request sent while it is being
    committed finishes first, and both get what they get alone (a chunked commit equals one)."""
    from clover_gguf.serve.local import LocalServer

    B = rt.default_block_size
    text = "def f(x):\n    return x + 1\n\n\n"
    long_ids = rt.tokenize(text * 4000)[:40_000]
    assert len(long_ids) == 40_000
    args = ("-t", "1", "--api-key", API_KEY, "--parallel", "3", "-c", "65536")
    with LocalServer(tiny_gguf, *args, log_path=tmp_path / "server.log") as srv:

        def post(body):
            req = urllib.request.Request(
                srv.url + "/v1/completions",
                data=json.dumps({"model": "x", **body}).encode(),
                headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=600) as r:
                out = json.loads(r.read())
            return out, time.monotonic()

        # a request decoding (many one-token steps) while the long prompt arrives
        short = {"prompt": "def add(a, b):\n", "max_tokens": 8 * B, "clover": {"steps": B}}
        with ThreadPoolExecutor(3) as ex:
            busy = ex.submit(post, short)
            time.sleep(0.2)
            big = ex.submit(post, {"prompt": long_ids, "max_tokens": B})
            time.sleep(1.0)
            quick = ex.submit(post, {"prompt": "import os\n", "max_tokens": B})
            (b_out, t_big), (q_out, t_quick), (s_out, _) = big.result(), quick.result(), busy.result()
        assert t_quick < t_big, "the short request waited for the whole prefill"
        assert q_out["choices"][0]["text"] == expect(rt.tokenize("import os\n"), B)[1]
        assert s_out["choices"][0]["text"] == expect(rt.tokenize("def add(a, b):\n"), 8 * B, steps=B)[1]
        assert b_out["choices"][0]["text"] == expect(long_ids, B)[1]


@pytest.mark.parametrize("cancelled", [0, 1])
def test_a_job_cancelled_in_a_group_leaves_the_others_right(tiny_gguf, expect, cancelled):
    """Jobs that waited together, one of them cancelled before its prompt is committed: the others
    decode on the sequences their prompts were committed on, each getting what it gets alone (the
    long server fuzz campaign found a KeyError there when the first job was the one cancelled)."""
    from clover_gguf.reference.generate import GenerationConfig
    from clover_gguf.runtime.runtime import CloverRuntime
    from clover_gguf.serve.engine import Engine, Job

    rt = CloverRuntime(tiny_gguf, n_threads=1, n_seq_max=4)
    try:
        B = rt.default_block_size
        eng = Engine(rt, parallel=3)
        prompts = ["def add(a, b):\n", "import os\n", "class Stack:\n"]
        events: list[list[dict]] = [[], [], []]
        jobs = []
        for i, p in enumerate(prompts):

            def emit(ev, i=i):
                events[i].append(ev)
                if i == cancelled and ev["type"] == "start":
                    jobs[i].cancel()  # admitted, then gone before its prompt is committed

            cfg = GenerationConfig(max_new_tokens=2 * B, block_size=B)
            jobs.append(Job(prompt=rt.tokenize(p), cfg=cfg, emit=emit, cache=False))
        eng.run_group(jobs)
        for i, p in enumerate(prompts):
            last = events[i][-1]
            if i == cancelled:
                assert last["type"] == "error" and last.get("status") == 499, events[i]
            else:
                assert last["type"] == "done", events[i]
                assert last["text"] == expect(rt.tokenize(p), 2 * B)[1], (i, last)
    finally:
        rt.close()
