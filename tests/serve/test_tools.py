"""Tool calls and structured output through the real openai client against `clover-gguf serve`:
`tools` + `tool_choice`, streamed and not, `response_format` with `.parse()`, `grammar`, the
history of calls round-tripping through the chat template, and the errors."""

from __future__ import annotations

import json

import jsonschema
import pytest
from test_server import raw

from clover_gguf.reference.generate import GenerationConfig
from clover_gguf.serve.tools import chat_message, check_tools, request_constraint

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "start_line": {"type": "integer", "minimum": 1}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "grep",
            "description": "Search the repository",
            "parameters": {
                "type": "object",
                "properties": {
                    "pattern": {"type": "string"},
                    "mode": {"enum": ["regex", "fixed"]},
                    "paths": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                    "options": {
                        "type": "object",
                        "properties": {"ignore_case": {"type": "boolean"}, "context": {"type": "integer"}},
                        "required": ["ignore_case"],
                    },
                },
                "required": ["pattern", "mode", "options"],
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = [
    f"{verb} {what}"
    for verb in ("Show me", "Find", "Open", "Look for")
    for what in ("os.py", "the definition of join", "where json.loads is used", "the tests of shutil", "TODO comments")
]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def _valid_calls(calls, names=None):
    assert calls, "no tool call"
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert c.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def _required(model_id, prompt) -> dict:
    """A chat request for one or more calls of TOOLS."""
    return dict(
        model=model_id,
        messages=[{"role": "user", "content": prompt}],
        tools=TOOLS,
        tool_choice="required",
        max_tokens=192,
        extra_body=NO_THINK,
    )


def test_required_tool_calls_validate_20_of_20(client, model_id):
    for p in PROMPTS:
        r = client.chat.completions.create(**_required(model_id, p))
        ch = r.choices[0]
        _valid_calls(ch.message.tool_calls)
        assert ch.finish_reason in ("tool_calls", "length")


def test_streamed_required_tool_calls_validate_20_of_20(client, model_id):
    """Streamed, every call arrives whole in one delta.tool_calls chunk, validates against its
    tool's schema, and equals the non-streamed reply's (greedy: the same tokens)."""
    for p in PROMPTS:
        kw = _required(model_id, p)
        streamed, finish = [], None
        for chunk in client.chat.completions.create(stream=True, **kw):
            if chunk.choices:
                streamed += chunk.choices[0].delta.tool_calls or []
                finish = chunk.choices[0].finish_reason or finish
        _valid_calls(streamed)
        assert [c.index for c in streamed] == list(range(len(streamed)))
        assert finish in ("tool_calls", "length")
        whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
        assert [(c.function.name, c.function.arguments) for c in streamed] == [
            (c.function.name, c.function.arguments) for c in whole
        ]


def test_parallel_tool_calls_false_gives_one_call(client, model_id):
    """With parallel_tool_calls false the grammar allows one call: the replies that held several
    calls now hold one, the first of them (greedy: the same tokens up to its end)."""
    several = 0
    for p in PROMPTS:
        kw = _required(model_id, p)
        free = client.chat.completions.create(**kw).choices[0].message.tool_calls
        one = client.chat.completions.create(parallel_tool_calls=False, **kw).choices[0].message.tool_calls
        _valid_calls(one)
        assert len(one) == 1
        assert (one[0].function.name, one[0].function.arguments) == (free[0].function.name, free[0].function.arguments)
        several += len(free) > 1
    print(f"{several}/{len(PROMPTS)} replies held several calls with parallel_tool_calls true")


def test_streamed_tool_calls_equal_the_reply(client, model_id):
    kw = dict(
        model=model_id,
        messages=[{"role": "user", "content": PROMPTS[0]}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "grep"}},
        max_tokens=192,
        extra_body=NO_THINK,
    )
    r = client.chat.completions.create(**kw)
    calls = r.choices[0].message.tool_calls
    _valid_calls(calls, ["grep"])
    assert len(calls) == 1 and r.choices[0].finish_reason == "tool_calls"
    streamed, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        d = chunk.choices[0].delta
        streamed += d.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(streamed) == 1
    assert (streamed[0].index, streamed[0].function.name) == (0, "grep")
    assert streamed[0].function.arguments == calls[0].function.arguments


