"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API), as llama-server
serves them: the body into a ChatRequest, the reply into a message of content blocks (thinking,
text, tool_use) or Anthropic's event stream. Authentication by `x-api-key` or Bearer; the
`anthropic-version` and `anthropic-beta` headers and `?beta=true` are accepted as they come.

Mapping: `system` is a system message; a user message's `tool_result` blocks are tool messages
(before the message's text); an assistant's `thinking` blocks are its reasoning, `tool_use`
blocks its calls. tool_choice any / tool are OpenAI's required / named function (the same
constrained decoding), none / auto the same, `disable_parallel_tool_use` is one call at most.
`thinking` enabled (or adaptive) turns Clover's thinking on; absent or disabled, off.
stop_reason: end_turn (an end token), stop_sequence, max_tokens, tool_use.
"""

from __future__ import annotations

import hashlib
import json
import secrets

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from .. import fields
from ..chat import ChatRequest, ChatRun, ContextOverflow
from ..decoding import Decoding, parse_clover, parse_stop, read_common
from ..http import BadRequest, error_type, opt_bool
from ..tools import FieldError, check_tools

# the internal fields' names in this API, for the errors that name them
NAMES = {"schema": "output_format", "tools": "tools", "tool_choice": "tool_choice", "max_tokens": "max_tokens"}
STOP_REASON = {
    "stop": "end_turn",
    "stop_word": "stop_sequence",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "error": "error",  # the constraint dead-ended; the body's `error` says so
    "cancelled": "end_turn",  # its client has left: no one reads the answer
}
ERROR_TYPE = {
    "invalid_request_error": "invalid_request_error",
    "server_error": "api_error",
    "server_busy": "overloaded_error",
}


def error_response(e: BadRequest, headers: dict | None = None) -> JSONResponse:
    """An error in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    t = error_type(e.status)
    body = {"type": "error", "error": {"type": ERROR_TYPE.get(t, t), "message": e.message}}
    h = {"request-id": "req_" + secrets.token_hex(12), **(headers or {})}
    if e.status == 503:
        h["Retry-After"] = "5"
    return JSONResponse(body, status_code=e.status, headers=h)


# ----------------------------------------------------------------------------- request


def _blocks(content, p: str, ignored: list[str]) -> list[dict]:
    """A message's content as blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise BadRequest(f"'{p}' must be a string or a list of content blocks", p)
    for j, b in enumerate(content):
        q = f"{p}[{j}]"
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise BadRequest(f"'{q}' must be a content block with a 'type'", q)
        ignored += ["messages[].content[]." + k.split(".")[-1] for k in fields.check_fields(b, fields.ANTHROPIC_BLOCK)]
    return content


def _text_of(b: dict, q: str) -> str:
    if not isinstance(b.get("text"), str):
        raise BadRequest(f"'{q}.text' must be a string", f"{q}.text")
    return b["text"]


def _tool_result(b: dict, q: str) -> dict:
    tid = b.get("tool_use_id")
    if not isinstance(tid, str):
        raise BadRequest(f"'{q}.tool_use_id' must be a string", f"{q}.tool_use_id")
    c = b.get("content")
    if c is None:
        text = ""
    elif isinstance(c, str):
        text = c
    elif isinstance(c, list):
        parts = []
        for k, x in enumerate(c):
            if not isinstance(x, dict) or x.get("type") != "text":
                t = x.get("type") if isinstance(x, dict) else None
                raise BadRequest(
                    f"'{q}.content[{k}]' is a {t!r} block: this server reads text only", f"{q}.content[{k}]"
                )
            parts.append(_text_of(x, f"{q}.content[{k}]"))
        text = "\n".join(parts)
    else:
        raise BadRequest(f"'{q}.content' must be a string or text blocks", f"{q}.content")
    is_error = opt_bool(b, "is_error", f"{q}.is_error")
    if is_error:  # the template has no error flag: say it in the text
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": tid, "content": text}


def parse_messages(body: dict, ignored: list[str]) -> list[dict]:
    """`system` and `messages` into the template's messages."""
    out = []
    system = body.get("system")
    if system is not None:
        if isinstance(system, list):
            system = "\n\n".join(_system_text(_blocks(system, "system", ignored), "system"))
        elif not isinstance(system, str):
            raise BadRequest("'system' must be a string or a list of text blocks", "system")
        out.append({"role": "system", "content": system})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list of messages", "messages")
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"'{p}' must be an object", p)
        ignored += ["messages[]." + k.split(".")[-1] for k in fields.check_fields(m, fields.ANTHROPIC_MESSAGE)]
        role = m.get("role")
        if role not in ("user", "assistant", "system"):
            raise BadRequest(f"'{p}.role' must be user, assistant or system, got {json.dumps(role)}", f"{p}.role")
        blocks = _blocks(m.get("content"), f"{p}.content", ignored)
        if role == "system":  # a system message inside the conversation (Claude Code's beta)
            out.append({"role": "system", "content": "\n\n".join(_system_text(blocks, f"{p}.content"))})
        else:
            out += _user(blocks, p) if role == "user" else [_assistant(blocks, p)]
    if msgs[-1].get("role") == "assistant":
        raise BadRequest(
            "the last message is the assistant's: this server does not continue a prefilled reply", "messages"
        )
    return out


