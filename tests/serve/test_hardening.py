"""Issue 47 (hardening, round 4) against `clover-gguf serve`: grammars and schemas within budgets
checked before anything is built (each a 400 naming the field, answered at once, the server
alive after), impossible schemas refused, a constraint that fails says so, the server's own
grammar rules out of a request's reach, tool parameters an object schema."""

from __future__ import annotations

import json
import time

import openai
import pytest
from conftest import CTX
from test_api import raw

CH = "/v1/chat/completions"
USER = [{"role": "user", "content": "Give me the data"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def _schema(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def _post(server, body: dict, seconds: float = 10.0):
    """(status, answer); the answer must come within `seconds` and the server must live on."""
    t0 = time.monotonic()
    status, r = raw(server.port, "POST", CH, {"model": "x", "messages": USER, "max_tokens": 8, **NO_THINK} | body)
    took = time.monotonic() - t0
    assert took < seconds, f"{took:.1f} s"
    assert raw(server.port, "GET", "/health")[0] == 200
    return status, r


HOSTILE = [
    ("deep nesting", {"grammar": "root ::= " + "(" * 100_000 + '"a"' + ")" * 100_000}, "grammar", "nests"),
    ("a chain of 100,000 rules",
     {"grammar": "\n".join(f"r{i} ::= r{i + 1}" for i in range(100_000)) + '\nr100000 ::= "a"\nroot ::= r0'},
     "grammar", ("rules", "characters")),
    ("min > max repetitions", {"grammar": 'root ::= "a"{10,2}'}, "grammar", "at least 10 and at most 2"),
    ("a repetition past the cap", {"grammar": 'root ::= "a"{0,2000000000}'}, "grammar", "repeats more than"),
    ("20,000 alternatives", {"grammar": "root ::= (" + "|".join(f'"w{i}"' for i in range(20_000)) + ")*"},
     "grammar", "alternatives"),
    ("minItems > maxItems", _schema({"type": "array", "minItems": 10, "maxItems": 2}), "response_format",
     "'minItems' 10 is more than 'maxItems' 2"),
    ("minLength > maxLength", _schema({"type": "string", "minLength": 10, "maxLength": 3}), "response_format",
     "'minLength' 10 is more than 'maxLength' 3"),
    ("the server's own rule", {"grammar": 'root ::= clover-body\nclover-body ::= "x"'}, "grammar", "clover-"),
    ("an ambiguous grammar", {"grammar": "root ::= " + ' "a"?' * 200 + ' "b"'}, "grammar", ("ambiguous", "longer than")),
    ("string tool parameters",
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters", "object"),
]  # fmt: skip


@pytest.mark.parametrize("case", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_budgets_and_impossible_constraints_are_400s(server, case):
    _, body, param, words = case
    status, r = _post(server, body)
    words = (words,) if isinstance(words, str) else words
    assert status == 400 and r["error"]["param"] == param and any(w in r["error"]["message"] for w in words), r


def test_a_schema_past_llama_cpps_repetition_limit_still_works(server):
    """Claude Code's Workflow tool has a string of maxLength 524288: llama.cpp refuses more than
    2,000 repetitions, so bounds past the cap are relaxed (a reply never reaches them)."""
    tool = {"type": "function", "function": {"name": "workflow", "parameters": {
        "type": "object", "properties": {"script": {"type": "string", "maxLength": 524288}}, "required": ["script"]}}}  # fmt: skip
    status, r = _post(server, {"tools": [tool], "tool_choice": "required", "max_tokens": 48}, seconds=60)
    assert status == 200 and r["choices"][0]["finish_reason"] in ("tool_calls", "length"), r


def test_a_constraint_that_fails_says_so(server):
    """A schema the converter cannot express ({"not": {}}: nothing fits) and a required call whose
    pattern nothing matches: the reply ends with finish_reason error and an `error` field, never
    200 "stop" with text that does not match."""
    status, r = _post(server, _schema({"not": {}}) | {"max_tokens": 32}, seconds=60)
    assert status == 400 and r["error"]["param"] == "response_format" and "no value fits" in r["error"]["message"], r
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"type": "string", "pattern": "^[^\\x00-\\x{10FFFF}]$"}}, "required": ["p"]}}}  # fmt: skip
    status, r = _post(server, {"tools": [tool], "tool_choice": "required", "max_tokens": 48}, seconds=60)
    if status == 200:
        ch = r["choices"][0]
        assert ch["finish_reason"] in ("error", "length") and not ch["message"].get("tool_calls"), r
        assert "<tool_call>" not in (ch["message"]["content"] or "")
        if ch["finish_reason"] == "error":
            assert r["error"]["code"] == "constraint_dead_end"
    else:
        assert status == 400 and r["error"]["param"] == "tools", r