def test_parse_structured_output_20_of_20(client, model_id):
    from pydantic import BaseModel

    class Finding(BaseModel):
        path: str
        line: int
        severity: str
        tags: list[str]

    for p in PROMPTS:
        r = client.chat.completions.parse(
            model=model_id, messages=[{"role": "user", "content": p}], response_format=Finding, max_tokens=160
        )
        assert isinstance(r.choices[0].message.parsed, Finding), r.choices[0].message.content


def test_json_object_and_grammar(client, model_id):
    r = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": "anything"}],
        response_format={"type": "json_object"},
        max_tokens=96,
        extra_body=NO_THINK,
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": "yes or no?"}],
        max_tokens=8,
        extra_body={"grammar": 'root ::= ("yes" | "no") "."', **NO_THINK},
    )
    assert r.choices[0].message.content in ("yes.", "no.")


def test_tool_choice_none_and_auto_prompts(client, model_id):
    msgs = [{"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=1).usage.prompt_tokens
    none = client.chat.completions.create(
        model=model_id, messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=1
    ).usage.prompt_tokens
    auto = client.chat.completions.create(model=model_id, messages=msgs, tools=TOOLS, max_tokens=1).usage.prompt_tokens
    assert none == plain < auto  # "none" renders no tools; "auto" renders the <tools> section


def test_history_of_calls_round_trips_through_the_template(rt):
    """A reply parsed into tool_calls, sent back as the assistant message, renders to exactly the
    text the model generated: the next turn's prompt extends this one."""
    msgs = [{"role": "user", "content": PROMPTS[3]}]
    choice = {"type": "function", "function": {"name": "grep"}}  # one call, then the end of the turn
    con = request_constraint(check_tools(TOOLS), choice, True, None, None, False, rt.token_id)
    prompt = rt.chat_prompt(msgs, enable_thinking=False, tools=con.tools)
    cfg = GenerationConfig(max_new_tokens=192, block_size=rt.default_block_size, grammar=con.grammar)
    toks = rt.generate(rt.tokenize(prompt), cfg).tokens
    assert set(toks) & rt.eog or len(toks) < cfg.max_new_tokens  # a complete reply
    text = rt.detokenize([t for t in toks if t not in rt.eog])
    msg = chat_message(text, False, True)
    assert msg["tool_calls"]
    history = rt.chat_prompt(msgs + [msg], enable_thinking=False, tools=con.tools, add_generation_prompt=False)
    assert history == prompt.removesuffix("<think>\n\n</think>\n\n") + text + "<|im_end|>\n"
    # and the next turn with the tool's answer renders after it
    nxt = msgs + [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "ok"}]
    assert rt.chat_prompt(nxt, tools=con.tools).startswith(history + "<|im_start|>user\n<tool_response>\nok\n")


def test_a_conversation_with_calls_and_results(client, model_id):
    """An agent's loop: call, tool result, next turn (tool messages and assistant tool_calls accepted,
    the state after the call reused)."""
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    choice = {"type": "function", "function": {"name": "read_file"}}
    r = client.chat.completions.create(
        model=model_id, messages=msgs, tools=TOOLS, tool_choice=choice, max_tokens=192, extra_body=NO_THINK
    )
    assert r.choices[0].finish_reason == "tool_calls"
    m = r.choices[0].message
    msgs.append(m.model_dump(exclude_none=True))
    msgs += [{"role": "tool", "tool_call_id": c.id, "content": "def join(a, *p): ..."} for c in m.tool_calls]
    r2 = client.chat.completions.create(model=model_id, messages=msgs, tools=TOOLS, max_tokens=16, extra_body=NO_THINK)
    # the call rendered back as generated: turn 2 reuses the snapshot taken past the reply's start
    assert r2.usage.prompt_tokens_details.cached_tokens > r.usage.prompt_tokens


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": "x"}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nope"}}}},
            "response_format",
        ),
        ({"grammar": "root ::= nothing"}, "grammar"),
        ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "grammar"),
        (
            {
                "messages": [
                    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_tool_fields_are_400_naming_the_field(server, extra, param):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | extra
    status, err = raw(server, "POST", "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400, err
    assert err["error"]["param"] == param, err
