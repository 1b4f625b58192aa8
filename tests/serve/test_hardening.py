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