def _system_text(blocks: list[dict], p: str) -> list[str]:
    parts = []
    for j, b in enumerate(blocks):
        if b["type"] != "text":
            raise BadRequest(f"'{p}[{j}]' must be a text block", f"{p}[{j}]")
        parts.append(_text_of(b, f"{p}[{j}]"))
    return parts


def _user(blocks: list[dict], p: str) -> list[dict]:
    """Tool results first (the template renders them in one user turn), then the text."""
    tools, text = [], []
    for j, b in enumerate(blocks):
        q = f"{p}.content[{j}]"
        if b["type"] == "tool_result":
            tools.append(_tool_result(b, q))
        elif b["type"] == "text":
            text.append(_text_of(b, q))
        else:
            raise BadRequest(f"'{q}' is a {b['type']!r} block: this server reads text and tool results", q)
    return tools + ([{"role": "user", "content": "\n\n".join(text)}] if text or not tools else [])


def _assistant(blocks: list[dict], p: str) -> dict:
    text, reasoning, calls = [], [], []
    for j, b in enumerate(blocks):
        q = f"{p}.content[{j}]"
        t = b["type"]
        if t == "text":
            text.append(_text_of(b, q))
        elif t == "thinking":
            if not isinstance(b.get("thinking"), str):
                raise BadRequest(f"'{q}.thinking' must be a string", f"{q}.thinking")
            reasoning.append(b["thinking"])
        elif t == "redacted_thinking":
            continue
        elif t == "tool_use":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise BadRequest(f"'{q}' must have a string 'id' and 'name'", q)
            if not isinstance(b.get("input"), dict):
                raise BadRequest(f"'{q}.input' must be an object", f"{q}.input")
            args = json.dumps(b["input"], ensure_ascii=False)
            calls.append({"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": args}})
        else:
            raise BadRequest(f"'{q}' is a {t!r} block: an assistant message holds text, thinking and tool_use", q)
    msg: dict = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        msg["reasoning_content"] = "\n".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


def parse_tools(body: dict, ignored: list[str]) -> tuple[list[dict] | None, list[str]]:
    """Custom tools as OpenAI function tools; the names of server tools (web_search_*, bash_*,
    ...), which are left out: this server runs no tool of its own."""
    tools = body.get("tools")
    if tools is None:
        return None, []
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list of tools", "tools")
    fns, left_out = [], []
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise BadRequest(f"'{p}' must be an object", p)
        if t.get("type") not in (None, "custom"):
            left_out.append(f"{t.get('type')}:{t.get('name')}")
            continue
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise BadRequest(f"'{p}.input_schema' must be a JSON schema object", f"{p}.input_schema")
        fn = {"name": t.get("name"), "parameters": schema}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        fns.append((i, {"type": "function", "function": fn}))
        ignored += [
            "tools[]." + k
            for k in t
            if k not in ("type", "name", "description", "input_schema", "cache_control", "strict")
        ]
    try:  # a custom tool's index among all the tools, the server tools left out included
        return check_tools([f for _, f in fns], "tools", lambda j: f"tools[{fns[j][0]}]"), left_out
    except FieldError as e:  # the OpenAI shape's path (tools[i].function.name) in Anthropic's words
        raise BadRequest(
            str(e).replace(".function.parameters", ".input_schema").replace(".function", ""), "tools"
        ) from None


