"""POST /v1/chat/completions (OpenAI's Chat Completions API): the body into a ChatRequest, the
reply into a chat.completion or its chunks (SSE, one event per committed block)."""

from __future__ import annotations

import json
import secrets
import time

from fastapi import Request
from fastapi.responses import StreamingResponse

from .. import fields
from .. import logprobs as lp
from ..chat import ChatRequest, ChatRun
from ..decoding import Decoding, parse_clover, parse_logit_bias, parse_stop, read_common
from ..http import BadRequest, error_body, opt_bool
from ..tools import parse_tool_calls, parse_tools, response_format_schema

ROLES = ("system", "developer", "user", "assistant", "tool")
NAMES = {"schema": "response_format"}


def parse_messages(msgs, ignored: list[str]) -> list[dict]:
    """OpenAI chat messages into the template's messages (developer is system; text parts
    joined); keys no table knows are added to `ignored`."""
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"'{p}' must be an object", p)
        for k in fields.check_fields(m, fields.MESSAGE, f"{p}."):
            ignored.append("messages[]." + k.split(".", 1)[1])
        for k in ("name", "reasoning_content", "tool_call_id"):
            if m.get(k) is not None and not isinstance(m[k], str):
                raise BadRequest(f"'{p}.{k}' must be a string", f"{p}.{k}")
        role = m.get("role")
        if role not in ROLES:
            raise BadRequest(f"'{p}.role' must be one of {', '.join(ROLES)}, got {json.dumps(role)}", f"{p}.role")
        msg = {"role": "system" if role == "developer" else role, "content": _text(m.get("content"), p)}
        for k, only in (("reasoning_content", "assistant"), ("tool_calls", "assistant"), ("tool_call_id", "tool")):
            if m.get(k) is not None and role != only:
                raise BadRequest(f"'{p}.{k}' belongs to a message of role {only}", f"{p}.{k}")
        if m.get("reasoning_content") is not None:
            msg["reasoning_content"] = m["reasoning_content"]
        if m.get("tool_calls"):
            msg["tool_calls"] = parse_tool_calls(m["tool_calls"], f"{p}.tool_calls")
        if m.get("tool_call_id") is not None:
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def _text(c, p: str) -> str:
    if isinstance(c, list):
        parts = []
        for j, part in enumerate(c):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"'{p}.content[{j}]' must be a text part", f"{p}.content[{j}]")
            parts.append(part["text"])
        return "".join(parts)
    if c is None:
        return ""
    if not isinstance(c, str):
        raise BadRequest(f"'{p}.content' must be a string or a list of text parts", f"{p}.content")
    return c


def thinking_of(body: dict, kw: dict) -> bool | None:
    """chat_template_kwargs.enable_thinking (it wins), else reasoning_effort (none and minimal
    off, the others on), else the server's default (None)."""
    on = opt_bool(kw, "enable_thinking", "chat_template_kwargs.enable_thinking")
    if on is not None:
        return on
    effort = body.get("reasoning_effort")
    if effort is None:
        return None
    if effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
        raise BadRequest(
            f"'reasoning_effort' must be none, minimal, low, medium, high or xhigh, got {json.dumps(effort)[:40]}",
            "reasoning_effort",
        )
    return effort not in ("none", "minimal")


def decoding(srv, body: dict, chat: bool, ignored: list[str] | None = None) -> Decoding:
    """The decoding fields of a chat or completions body (unknown stream_options keys are added
    to `ignored`)."""
    lim = srv.limits
    d = Decoding()
    read_common(body, d, lim)
    if chat and body.get("max_completion_tokens") is not None:
        d.max_tokens = fields.number(body, "max_completion_tokens", lim.numbers())
    d.stop = parse_stop(body.get("stop"))
    d.logit_bias = parse_logit_bias(body.get("logit_bias"), lim.n_vocab)
    d.stream = opt_bool(body, "stream") or False
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    unknown = fields.check_fields(so or {}, fields.STREAM_OPTIONS, "stream_options.")
    if ignored is not None:
        ignored += unknown
    d.include_usage = bool(opt_bool(so or {}, "include_usage", "stream_options.include_usage"))
    if chat:
        on = opt_bool(body, "logprobs")
        top = fields.number(body, "top_logprobs", lim.numbers())
        if top is not None and not on:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        d.logprobs = (top or 0) if on else None
    else:
        d.logprobs = fields.number(body, "logprobs", lim.numbers())
    parse_clover(body.get("clover"), d, lim)
    return d


