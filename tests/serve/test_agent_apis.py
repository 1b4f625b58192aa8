"""The APIs coding agents speak, through their official clients against `clover-gguf serve`:
Anthropic's Messages API with the `anthropic` SDK (messages.create, messages.stream, tools,
thinking, count_tokens, its error shape), OpenAI's Responses API with the `openai` SDK
(responses.create, streamed, tools and a function_call_output round trip, text.format,
previous_response_id), litellm's mapping of a context overflow to ContextWindowExceededError on
both, and what agents send by default (penalties, logit_bias, reasoning_effort, unknown fields)."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
from conftest import API_KEY, CTX, TIMEOUT
from test_api import raw_h
from test_tools import SCHEMAS, TOOLS

USER = "Find where json.loads is used"
A_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
R_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
LONG = "def f(x):\n    return x + 1\n\n" * 200  # well over the server's context of CTX tokens


@pytest.fixture(scope="module")
def ac(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, timeout=TIMEOUT, max_retries=0)


@pytest.fixture(scope="module")
def oc(client):
    return client


# ----------------------------------------------------------------------------- Anthropic Messages


def test_messages_text_and_stop_reasons(ac):
    r = ac.messages.create(model="claude-sonnet-4-5", max_tokens=24, messages=[{"role": "user", "content": "Hello"}])
    assert r.type == "message" and r.role == "assistant" and r.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text
    assert r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) > 0 and r.usage.output_tokens > 0
    cut = ac.messages.create(model="x", max_tokens=3, messages=[{"role": "user", "content": "Write a long story"}])
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens <= 3
    word = r.content[0].text.split()[0] if r.content[0].text.split() else r.content[0].text[:2]
    s = ac.messages.create(
        model="x", max_tokens=24, messages=[{"role": "user", "content": "Hello"}], stop_sequences=[word]
    )
    assert s.stop_reason == "stop_sequence" and s.stop_sequence == word and word not in s.content[0].text


def test_messages_system_blocks_thinking_and_count_tokens(ac):
    system = [{"type": "text", "text": "You are a coding agent."}, {"type": "text", "text": "Be brief."}]
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "Write a loop", "cache_control": {"type": "ephemeral"}}]}
    ]
    n = ac.messages.count_tokens(model="x", system=system, messages=msgs).input_tokens
    r = ac.messages.create(model="x", max_tokens=16, system=system, messages=msgs)
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == n
    on = ac.messages.create(
        model="x", max_tokens=48, system=system, messages=msgs, thinking={"type": "enabled", "budget_tokens": 1024}
    )
    n_on = ac.messages.count_tokens(
        model="x", system=system, messages=msgs, thinking={"type": "enabled", "budget_tokens": 1024}
    ).input_tokens
    assert n_on != n  # thinking off renders the empty think block (Clover's template)
    if on.content and on.content[0].type == "thinking":
        assert on.content[0].signature  # clients send it back


def test_messages_tool_use_and_tool_result_round_trip(ac):
    msgs = [{"role": "user", "content": USER}]
    r = ac.messages.create(model="x", max_tokens=160, messages=msgs, tools=A_TOOLS, tool_choice={"type": "any"})
    uses = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason in ("tool_use", "max_tokens") and uses  # parallel calls may run to the limit
    for u in uses:
        jsonschema.validate(u.input, SCHEMAS[u.name])
    one = ac.messages.create(
        model="x",
        max_tokens=160,
        messages=msgs,
        tools=A_TOOLS,
        tool_choice={"type": "tool", "name": "grep", "disable_parallel_tool_use": True},
    )
    assert [b.name for b in one.content if b.type == "tool_use"] == ["grep"] and one.stop_reason == "tool_use"
    # the result goes back; the second turn restores the first turn's memory from its snapshot
    back = [b.model_dump(exclude_none=True) for b in r.content]
    results = [
        {"type": "tool_result", "tool_use_id": u.id, "content": "json/__init__.py:299: def loads(s)"} for u in uses
    ]
    msgs2 = msgs + [{"role": "assistant", "content": back}, {"role": "user", "content": results}]
    r2 = ac.messages.create(model="x", max_tokens=32, messages=msgs2, tools=A_TOOLS)
    assert r2.usage.cache_read_input_tokens >= r.usage.input_tokens + r.usage.cache_read_input_tokens - 16
    err = ac.messages.create(
        model="x", max_tokens=8, tools=A_TOOLS,
        messages=msgs + [{"role": "assistant", "content": back}, {"role": "user", "content": [results[0] | {"is_error": True}]}],
    )  # fmt: skip
    assert err.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_messages_stream_equals_create(ac):
    kw = dict(model="x", max_tokens=160, messages=[{"role": "user", "content": USER}], tools=A_TOOLS)
    for choice in ({"type": "any"}, {"type": "none"}):
        whole = ac.messages.create(**kw, tool_choice=choice)
        with ac.messages.stream(**kw, tool_choice=choice) as st:
            kinds = [e.type for e in st]
            final = st.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
        assert final.stop_reason == whole.stop_reason
        strip = lambda m: [
            (b.type, getattr(b, "text", None), getattr(b, "name", None), getattr(b, "input", None)) for b in m.content
        ]
        assert strip(final) == strip(whole)
        assert final.usage.output_tokens == whole.usage.output_tokens


def test_messages_errors_in_anthropic_shape(server, ac):
    with pytest.raises(anthropic.BadRequestError) as ei:
        ac.messages.create(model="x", max_tokens=8, messages=[{"role": "user", "content": LONG}])
    assert ei.value.body["type"] == "error" and ei.value.body["error"]["type"] == "invalid_request_error"
    assert ei.value.body["error"]["message"].startswith("prompt is too long: ") and f"> {CTX} maximum" in str(ei.value)
    with pytest.raises(anthropic.BadRequestError):
        ac.messages.create(
            model="x", max_tokens=8, messages=[{"role": "user", "content": "hi"}], tool_choice={"type": "any"}
        )
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as ei:
        bad.messages.create(model="x", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert ei.value.body["error"]["type"] == "authentication_error"
    # the beta client's ?beta=true and headers, Bearer auth, unknown fields ignored and named
    r = ac.beta.messages.create(
        model="x", max_tokens=8, messages=[{"role": "user", "content": "hi"}], betas=["interleaved-thinking-2025-05-14"]
    )
    assert r.content is not None
    body = {"model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "context_management": {}}
    status, out, h = raw_h(
        server.port, "POST", "/v1/messages?beta=true", body, headers={"anthropic-version": "2023-06-01"}
    )
    assert status == 200 and h["x-clover-ignored-fields"] == "context_management", out
    web = {"type": "web_search_20250305", "name": "web_search"}
    status, out, h = raw_h(server.port, "POST", "/v1/messages", body | {"tools": A_TOOLS + [web]})
    assert status == 200 and h["x-clover-left-out-tools"] == "web_search_20250305:web_search"
    # a bad custom tool after a server tool is named by its place among all the tools
    bad_tool = {"name": "9 bad name", "input_schema": {"type": "object"}}
    status, out, _ = raw_h(server.port, "POST", "/v1/messages", body | {"tools": [web, bad_tool]})
    assert status == 400 and "tools[1]" in out["error"]["message"] and "tools[0]" not in out["error"]["message"], out


# ----------------------------------------------------------------------------- OpenAI Responses


def test_responses_text_stream_and_usage(oc):
    r = oc.responses.create(model="gpt-5", input="Write a loop", max_output_tokens=24, reasoning={"effort": "none"})
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    with oc.responses.stream(
        model="gpt-5", input="Write a loop", max_output_tokens=24, reasoning={"effort": "none"}
    ) as st:
        events = list(st)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    # cut at max_output_tokens: response.incomplete, as OpenAI's (the SDK's final helper wants completed)
    assert kinds[-1] == f"response.{r.status}"
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds
    final = events[-1].response
    assert final.output_text == r.output_text and final.status == r.status
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_tools_and_function_call_output_round_trip(oc):
    kw = dict(model="x", tools=R_TOOLS, tool_choice="required", max_output_tokens=160, reasoning={"effort": "none"})
    kw["parallel_tool_calls"] = False  # one call, then the end of the reply: status completed
    r = oc.responses.create(input=USER, **kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and r.status == "completed"
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
    with oc.responses.stream(input=USER, **kw) as st:
        kinds = [e.type for e in st]
        final = st.get_final_response()
    assert "response.function_call_arguments.done" in kinds
    assert [(c.name, c.arguments) for c in final.output if c.type == "function_call"] == [
        (c.name, c.arguments) for c in calls
    ]
    # the result goes back as input items; the second turn reuses the first's memory
    items = [{"role": "user", "content": USER}] + [c.model_dump(exclude_none=True) for c in calls]
    items += [{"type": "function_call_output", "call_id": c.call_id, "output": "json/__init__.py:299"} for c in calls]
    r2 = oc.responses.create(model="x", input=items, tools=R_TOOLS, max_output_tokens=32, reasoning={"effort": "none"})
    assert r2.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens - 16
    # the same, with previous_response_id instead of the history
    r3 = oc.responses.create(
        model="x", previous_response_id=r.id, tools=R_TOOLS, max_output_tokens=32, reasoning={"effort": "none"},
        input=[{"type": "function_call_output", "call_id": c.call_id, "output": "json/__init__.py:299"} for c in calls],
    )  # fmt: skip
    assert r3.output_text == r2.output_text
    with pytest.raises(openai.BadRequestError) as ei:
        oc.responses.create(model="x", previous_response_id="resp_gone", input="hi")
    assert ei.value.body["param"] == "previous_response_id"


def test_responses_text_format_and_left_out_tools(server, oc):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["name", "n"],
    }
    fmt = {"format": {"type": "json_schema", "name": "thing", "schema": schema}}
    r = oc.responses.create(
        model="x", input="Describe a file", text=fmt, max_output_tokens=64, reasoning={"effort": "none"}
    )
    jsonschema.validate(json.loads(r.output_text), schema)
    codex = {
        "model": "gpt-5-codex", "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox"}]},
                                          {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        "instructions": "You are Codex.", "tools": R_TOOLS + [{"type": "web_search"}, {"type": "custom", "name": "apply_patch"}],
        "tool_choice": "auto", "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False, "stream": False, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "abc",
        "max_output_tokens": 16, "client_metadata": {"x": "y"}, "safety_identifier": "u", "service_tier": "auto",
        "truncation": "disabled", "metadata": {"a": "b"},
    }  # fmt: skip
    status, out, h = raw_h(server.port, "POST", "/v1/responses", codex)
    assert status == 200 and h["x-clover-left-out-tools"] == "web_search, custom:apply_patch", out
    assert out["store"] is False
    status, out, _ = raw_h(server.port, "GET", f"/v1/responses/{out['id']}")
    assert status == 404  # store: false


# ----------------------------------------------------------------------------- what agents send


def test_litellm_maps_context_overflow(server):
    import litellm  # in the test extras: a missing one fails

    msgs = [{"role": "user", "content": LONG}]
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(model="openai/x", api_base=server.url + "/v1", api_key=API_KEY, messages=msgs, max_tokens=8)
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(model="anthropic/x", api_base=server.url, api_key=API_KEY, messages=msgs, max_tokens=8)


def test_fields_agents_send_by_default(oc):
    msgs = [{"role": "user", "content": "Write a loop"}]
    kw = dict(model="x", messages=msgs, max_tokens=24)
    base = oc.chat.completions.create(**kw, reasoning_effort="none").choices[0].message
    assert base.model_extra.get("reasoning_content") is None
    on = oc.chat.completions.create(**kw, reasoning_effort="high")
    assert on.usage.prompt_tokens != oc.chat.completions.create(**kw, reasoning_effort="minimal").usage.prompt_tokens
    extra = dict(prompt_cache_key="k", safety_identifier="s", metadata={"a": "b"}, store=True, service_tier="flex")
    assert oc.chat.completions.create(**kw, reasoning_effort="none", **extra).choices[0].message.content == base.content


def test_cut_call_shows_no_markup(oc):
    """A reply cut by max_tokens inside a call: no <tool_call> text, the same content streamed."""
    kw = dict(
        model="x", messages=[{"role": "user", "content": USER}], tools=TOOLS, tool_choice="required", max_tokens=6
    )
    r = oc.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls
    content = r.choices[0].message.content or ""
    assert "<tool_call>" not in content
    st = oc.chat.completions.create(**kw, stream=True, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert "".join(c.choices[0].delta.content or "" for c in st if c.choices) == content


def test_reserialised_calls_reuse_the_state(server, oc):
    """A client that sends a call back compactly re-serialised reuses the turn's state as much as
    one that sends it back as it came (the server renders the call as it generated it)."""
    msgs = [{"role": "user", "content": USER}]
    kw = dict(model="x", tools=TOOLS, max_tokens=160, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    r = oc.chat.completions.create(messages=msgs, tool_choice="required", **kw)
    m = r.choices[0].message

    def back(compact: bool) -> list:
        calls = [c.model_dump() for c in m.tool_calls]
        if compact:
            for c in calls:
                c["function"]["arguments"] = json.dumps(json.loads(c["function"]["arguments"]), separators=(",", ":"))
        res = [{"role": "tool", "tool_call_id": c["id"], "content": "ok"} for c in calls]
        return msgs + [{"role": "assistant", "content": m.content, "tool_calls": calls}] + res

    # compact first: what it reuses comes from the first turn's snapshots alone
    compact = oc.chat.completions.create(messages=back(True), **kw).usage.prompt_tokens_details.cached_tokens
    assert compact >= r.usage.prompt_tokens - 16
    # and the two histories render to the same prompt, so they reuse the same
    body = {"tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}}
    prompts = [
        raw_h(server.port, "POST", "/apply-template", body | {"messages": back(c)})[1]["prompt"] for c in (True, False)
    ]
    assert prompts[0] == prompts[1] and m.tool_calls[0].function.arguments in prompts[0]


def test_penalties_and_logit_bias_through_the_server(server, oc):
    """OpenAI's logit_bias and penalties reach llama.cpp's samplers: a ban moves the reply off its
    first token, +100 on a token fills the reply with it, a frequency penalty changes a reply that
    repeats tokens; out of range is a 400 naming the field."""
    kw = dict(
        model="x", messages=[{"role": "user", "content": "Write a loop"}], max_tokens=24, logprobs=True,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    toks = lambda r: [t.token for t in r.choices[0].logprobs.content]

    def token_id(text: str) -> int:
        status, r, _ = raw_h(server.port, "POST", "/tokenize", {"content": text})
        assert status == 200 and len(r["tokens"]) == 1, (text, r)
        return r["tokens"][0]

    base = oc.chat.completions.create(**kw)
    first = toks(base)[0]
    banned = oc.chat.completions.create(**kw, logit_bias={str(token_id(first)): -100})
    assert toks(banned)[0] != first
    forced = oc.chat.completions.create(**kw, logit_bias={str(token_id("x")): 100})
    assert set(toks(forced)) == {"x"} and len(toks(forced)) == 24
    assert len(set(toks(base))) < len(toks(base)), "precondition: the greedy reply repeats a token"
    pen = oc.chat.completions.create(**kw, frequency_penalty=2.0)
    assert toks(pen) != toks(base)
    assert len(set(toks(pen))) / len(toks(pen)) >= len(set(toks(base))) / len(toks(base))
    for field, v in (("frequency_penalty", 2.5), ("presence_penalty", -3), ("logit_bias", {"999999": 1})):
        with pytest.raises(openai.BadRequestError) as ei:
            oc.chat.completions.create(**kw, **{field: v})
        assert ei.value.body["param"].startswith(field)


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses", "/v1/chat/completions"])
def test_a_client_that_leaves_mid_reply_leaves_no_traceback(server, path):
    """A non-streamed request whose client disconnects while it decodes ends as cancelled; the
    answer no one reads is still built without an error (the long fuzz campaign found /v1/messages
    raising KeyError on finish_reason "cancelled")."""
    import socket
    import time
    import urllib.request

    def stats():
        req = urllib.request.Request(server.url + "/props", headers={"Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            return json.loads(r.read())["stats"]

    ask = "Write a long story about a parser."
    body = {
        "/v1/messages": {"max_tokens": 1024, "messages": [{"role": "user", "content": ask}]},
        "/v1/responses": {"max_output_tokens": 1024, "input": ask},
        "/v1/chat/completions": {"max_tokens": 1024, "messages": [{"role": "user", "content": ask}]},
    }[path]
    data = json.dumps({"model": "m", "stream": False, **body}).encode()
    before = stats()
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    time.sleep(1.0)  # it is decoding
    s.close()
    deadline = time.monotonic() + 60
    while stats()["cancelled"] == before["cancelled"] and time.monotonic() < deadline:
        time.sleep(0.2)
    after = stats()
    assert after["cancelled"] > before["cancelled"], after
    assert after["server_errors"] == before["server_errors"], after
    assert "Traceback" not in server.log_tail(200_000)