def tool_choice(body: dict, tools: list[dict] | None) -> tuple[str | dict | None, bool]:
    """(OpenAI tool_choice, parallel calls allowed)."""
    tc = body.get("tool_choice")
    if tc is None:
        return None, True
    if not isinstance(tc, dict) or tc.get("type") not in ("auto", "any", "tool", "none"):
        raise BadRequest("'tool_choice.type' must be auto, any, tool or none", "tool_choice")
    parallel = not opt_bool(tc, "disable_parallel_tool_use", "tool_choice.disable_parallel_tool_use")
    t = tc["type"]
    if t == "tool":
        name = tc.get("name")
        if not isinstance(name, str) or name not in [x["function"]["name"] for x in tools or []]:
            raise BadRequest(
                f"'tool_choice.name' must name one of the tools, got {json.dumps(name)[:60]}", "tool_choice"
            )
        return {"type": "function", "function": {"name": name}}, parallel
    if t == "any" and not tools:
        raise BadRequest("'tool_choice' is any but the request has no tools", "tool_choice")
    return {"any": "required"}.get(t, t), parallel


def thinking_of(body: dict) -> bool:
    th = body.get("thinking")
    if th is None:
        return False
    if not isinstance(th, dict) or th.get("type") not in ("enabled", "disabled", "adaptive"):
        raise BadRequest("'thinking.type' must be enabled, adaptive or disabled", "thinking")
    return th["type"] != "disabled"


def output_schema(body: dict) -> dict | None:
    """The JSON schema of `output_config.format` (or the older `output_format`); the config's
    `effort` is accepted with no effect (thinking is `thinking`'s)."""
    oc = body.get("output_config")
    if oc is not None and not isinstance(oc, dict):
        raise BadRequest("'output_config' must be an object", "output_config")
    param, of = "output_config.format", (oc or {}).get("format")
    if of is None:
        param, of = "output_format", body.get("output_format")
    if of is None:
        return None
    if not isinstance(of, dict) or of.get("type") != "json_schema" or not isinstance(of.get("schema"), dict):
        raise BadRequest(f"'{param}' must be a json_schema format with a 'schema' object", param)
    return of["schema"]


def chat_request(srv, body: dict, ignored: list[str], left_out: list[str], count_only: bool = False) -> ChatRequest:
    tools, out = parse_tools(body, ignored)
    left_out += out
    choice, parallel = tool_choice(body, tools)
    d = Decoding()
    if not count_only:
        if body.get("max_tokens") is None:
            raise BadRequest("'max_tokens' is required", "max_tokens")
        read_common(body, d, srv.limits, {"seed": None, "presence_penalty": None, "frequency_penalty": None})
        d.stop = parse_stop(body.get("stop_sequences"), "stop_sequences")
        d.stream = opt_bool(body, "stream") or False
        parse_clover(body.get("clover"), d, srv.limits)
    return ChatRequest(
        messages=parse_messages(body, ignored),
        decoding=d,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        schema=output_schema(body),
        thinking=thinking_of(body),
        names=NAMES,
    )


def _headers(srv, ignored: list[str], left_out: list[str]) -> dict:
    return srv.headers("/v1/messages", ignored, left_out, "server tools")


def _overflow(e: ContextOverflow) -> BadRequest:
    return BadRequest(f"prompt is too long: {e.n_prompt} tokens > {e.limit} maximum", "messages")


# ----------------------------------------------------------------------------- routes


async def count_tokens(srv, request: Request):
    body, ignored = await srv.read(request, fields.ANTHROPIC_COUNT)
    left_out: list[str] = []
    req = chat_request(srv, body, ignored, left_out, count_only=True)
    try:
        cp = await ChatRun(srv, request, req).render()
    except ContextOverflow as e:  # still counted: the client asks how long it is
        return srv.json({"input_tokens": e.n_prompt}, _headers(srv, ignored, left_out))
    return srv.json({"input_tokens": len(cp.ids)}, _headers(srv, ignored, left_out))


async def messages(srv, request: Request):
    body, ignored = await srv.read(request, fields.ANTHROPIC)
    left_out: list[str] = []
    req = chat_request(srv, body, ignored, left_out)
    headers = _headers(srv, ignored, left_out)
    run = ChatRun(srv, request, req)
    try:
        await run.start()
    except ContextOverflow as e:
        raise _overflow(e) from None
    mid = "msg_" + secrets.token_hex(12)
    headers["request-id"] = "req_" + secrets.token_hex(12)
    if req.decoding.stream:
        return StreamingResponse(
            _sse(srv, run, mid),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
        )
    r = await run.result()
    content = []
    if r.reasoning is not None:
        content.append({"type": "thinking", "thinking": r.reasoning, "signature": _signature(r.reasoning)})
    if r.content:
        content.append({"type": "text", "text": r.content})
    content += [_tool_use(c) for c in r.calls]
    out = _message(srv, mid, content) | {
        "stop_reason": STOP_REASON[r.finish_reason],
        "stop_sequence": r.stop_word,
        "usage": usage(r.usage),
    }
    if r.error:
        out["error"] = {"type": "constraint_failed", "message": r.error}
    return srv.json(out, headers)


