"""The honest API of `clover-gguf serve` (issues 22 and 26): cancellation at the next denoising
step, the server's limits (--n-predict, max_tokens past the context, --queue-timeout, SIGTERM),
usage once per stream, every request field implemented or refused, any model name (--alias),
llama-server's /tokenize, /detokenize, /apply-template and /metrics, and 4xx (never 5xx) for the
bad requests of issue 26. The real openai client where a client sends such a request, raw HTTP
where none would."""

from __future__ import annotations

import http.client
import json
import math
import re
import signal
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from conftest import API_KEY, CTX, SIGTERM_EXIT, TIMEOUT

from clover_gguf.serve import fields
from clover_gguf.serve.local import LocalServer

C, CH = "/v1/completions", "/v1/chat/completions"
ALIAS = "clover-under-test"
N_PREDICT = 300  # server1's --n-predict
QUEUE_TIMEOUT = 3  # and --queue-timeout (s): longer than a cancelled request takes to stop
LONG = {"clover": {"block_size": 256, "steps": 256}}  # one block of 256 one-token steps
USER = [{"role": "user", "content": "Write a function that adds two numbers."}]


def raw(port, method, path, body=None, key=API_KEY, headers=None):
    status, out, _ = raw_h(port, method, path, body, key, headers)
    return status, out


def raw_h(port, method, path, body=None, key=API_KEY, headers=None):
    """raw(), with the answer's headers (lower-case names) as a third value."""
    h = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        out = r.read()
    finally:
        conn.close()
    ctype = r.getheader("Content-Type") or ""
    hdrs = {k.lower(): v for k, v in r.getheaders()}
    return r.status, (json.loads(out) if out and "json" in ctype else out.decode()), hdrs


def stats(port, key=API_KEY):
    return raw(port, "GET", "/props", key=key)[1]["stats"]