def chat_request(srv, body: dict, ignored: list[str]) -> ChatRequest:
    kw = body.get("chat_template_kwargs") or {}
    if not isinstance(kw, dict):
        raise BadRequest("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    tools, choice, parallel = parse_tools(body)
    return ChatRequest(
        messages=parse_messages(body.get("messages"), ignored),
        decoding=decoding(srv, body, chat=True, ignored=ignored),
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        schema=response_format_schema(body.get("response_format")),
        grammar=body.get("grammar"),
        thinking=thinking_of(body, kw),
        template_kwargs=kw,
        names=NAMES,
    )


async def chat_completions(srv, request: Request):
    body, ignored = await srv.read(request, fields.CHAT)
    req = chat_request(srv, body, ignored)
    headers = srv.ignore(ignored)
    run = ChatRun(srv, request, req)
    await run.start()
    rid, created = "chatcmpl-" + secrets.token_hex(12), int(time.time())
    if req.decoding.stream:
        return StreamingResponse(
            _sse(srv, run, rid, created),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
        )
    r = await run.result()
    msg = {"role": "assistant", "content": r.content if r.content or not r.calls else None}
    if r.reasoning is not None:
        msg["reasoning_content"] = r.reasoning
    if r.calls:
        msg["tool_calls"] = r.calls
    choice = {"index": 0, "message": msg, "finish_reason": _finish(r.finish_reason), "logprobs": None}
    if run.s.logprobs is not None:
        n = lp.returned(srv.pieces, r.tokens, r.text)
        choice["logprobs"] = {
            "content": lp.chat_content(srv.pieces, r.tokens[:n], r.probs[:n], r.top[:n], run.s.logprobs)
        }
    out = {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": srv.config.model_id,
        "choices": [choice],
        "usage": r.usage,
    }
    if r.error:  # finish_reason error: the constraint dead-ended (docs/serving.md)
        out["error"] = constraint_error(r.error)
    return srv.json(out, headers)


def constraint_error(message: str) -> dict:
    return {"message": message, "type": "constraint_failed", "param": None, "code": "constraint_dead_end"}


def _finish(reason: str) -> str:
    return "stop" if reason == "stop_word" else reason


async def _sse(srv, run: ChatRun, rid: str, created: int):
    """One `data:` event per block (its delta may be empty while text is held back), then one
    with the finish_reason, then (stream_options.include_usage) OpenAI's usage-only event, then
    `[DONE]`: usage is sent once. With logprobs, each block's event carries its tokens'."""
    s, model = run.s, srv.config.model_id
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    first = True

    def chunk(delta: dict, finish=None, logprobs=None) -> str:
        nonlocal first
        if first:
            delta, first = {"role": "assistant", **delta}, False
        c = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        return f"data: {json.dumps({**head, 'choices': [c]})}\n\n"

    async for ev in run.events():
        if ev["type"] == "error":
            yield f"data: {json.dumps(error_body(ev['message'], etype='server_error'))}\n\n"
            return
        if ev["type"] == "delta":
            delta = {}
            if ev["reasoning"]:
                delta["reasoning_content"] = ev["reasoning"]
            if ev["content"] or not (ev["reasoning"] or ev["calls"]):
                delta["content"] = ev["content"]
            if ev["calls"]:
                delta["tool_calls"] = [
                    {"index": c["index"], **{k: c[k] for k in ("id", "type", "function")}} for c in ev["calls"]
                ]
            logprobs = None
            b = ev["block"]
            if s.logprobs is not None and b["type"] == "block" and "tokens" in b:
                logprobs = {"content": lp.chat_content(srv.pieces, b["tokens"], b["probs"], b["top"], s.logprobs)}
            yield chunk(delta, logprobs=logprobs)
        else:
            last = chunk({"content": ""}, _finish(ev["finish_reason"]))
            if ev.get("error"):  # the constraint dead-ended: said on the last chunk
                d = json.loads(last[len("data: ") :])
                last = f"data: {json.dumps(d | {'error': constraint_error(ev['error'])})}\n\n"
            yield last
            if s.include_usage:
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': ev['usage']})}\n\n"
            yield "data: [DONE]\n\n"
            return
