"""Issue 47 (hardening, round 4) against `clover-gguf serve`: grammars and schemas within budgets
checked before anything is built (each a 400 naming the field, answered at once, the server
alive after), impossible schemas refused, a constraint that fails says so, the server's own
grammar rules out of a request's reach, tool parameters an object schema."""

from __future__ import annotations

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
     "grammar", "rules"),
    ("min > max repetitions", {"grammar": 'root ::= "a"{10,2}'}, "grammar", "at least 10 and at most 2"),
    ("a repetition past the cap", {"grammar": 'root ::= "a"{0,2000000000}'}, "grammar", "repeats more than"),
    ("20,000 alternatives", {"grammar": "root ::= (" + "|".join(f'"w{i}"' for i in range(20_000)) + ")*"},
     "grammar", "alternatives"),
    ("minItems > maxItems", _schema({"type": "array", "minItems": 10, "maxItems": 2}), "response_format",
     "'minItems' 10 is more than 'maxItems' 2"),
    ("minLength > maxLength", _schema({"type": "string", "minLength": 10, "maxLength": 3}), "response_format",
     "'minLength' 10 is more than 'maxLength' 3"),
    ("the server's own rule", {"grammar": 'root ::= clover-body\nclover-body ::= "x"'}, "grammar", "clover-"),
    ("string tool parameters",
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters", "object"),
]  # fmt: skip


@pytest.mark.parametrize("case", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_budgets_and_impossible_constraints_are_400s(server, case):
    _, body, param, words = case
    status, r = _post(server, body)
    assert status == 400 and r["error"]["param"] == param and words in r["error"]["message"], r


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