def _message(srv, mid: str, content: list) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": srv.config.model_id, "content": content}


def _signature(thinking: str) -> str:
    """A thinking block's signature: its digest (nothing is encrypted here; clients send it back)."""
    return hashlib.sha256(thinking.encode()).hexdigest()


def _tool_use(call: dict) -> dict:
    fn = call["function"]
    return {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": json.loads(fn["arguments"])}


def usage(u: dict, output_tokens: int | None = None) -> dict:
    """Anthropic's usage: input_tokens are the prompt tokens not read from the state cache."""
    cached = u["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": u["prompt_tokens"] - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": u["completion_tokens"] if output_tokens is None else output_tokens,
        "clover": u["clover"],
    }


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


class _Blocks:
    """The content blocks of one streamed message: the open block's index and kind, and the
    thinking text its signature covers."""

    def __init__(self):
        self.index, self.kind, self.thinking = -1, None, []

    def start(self, block: dict) -> str:
        self.index += 1
        self.kind = block["type"]
        return _event("content_block_start", {"index": self.index, "content_block": block})

    def stop(self) -> str:
        out = ""
        if self.kind == "thinking":
            sig = {"type": "signature_delta", "signature": _signature("".join(self.thinking))}
            out = _event("content_block_delta", {"index": self.index, "delta": sig})
        self.kind = None
        return out + _event("content_block_stop", {"index": self.index})

    def switch(self, block: dict) -> list[str]:
        """Open a block of another kind, closing the open one first."""
        if self.kind == block["type"]:
            return []
        return ([self.stop()] if self.kind is not None else []) + [self.start(block)]

    def delta(self, delta: dict) -> str:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def decoded(self, ev: dict) -> list[str]:
        out = []
        if ev["reasoning"]:
            out += self.switch({"type": "thinking", "thinking": "", "signature": ""})
            self.thinking.append(ev["reasoning"])
            out.append(self.delta({"type": "thinking_delta", "thinking": ev["reasoning"]}))
        if ev["content"]:
            out += self.switch({"type": "text", "text": ""})
            out.append(self.delta({"type": "text_delta", "text": ev["content"]}))
        for c in ev["calls"]:
            fn = c["function"]
            out += [self.stop()] if self.kind is not None else []
            out.append(self.start({"type": "tool_use", "id": c["id"], "name": fn["name"], "input": {}}))
            out += [self.delta({"type": "input_json_delta", "partial_json": fn["arguments"]}), self.stop()]
        return out

    def end(self, ev: dict) -> list[str]:
        out = [self.stop()] if self.kind is not None else []
        delta = {"stop_reason": STOP_REASON[ev["finish_reason"]], "stop_sequence": ev["stop_word"]}
        md = {"delta": delta, "usage": usage(ev["usage"])}
        if ev.get("error"):
            md["error"] = {"type": "constraint_failed", "message": ev["error"]}
        return out + [_event("message_delta", md), _event("message_stop", {})]


async def _sse(srv, run: ChatRun, mid: str):
    """message_start (when the first block is decoded: the prompt's cached tokens are known),
    ping, then per content block content_block_start, its deltas (thinking_delta and a
    signature_delta, text_delta, one input_json_delta per call) and content_block_stop, then
    message_delta (stop_reason, usage) and message_stop."""
    blocks, started = _Blocks(), False
    async for ev in run.events():
        out = []
        if not started and ev["type"] != "error":
            started = True
            b = ev.get("block") or {}
            reused = (
                b.get("reused", 0) if ev["type"] == "delta" else ev["usage"]["prompt_tokens_details"]["cached_tokens"]
            )
            u = {"input_tokens": run.n_prompt - reused, "cache_creation_input_tokens": 0}
            u |= {"cache_read_input_tokens": reused, "output_tokens": 0}
            msg = _message(srv, mid, []) | {"stop_reason": None, "stop_sequence": None, "usage": u}
            out += [_event("message_start", {"message": msg}), _event("ping", {})]
        if ev["type"] == "error":
            out.append(_event("error", {"error": {"type": "api_error", "message": ev["message"]}}))
            yield "".join(out)
            return
        out += blocks.decoded(ev) if ev["type"] == "delta" else blocks.end(ev)
        if out:
            yield "".join(out)