def test_a_grammar_that_ends_where_it_may_is_not_an_error(server):
    status, r = _post(server, {"grammar": 'root ::= "ok"', "max_tokens": 16})
    assert (
        status == 200 and r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["message"]["content"] == "ok"
    )
    assert "error" not in r
    assert CTX > 0


def test_a_grammar_that_dead_ends_ends_with_an_error(server, client):
    """After "a" the grammar allows nothing ([b-a] is empty): libclover ends the sequence, and the server says the
    constraint failed (finish_reason error, an `error` field), streamed and not."""
    body = {"grammar": 'root ::= "a" [b-a] "c"', "max_tokens": 16}  # [b-a]: a class that holds nothing
    status, r = _post(server, body)
    assert status == 200 and r["choices"][0]["finish_reason"] == "error", r
    assert r["error"]["code"] == "constraint_dead_end" and "'grammar'" in r["error"]["message"]
    # streamed, the last chunk has finish_reason error and the error: the openai client raises it
    with pytest.raises(openai.APIError, match="constraint .'grammar'. failed"):
        list(client.chat.completions.create(model="x", messages=USER, stream=True, extra_body=NO_THINK | body))


def test_special_token_floods_tokenize_in_linear_time(rt):
    """The runtime splits special-token text off in one pass: the same ids as llama.cpp's own
    split, and 80,000 specials in well under a second (llama.cpp's: 24 s)."""
    import random

    rng = random.Random(0)
    rx, ids = rt._specials()
    pieces = ["def f(x):\n", " return", "é", "<|im", "_start|>", "  ", "\n\n", "abc<", "|>", *ids]
    for _ in range(500):
        t = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        for add in (False, True):
            assert rt.tokenize(t, add, True) == rt._tokenize(t, add, True), repr(t)
    t0 = time.monotonic()
    assert rt.tokenize("<|im_start|>" * 80_000) == [ids["<|im_start|>"]] * 80_000
    assert time.monotonic() - t0 < 5


def test_huge_prompts_are_refused_before_tokenizing(server):
    """15 MB of text is more than the context can hold whatever its tokens: refused at once."""
    big = "<|im_start|>" * 1_250_000  # 15 MB
    status, r = _post(server, {"messages": [{"role": "user", "content": big}]}, seconds=30)
    assert status == 400 and r["error"]["code"] == "context_length_exceeded", r
    status, r = raw(server.port, "POST", "/v1/completions", {"prompt": big, "max_tokens": 1})
    assert status == 400 and r["error"]["code"] == "context_length_exceeded", r
    status, r = raw(server.port, "POST", "/tokenize", {"content": big, "with_pieces": True})
    assert status == 400 and r["error"]["param"] == "content", r


@pytest.fixture(scope="module")
def hostile_gguf(tiny_gguf, tmp_path_factory):
    """clover-tiny with a chat template that never ends: cubic in the messages (no lookup inside,
    so only the process budget stops it), then nested range loops (the range budget stops those)."""
    from clover_gguf.gguf_io import codec

    g = codec.parse(tiny_gguf.read_bytes())
    kv = next(kv for kv in g.kvs if kv.key == b"tokenizer.chat_template")
    kv.value = (
        b"{% for a in messages %}{% for b in messages %}{% for c in messages %}{{ '' }}{% endfor %}{% endfor %}"
        b"{% endfor %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
    )
    p = tmp_path_factory.mktemp("hostile") / "hostile-template.gguf"
    p.write_bytes(codec.serialize(g)[0])
    return p


def test_a_hostile_template_holds_only_its_own_requests(hostile_gguf, tmp_path):
    """Chat on a GGUF whose template never ends: each request is a 400 within the server's budget
    (its worker killed and replaced) or, while every template worker is held, a 503 after
    PREP_QUEUE_WAIT; plain completions and /health go on meanwhile, and
    `run --chat` is one line."""
    from concurrent.futures import ThreadPoolExecutor

    from click.testing import CliRunner

    from clover_gguf.cli import cli
    from clover_gguf.serve.local import LocalServer

    with LocalServer(hostile_gguf, "-t", "1", "--parallel", "2", log_path=tmp_path / "server.log") as srv:
        body = {"messages": USER * 300, "max_tokens": 4}
        with ThreadPoolExecutor(6) as ex:
            slow = [ex.submit(raw, srv.port, "POST", p, body, None) for p in ("/apply-template", CH) * 3]
            plain = raw(srv.port, "POST", "/v1/completions", {"prompt": "def f():\n", "max_tokens": 8}, None)
            assert plain[0] == 200, plain
            answers = [f.result(timeout=120) for f in slow]
            for status, r in answers:  # past the budget, or turned away while both workers are held
                if status == 400:
                    assert r["error"]["param"] == "messages" and "chat template" in r["error"]["message"], r
                else:
                    assert status == 503 and r["error"]["code"] == "server_busy", r
            assert sum(s == 400 for s, _ in answers) >= 2, answers
        assert raw(srv.port, "GET", "/health", key=None)[0] == 200
        stats = raw(srv.port, "GET", "/props", key=None)[1]["stats"]
        assert stats["prep_workers_replaced"] >= 1 and stats["server_errors"] == 0
    res = CliRunner().invoke(cli, ["run", str(hostile_gguf), "--chat", "-p", "hi", "-n", "4", "-t", "1"])
    assert res.exit_code == 1 and res.stderr.count("\n") == 1 and "chat template" in res.stderr, res.stderr