def wait_for(pred, what: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def send_and_abandon(port, body, path=C, key=API_KEY):
    """Send a request, wait until the worker decodes it, then drop the connection."""
    before = stats(port, key)["requests"]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    h = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    conn.request("POST", path, body=json.dumps(body).encode(), headers=h)
    wait_for(lambda: stats(port, key)["requests"] > before and stats(port, key)["processing"] == 1, "the start")
    conn.sock.close()
    conn.close()


@pytest.fixture(scope="module")
def server1(tiny_gguf, tmp_path_factory):
    """One sequence (--parallel 1), so that a request that is not cancelled would hold it."""
    log = tmp_path_factory.mktemp("serve1") / "server.log"
    args = ["-t", "1", "--parallel", "1", "-c", str(CTX), "--api-key", API_KEY, "--alias", ALIAS]
    args += ["--n-predict", str(N_PREDICT), "--queue-timeout", str(QUEUE_TIMEOUT)]
    srv = LocalServer(tiny_gguf, *args, log_path=log).start()
    yield srv
    assert srv.stop(timeout=30) in SIGTERM_EXIT, srv.log_tail()


@pytest.fixture(scope="module")
def client1(server1):
    return openai.OpenAI(base_url=server1.url + "/v1", api_key=API_KEY, timeout=TIMEOUT, max_retries=0)


# ----------------------------------------------------------------------------- cancellation


@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
def test_abandoned_request_stops_at_the_next_step(server1, client1, stream):
    """A request of one 256-step block is abandoned while it decodes; a second request sent then
    is answered, and the first ran fewer than its 256 steps: it was stopped mid-block (cancelling
    at block ends, the second request would have waited for all 256)."""
    before = stats(server1.port)
    send_and_abandon(server1.port, {"prompt": "def main():\n", "max_tokens": 256, "stream": stream, **LONG})
    r = client1.completions.create(model="anything", prompt="x = 1\n", max_tokens=8)
    after = stats(server1.port)
    assert after["cancelled"] == before["cancelled"] + 1 and after["requests"] == before["requests"] + 2
    first_steps = after["sequence_steps"] - before["sequence_steps"] - r.usage.clover["steps"]
    assert 1 <= first_steps < 256, first_steps
    assert r.usage.clover["sequence"] == 0 and r.choices[0].finish_reason in ("length", "stop")


def test_queue_timeout_and_cancel_while_queued(server1, client1):
    """While a long request holds the only sequence, a second one is refused with 503 after
    --queue-timeout, and it never runs; a third abandoned while queued never runs either."""
    before = stats(server1.port)
    conn = http.client.HTTPConnection("127.0.0.1", server1.port, timeout=TIMEOUT)
    body = {"prompt": "def main():\n", "max_tokens": 256, "stream": True, **LONG}
    conn.request("POST", C, body=json.dumps(body).encode(), headers={"Authorization": f"Bearer {API_KEY}"})
    resp = conn.getresponse()  # streamed: the headers come when the worker has taken it
    assert resp.status == 200
    try:
        with pytest.raises(openai.APIStatusError) as ei:
            client1.completions.create(model="x", prompt="y = 2\n", max_tokens=4)
        assert ei.value.status_code == 503 and ei.value.body["code"] == "queue_timeout"
        mid = stats(server1.port)
        assert mid["processing"] == 1 and mid["cancelled"] == before["cancelled"], "the long request ended early"
        assert mid["queue_timeouts"] == before["queue_timeouts"] + 1
        # abandoned while queued: dropped by the worker, never decoded
        c2 = http.client.HTTPConnection("127.0.0.1", server1.port, timeout=TIMEOUT)
        c2.request("POST", C, body=json.dumps({"prompt": "z", "max_tokens": 4}).encode(),
                   headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
        wait_for(lambda: stats(server1.port)["queued"] == 1, "the queued request")
        c2.sock.close()
        c2.close()
    finally:
        conn.sock.close()
        conn.close()
    wait_for(lambda: stats(server1.port)["processing"] == 0, "the long request to stop")
    wait_for(lambda: stats(server1.port)["queued"] == 0, "the queue to empty")
    after = stats(server1.port)
    assert after["requests"] == before["requests"] + 1  # only the long one ever started
    assert after["cancelled"] == before["cancelled"] + 2  # the long one and the queued one


def test_sigterm_does_not_wait_for_an_abandoned_request(tiny_gguf, tmp_path):
    srv = LocalServer(tiny_gguf, "-t", "1", "-c", str(CTX), log_path=tmp_path / "server.log").start()
    try:
        send_and_abandon(srv.port, {"prompt": "def main():\n", "max_tokens": 256, **LONG}, key=None)
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) in SIGTERM_EXIT
        m = re.search(
            r"stopped after (\d+) requests \((\d+) cancelled, 0 errors\), (\d+) denoising steps", srv.log_tail()
        )
        assert m, srv.log_tail()
        requests, cancelled, steps = map(int, m.groups())
        assert (requests, cancelled) == (1, 1) and steps < 256, srv.log_tail()
    finally:
        srv.stop(10)


# ----------------------------------------------------------------------------- limits


def test_n_predict_is_the_default_and_the_cap(server1, client1):
    """Chat without max_tokens runs until an end token, at most --n-predict; a larger max_tokens,
    past the context too, is capped to it (usage.clover.max_tokens says the limit used), as
    llama-server caps n_predict; a negative one is a 400."""
    kw = dict(model="gpt-4o", messages=USER, stop=[" ", "\n"])  # stops within the first block
    r = client1.chat.completions.create(**kw)
    assert r.usage.clover["max_tokens"] == N_PREDICT
    r = client1.chat.completions.create(**kw, max_tokens=CTX - 100)
    assert r.usage.clover["max_tokens"] == N_PREDICT
    r = client1.chat.completions.create(**kw, max_tokens=7)
    assert r.usage.clover["max_tokens"] == 7
    r = client1.completions.create(model="x", prompt="def f():\n", stop=[" ", "\n"])
    assert r.usage.clover["max_tokens"] == 16  # the legacy completions default, as OpenAI
    for key in ("max_tokens", "max_completion_tokens"):
        for v in (CTX + 1, 10**12, 2**63):
            r = client1.chat.completions.create(**kw, **{key: v})
            assert r.usage.clover["max_tokens"] == N_PREDICT
        with pytest.raises(openai.BadRequestError) as ei:
            client1.chat.completions.create(model="x", messages=USER, **{key: -1})
        assert ei.value.body["param"] == key and ei.value.body["code"] == "invalid_value"


def test_n_predict_ends_a_reply_with_length(server1, client1, rt, expect):
    ids = rt.tokenize("import os\n")
    toks, text = expect(ids, N_PREDICT)
    assert len(toks) == N_PREDICT, "precondition: the greedy completion runs past --n-predict without an end token"
    r = client1.completions.create(model="x", prompt="import os\n", max_tokens=CTX - len(ids))
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == N_PREDICT
    assert r.choices[0].text == text


@pytest.mark.parametrize(
    "args,msg,code",
    [  # ranges: options.py's table, checked by click (exit 2); the rest by serve() (exit 1)
        (["--n-predict", "0"], "'-n' / '--n-predict': 0 is not in the range 1<=x<=1073741824", 2),
        (["--queue-timeout", "-1"], "'--queue-timeout': -1 is not a finite number in [0, 86400]", 2),
        (["--queue-timeout", "nan"], "'--queue-timeout': nan is not a finite number", 2),
        (["--alias", " "], "--alias: must not be empty", 1),
        (["--api-key", ""], "--api-key: empty", 1),
    ],
)
def test_serve_option_errors(tiny_gguf, args, msg, code):
    from click.testing import CliRunner

    from clover_gguf.cli import cli

    r = CliRunner().invoke(cli, ["serve", str(tiny_gguf), *args])
    assert r.exit_code == code and msg in r.output and "Traceback" not in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1


def test_an_empty_key_from_the_environment_is_refused(tiny_gguf):
    """CLOVER_GGUF_API_KEY= (set but empty) would serve with no authentication: refused like an
    empty --api-key, before the model loads."""
    from click.testing import CliRunner

    from clover_gguf.cli import cli

    for value in ("", "   "):
        r = CliRunner().invoke(cli, ["serve", str(tiny_gguf)], env={"CLOVER_GGUF_API_KEY": value})
        assert r.exit_code == 1 and "Traceback" not in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1 and (
            "CLOVER_GGUF_API_KEY" in r.output or "--api-key" in r.output
        )


# ----------------------------------------------------------------------------- model names


def test_any_model_name_and_the_alias(server1, client1):
    assert [m.id for m in client1.models.list().data] == [ALIAS]
    for name in ("gpt-4o", "openai/gpt-4o", ALIAS, ""):
        r = client1.completions.create(model=name, prompt="x", max_tokens=1)
        assert r.model == ALIAS
    status, err = raw(server1.port, "POST", C, {"model": ["a"], "prompt": "x"})
    assert status == 400 and err["error"]["param"] == "model"


# ----------------------------------------------------------------------------- usage


def test_usage_once_per_stream(client, model_id):
    for route in ("completions", "chat"):
        kw = dict(model=model_id, max_tokens=20, stream=True)
        make = (
            (lambda **k: client.completions.create(prompt="def f(x):\n", **k))
            if route == "completions"
            else (lambda **k: client.chat.completions.create(messages=USER, **k))
        )
        chunks = list(make(**kw))
        assert chunks and all(c.usage is None for c in chunks), route  # no include_usage: no usage
        chunks = list(make(**kw, stream_options={"include_usage": True}))
        with_usage = [c for c in chunks if c.usage is not None]
        assert len(with_usage) == 1 and with_usage[0] is chunks[-1] and chunks[-1].choices == [], route
        assert chunks[-2].choices[0].finish_reason in ("length", "stop")


# ----------------------------------------------------------------------------- request fields

CHAT_BODY = {"messages": USER, "max_tokens": 1}
COMPLETION_BODY = {"prompt": "x", "max_tokens": 1}
OTHER = {"n": 2, "frequency_penalty": 0.5, "presence_penalty": -1, "logit_bias": {"5": 1}, "store": True,
         "service_tier": "flex", "modalities": ["audio"], "echo": True, "best_of": 3}  # fmt: skip
NEUTRAL = {"n": 1, "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "store": False,
           "service_tier": "auto", "modalities": ["text"], "echo": False, "best_of": 1}  # fmt: skip


def _cases(table, route):
    return [(route, k, f.status) for k, f in table.items() if f.status != fields.IMPLEMENTED]


@pytest.mark.parametrize(
    "route,name,status", _cases(fields.CHAT, CH) + _cases(fields.COMPLETIONS, C), ids=lambda x: str(x)
)
def test_every_field_not_implemented_is_refused_or_neutral(server, route, name, status):
    base = CHAT_BODY if route == CH else COMPLETION_BODY
    if status == fields.NO_EFFECT:  # typed and bounded even so (issue 47)
        value = {"store": True, "metadata": {"session": "s1"}}.get(name, "someone")
        code, _ = raw(server.port, "POST", route, base | {name: value})
        assert code == 200
        code, err = raw(server.port, "POST", route, base | {name: [[1]]})
        assert code == 400 and err["error"]["param"] == name and err["error"]["code"] == "invalid_value", err
        return
    if status == fields.NEUTRAL:
        code, err = raw(server.port, "POST", route, base | {name: NEUTRAL[name]})
        assert code == 200, err
    code, err = raw(server.port, "POST", route, base | {name: OTHER.get(name, {"x": 1})})
    assert code == 400 and err["error"]["param"] == name and err["error"]["code"] == "unsupported_parameter", err
    assert name in err["error"]["message"]
    code, _ = raw(server.port, "POST", route, base | {name: None})  # null is the default
    assert code == 200


@pytest.mark.parametrize("route", [C, CH])
def test_unknown_fields_are_ignored_and_named(server, route):
    """A field no table knows is accepted (agents add fields with every release), and named: in the
    answer's x-clover-ignored-fields header and in /props; a known refused field stays a 400."""
    base = CHAT_BODY if route == CH else COMPLETION_BODY
    for name in ("repetition_penalty", "min_p", "foo_" + route.split("/")[-1], "stream_options.bar"):
        body = base | ({"stream_options": {"bar": 1}} if "." in name else {name: 1})
        code, r, h = raw_h(server.port, "POST", route, body)
        assert code == 200 and name in h["x-clover-ignored-fields"].split(", "), (r, h)
        assert name in raw(server.port, "GET", "/props")[1]["ignored_fields"]
    code, r, h = raw_h(server.port, "POST", route, base)
    assert code == 200 and "x-clover-ignored-fields" not in h
    code, err = raw(server.port, "POST", route, base | {"stream_options": {"include_obfuscation": True}})
    assert code == 400 and err["error"]["param"] == "stream_options.include_obfuscation"
    refused = {"n": 2} if route == CH else {"suffix": "x"}
    code, err = raw(server.port, "POST", route, base | refused)
    assert code == 400 and err["error"]["code"] == "unsupported_parameter", err


def test_message_fields(server):
    m = {"role": "user", "content": "hi", "name": "alice"}  # AutoGen sends name: accepted
    assert raw(server.port, "POST", CH, CHAT_BODY | {"messages": [m]})[0] == 200
    back = {"role": "assistant", "content": "ok", "refusal": None, "annotations": [], "audio": None}
    assert raw(server.port, "POST", CH, CHAT_BODY | {"messages": [m, back, m]})[0] == 200
    code, r, h = raw_h(server.port, "POST", CH, CHAT_BODY | {"messages": [m | {"cache_control": {}}]})
    assert code == 200 and h["x-clover-ignored-fields"] == "messages[].cache_control", (r, h)
    for bad, param in (
        ({"role": "assistant", "content": "x", "refusal": "no"}, "messages[0].refusal"),
        ({"role": "user", "content": "x", "tool_call_id": "c1"}, "messages[0].tool_call_id"),
        ({"role": "user", "content": "x", "name": 5}, "messages[0].name"),
    ):
        code, err = raw(server.port, "POST", CH, CHAT_BODY | {"messages": [bad]})
        assert code == 400 and err["error"]["param"] == param, err


def test_docs_table_lists_every_field():
    """docs/serving.md's field table has one row per field, with its status on each route as
    fields.py has it ("—": not a field of that route, refused as unknown)."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    section = doc.split("### Every request field", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            for name in re.findall(r"`([a-z_.]+)`", cells[0]):
                rows[name] = (cells[1], cells[2])
    words = {fields.IMPLEMENTED: "implemented", fields.NEUTRAL: "refused", fields.NO_EFFECT: "accepted, no effect",
             fields.REFUSED: "refused"}  # fmt: skip
    for col, table in enumerate((fields.CHAT, fields.COMPLETIONS)):
        for name, f in table.items():
            assert name in rows, f"docs/serving.md has no row for `{name}`"
            assert rows[name][col].startswith(words[f.status]), (name, col, rows[name])
        for name in set(rows) - set(table):
            assert rows[name][col] == "—", (name, col, rows[name])
    assert set(rows) == set(fields.CHAT) | set(fields.COMPLETIONS)
    # the tables of /v1/messages and /v1/responses, one column each
    for title, table in (("## Anthropic Messages", fields.ANTHROPIC), ("## OpenAI Responses", fields.RESPONSES)):
        section = doc.split(title, 1)[1].split("\n## ", 1)[0]
        rows = {}
        for line in section.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 3 and cells[0].startswith("`"):
                for name in re.findall(r"`([a-z_.]+)`", cells[0]):
                    rows[name] = cells[1]
        assert set(rows) == set(table), (title, set(rows) ^ set(table))
        for name, f in table.items():
            assert rows[name].startswith(words[f.status]), (title, name, rows[name])


# ----------------------------------------------------------------------------- issue 26: 4xx, never 5xx


def deep(n):
    return ("[" * n + "]" * n).encode()


ISSUE26 = [
    ("lone surrogate in a prompt", C, b'{"prompt": "a\\ud800b", "max_tokens": 1}', "prompt", "invalid_encoding"),
    ("lone surrogate in a message", CH, b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
     "messages[0].content", "invalid_encoding"),
    ("JSON nested 100k deep", C, b'{"prompt": ' + deep(100_000) + b"}", None, "invalid_json"),
    ("JSON nested 65 deep", C, b'{"prompt": "x", "user": ' + deep(64) + b"}", "user", "invalid_json"),
    ("clover.steps 1000", C, {"prompt": "x", "clover": {"steps": 1000}}, "clover.steps", "invalid_value"),
    ("clover.steps past the block", C, {"prompt": "x", "clover": {"block_size": 8, "steps": 9}}, "clover.steps",
     "invalid_value"),
    ("top_k past 32 bits", C, {"prompt": "x", "top_k": 2**32 + 5}, "top_k", "invalid_value"),
    ("seed past 32 bits", C, {"prompt": "x", "seed": 2**32}, "seed", "invalid_value"),
    ("negative seed", C, {"prompt": "x", "seed": -1}, "seed", "invalid_value"),
    ("max_tokens -2**63", C, {"prompt": "x", "max_tokens": -(2**63)}, "max_tokens", "invalid_value"),
    ("max_tokens 1e12", C, {"prompt": "x", "max_tokens": 1e12}, "max_tokens", "invalid_value"),
    ("clover.steps 10**400", C, {"prompt": "x", "clover": {"steps": 10**400}}, "clover.steps", "invalid_value"),
    ("infill n_predict 10**400", "/infill", {"input_prefix": "x", "n_predict": 10**400}, "n_predict", "invalid_value"),
    ("infill max_tokens past one block", "/infill", {"input_prefix": "x", "max_tokens": 10**6}, "max_tokens",
     "invalid_value"),
    ("a tool schema of 3000 optional properties", CH, {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}}}]},
     "tools", None),
    ("temperature NaN", C, b'{"prompt": "x", "temperature": NaN}', None, "invalid_json"),
    ("top_p Infinity", C, b'{"prompt": "x", "top_p": Infinity}', None, "invalid_json"),
    ("threshold 0", C, {"prompt": "x", "clover": {"threshold": 0}}, "clover.threshold", "invalid_value"),
    ("top_logprobs 21", CH, {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "invalid_value"),
    ("huge stop string", C, {"prompt": "x", "stop": "s" * 5000}, "stop", None),
    ("template kwargs the server sets", CH, {"messages": USER, "chat_template_kwargs": {"add_generation_prompt": 1}},
     "chat_template_kwargs.add_generation_prompt", None),
    ("content part not text", CH, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]", None),
]  # fmt: skip


@pytest.mark.parametrize("case", ISSUE26, ids=[c[0] for c in ISSUE26])
def test_bad_requests_are_4xx_naming_the_field(server, case):
    _, route, body, param, code = case
    status, err = raw(server.port, "POST", route, body)
    assert status == 400, err
    e = err["error"]
    assert e["type"] == "invalid_request_error" and e["param"] == param, e
    assert code is None or e["code"] == code, e


def test_numeric_table_bounds():
    limits = {"ctx": 100, "n_ubatch": 64, "block_size": 16}
    for p, n in fields.NUMERIC.items():
        hi = limits[n.hi] if isinstance(n.hi, str) else n.hi
        lo = limits[n.lo] if isinstance(n.lo, str) else n.lo
        bad = ["1", True, [1], float("nan"), float("inf")]
        bad += [] if math.isinf(hi) else [hi + (1 if n.integer else 0.5)]
        bad += [lo] if n.lo_open else [lo - 1]
        if n.integer:
            bad.append(float(lo) + 1.0)
        for v in bad:
            with pytest.raises(fields.FieldProblem) as ei:
                fields.number({"k": v}, "k", limits, p)
            assert ei.value.param == p and "must be" in str(ei.value), (p, v)
        top = 2**63 if math.isinf(hi) else hi  # no upper bound: capped by the server instead
        assert fields.number({"k": top}, "k", limits, p) == top
        assert fields.number({}, "k", limits, p) is None


# ----------------------------------------------------------------------------- llama-server routes


def test_tokenize_detokenize(server, rt):
    text = "<|im_start|>def f(x): return 'é'"
    status, r = raw(server.port, "POST", "/tokenize", {"content": text})
    assert status == 200 and r["tokens"] == rt.tokenize(text)
    _, r2 = raw(server.port, "POST", "/tokenize", {"content": text, "with_pieces": True, "parse_special": False})
    ids = rt.tokenize(text, parse_special=False)
    assert [t["id"] for t in r2["tokens"]] == ids and ids != r["tokens"]  # <|im_start|> as text
    for t in r2["tokens"]:
        b = rt.token_bytes(t["id"])
        assert t["piece"] == (list(b) if isinstance(t["piece"], list) else b.decode())
    assert any(isinstance(t["piece"], list) for t in r2["tokens"])  # "é" is split over two byte tokens
    _, r3 = raw(server.port, "POST", "/tokenize", {"content": "x", "add_special": True})
    assert r3["tokens"] == rt.tokenize("x", add_special=True)
    status, d = raw(server.port, "POST", "/detokenize", {"tokens": r["tokens"]})
    assert status == 200 and d["content"] == rt.detokenize(r["tokens"]) == text
    for path, body, param in (
        ("/tokenize", {"content": 5}, "content"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ):
        status, err = raw(server.port, "POST", path, body)
        assert status == 400 and err["error"]["param"] == param, err


def test_apply_template(server, rt):
    msgs = [{"role": "system", "content": "You code."}, {"role": "user", "content": "hi"}]
    status, r = raw(server.port, "POST", "/apply-template", {"messages": msgs})
    assert status == 200 and r["prompt"] == rt.chat_prompt(msgs, enable_thinking=True)
    kw = {"chat_template_kwargs": {"enable_thinking": False}}
    _, r = raw(server.port, "POST", "/apply-template", {"messages": msgs, **kw})
    assert r["prompt"] == rt.chat_prompt(msgs, enable_thinking=False)
    tool = {"type": "function", "function": {"name": "read_file", "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}  # fmt: skip
    _, r = raw(server.port, "POST", "/apply-template", {"messages": msgs, "tools": [tool], **kw})
    assert "<tools>" in r["prompt"] and "read_file" in r["prompt"]
    assert r["prompt"] == rt.chat_prompt(msgs, enable_thinking=False, tools=[tool])
    status, err = raw(server.port, "POST", "/apply-template", {"messages": []})
    assert status == 400 and err["error"]["param"] == "messages"


def _metrics(port) -> dict[str, float]:
    status, text = raw(port, "GET", "/metrics")
    assert status == 200
    out, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name] = kind
        elif line and not line.startswith("#"):
            name, value = line.split()
            out[name] = float(value)
    assert set(out) == set(types)
    return out


def test_metrics(server, client, model_id):
    m0 = _metrics(server.port)
    for name in ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total", "llamacpp:requests_processing",
                 "llamacpp:requests_deferred", "llamacpp:n_decode_total", "clover:denoise_steps_total",
                 "clover:tokens_per_step"):  # fmt: skip
        assert name in m0
    r = client.completions.create(model=model_id, prompt="import sys\n", max_tokens=20,
                                  extra_body={"clover": {"cache_prompt": False}})  # fmt: skip
    m1 = _metrics(server.port)
    d = lambda k: m1[k] - m0[k]
    assert d("llamacpp:tokens_predicted_total") == r.usage.completion_tokens
    assert d("llamacpp:prompt_tokens_total") == r.usage.prompt_tokens
    assert d("clover:denoise_steps_total") == r.usage.clover["steps"]
    assert d("clover:positions_denoised_total") == r.usage.clover["generated_tokens"]
    assert d("clover:requests_total") == 1 and m1["llamacpp:requests_processing"] == 0
    p = stats(server.port)
    assert m1["clover:denoise_steps_total"] == p["sequence_steps"]
    assert m1["clover:tokens_per_step"] == pytest.approx(p["generated_tokens"] / p["sequence_steps"])


def test_new_routes_need_the_api_key(server):
    for method, path, body in (("GET", "/metrics", None), ("POST", "/tokenize", {"content": "x"}),
                               ("POST", "/detokenize", {"tokens": [1]}),
                               ("POST", "/apply-template", {"messages": USER})):  # fmt: skip
        assert raw(server.port, method, path, body, key=None)[0] == 401
        assert raw(server.port, method, path, body, key="wrong")[0] == 401
        assert raw(server.port, method, path, body)[0] == 200
    assert urllib.request.urlopen(server.url + "/health", timeout=TIMEOUT).status == 200