def test_fields_with_no_effect_are_still_typed_and_bounded(server):
    """`user` is a bounded string (a 15 MB one of nested arrays was accepted: +1.2 GB), metadata a
    small object of scalars; a body of more JSON values than the server counts is refused unparsed."""
    for field, value in (("user", "u" * 5000), ("user", [[1]]), ("metadata", {f"k{i}": "v" for i in range(1000)}),
                         ("prompt_cache_key", {"a": 1}), ("store", "yes")):  # fmt: skip
        status, r = _post(server, {field: value})
        assert status == 400 and r["error"]["param"] == field and r["error"]["code"] == "invalid_value", (field, r)
    nested = b'{"model": "x", "messages": [{"role": "user", "content": "hi"}], "user": [' + b"[]," * 1_500_000 + b"[]]}"
    status, r = raw(server.port, "POST", CH, nested)
    assert status == 413 and "JSON values" in r["error"]["message"], r
    status, r = _post(server, {"user": "alice", "metadata": {"session": "s1"}, "store": True})
    assert status == 200, r
    # what Codex 0.171 sends on /v1/responses: its turn metadata as a 1,100-character JSON string
    turn = json.dumps({"installation_id": "b3e00ddb-794f-412d-bb9a-7a81dde87989", "workspaces": {
        "/home/user/project": {"latest_git_commit_hash": "c" * 40, "has_changes": False}}, "pad": "x" * 900})  # fmt: skip
    codex = {"x-codex-window-id": "01a25256:0", "session_id": "01a25256", "x-codex-turn-metadata": turn}
    body = {"model": "x", "input": "hi", "max_output_tokens": 4, "client_metadata": codex, "store": False}
    status, r = raw(server.port, "POST", "/v1/responses", body)
    assert status == 200, r


def test_equal_constraints_are_built_once(server):
    """A request whose tools equal an earlier one's reuses its built constraint (agents send the
    same tools every turn), and equal requests sent together share one job."""
    from concurrent.futures import ThreadPoolExecutor

    from conftest import API_KEY

    def stats():
        return raw(server.port, "GET", "/props", key=API_KEY)[1]["stats"]

    props = {f"p{i}": {"type": "string", "maxLength": 64} for i in range(3)}
    tools = [{"type": "function", "function": {"name": f"f{k}", "parameters": {"type": "object", "properties": props}}}
             for k in range(2)]  # fmt: skip
    body = {"tools": tools, "tool_choice": "required"}
    before = stats()
    status, r = _post(server, body)
    assert status == 200, r
    with ThreadPoolExecutor(4) as ex:
        assert [s for s, _ in ex.map(lambda _: _post(server, body, 30), range(4))] == [200] * 4
    after = stats()
    assert after["prep_constraint_jobs"] - before["prep_constraint_jobs"] == 1, (before, after)
    assert after["prep_constraints_reused"] - before["prep_constraints_reused"] == 4, (before, after)


def test_a_slow_constraint_is_killed_when_its_client_leaves(server):
    """An ambiguous grammar whose client disconnects while its worker measures it: the job is killed
    with its worker (replaced) at once, not after the 4 s budget."""
    import json
    import socket

    from conftest import API_KEY

    def replaced():
        return raw(server.port, "GET", "/props", key=API_KEY)[1]["stats"]["prep_workers_replaced"]

    before = replaced()
    body = {"model": "x", "messages": USER, "max_tokens": 8, "grammar": "root ::= " + ' "a"?' * 150 + ' "c"'}
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(f"POST {CH} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)  # fmt: skip
    time.sleep(0.3)
    s.close()
    t0 = time.monotonic()
    while replaced() == before and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert replaced() == before + 1
    assert time.monotonic() - t0 < 3.0, "the job ran on after its client left"
