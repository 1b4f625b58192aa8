"""POST /v1/responses and GET /v1/responses/{id} (OpenAI's Responses API), stateless as
Ollama's and llama-server's, plus `previous_response_id` served from the server's memory of its
recent responses (Memory: bounded; an evicted or unknown id is a 400 naming it).

Mapping: `instructions` is a system message; `input` items become the template's messages
(message items by role, developer as system; consecutive reasoning, assistant message and
function_call items one assistant message; function_call_output items tool messages). Function
tools are OpenAI's; other tool types (web_search, custom, namespace, local_shell, ...) are left
out of the prompt and named in the log and the `x-clover-left-out-tools` header. `text.format`
json_schema / json_object constrains the text; `reasoning.effort` none or minimal turns
thinking off, any other on (absent: on). The output is a reasoning item (when the model
thought), a message item (when it wrote text) and a function_call item per call.
"""

from __future__ import annotations

import base64
import json
import secrets
import threading
import time
from collections import OrderedDict

from fastapi import Request
from fastapi.responses import StreamingResponse

from .. import fields
from ..chat import ChatRequest, ChatRun
from ..decoding import Decoding, parse_clover, read_common
from ..http import BadRequest, opt_bool, opt_str
from ..tools import JSON_OBJECT_SCHEMA, FieldError, check_choice, check_tools

NAMES = {"schema": "text.format", "max_tokens": "max_output_tokens", "messages": "input"}
MEMORY = 256  # responses kept for previous_response_id
ENCRYPTED = "reasoning.encrypted_content"


class Memory:
    """The server's recent responses: id -> (the conversation as the template's messages,
    including this response's output, and the response object), LRU, bounded."""

    def __init__(self, capacity: int = MEMORY):
        self.capacity = capacity
        self._d: OrderedDict[str, tuple[list[dict], dict]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, messages: list[dict], response: dict) -> None:
        with self._lock:
            self._d[rid] = (messages, response)
            self._d.move_to_end(rid)
            while len(self._d) > self.capacity:
                self._d.popitem(last=False)

    def get(self, rid: str) -> tuple[list[dict], dict] | None:
        with self._lock:
            got = self._d.get(rid)
            if got is not None:
                self._d.move_to_end(rid)
            return got


def _memory(srv) -> Memory:
    if not hasattr(srv, "responses"):
        srv.responses = Memory()
    return srv.responses


# ----------------------------------------------------------------------------- request


def _content_text(c, p: str, kinds: tuple[str, ...]) -> str:
    if isinstance(c, str):
        return c
    if not isinstance(c, list):
        raise BadRequest(f"'{p}' must be a string or a list of content parts", p)
    parts = []
    for j, part in enumerate(c):
        q = f"{p}[{j}]"
        t = part.get("type") if isinstance(part, dict) else None
        if t not in kinds or not isinstance(part.get("text"), str):
            raise BadRequest(f"'{q}' is a {t!r} part: this server reads {', '.join(kinds)} parts", q)
        parts.append(part["text"])
    return "".join(parts)


def _reasoning_text(item: dict, p: str) -> str:
    """A reasoning item's text: its content (reasoning_text), else its encrypted_content (this
    server's own encoding), else its summary."""
    for part in item.get("content") or []:
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            return part["text"]
    enc = item.get("encrypted_content")
    if isinstance(enc, str):
        try:
            return json.loads(base64.b64decode(enc, validate=True))["reasoning"]
        except (ValueError, KeyError, TypeError):
            pass  # another server's: not readable here
    return "\n".join(
        s["text"] for s in item.get("summary") or [] if isinstance(s, dict) and isinstance(s.get("text"), str)
    )


def parse_input(body: dict) -> list[dict]:
    """`input` as the template's messages."""
    out = []
    items = body.get("input")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("'input' must be a string or a non-empty list of items", "input")
    turn: dict | None = None  # the assistant message being gathered
    for i, it in enumerate(items):
        p = f"input[{i}]"
        if not isinstance(it, dict):
            raise BadRequest(f"'{p}' must be an object", p)
        t = it.get("type", "message" if "role" in it else None)
        if t == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise BadRequest(f"'{p}.role' must be user, system, developer or assistant", f"{p}.role")
            if role == "assistant":
                text = _content_text(it.get("content"), f"{p}.content", ("output_text", "input_text", "text"))
                turn = turn or {"role": "assistant", "content": ""}
                turn["content"] += text
                continue
            text = _content_text(it.get("content"), f"{p}.content", ("input_text", "text", "output_text"))
            turn = _flush(out, turn)
            out.append({"role": "system" if role == "developer" else role, "content": text})
        elif t == "reasoning":
            turn = turn or {"role": "assistant", "content": ""}
            r = _reasoning_text(it, p)
            if r:
                turn["reasoning_content"] = (turn.get("reasoning_content", "") + "\n" + r).lstrip("\n")
        elif t == "function_call":
            for k in ("call_id", "name", "arguments"):
                if not isinstance(it.get(k), str):
                    raise BadRequest(f"'{p}.{k}' must be a string", f"{p}.{k}")
            turn = turn or {"role": "assistant", "content": ""}
            call = {
                "id": it["call_id"],
                "type": "function",
                "function": {"name": it["name"], "arguments": it["arguments"]},
            }
            turn.setdefault("tool_calls", []).append(call)
        elif t == "function_call_output":
            if not isinstance(it.get("call_id"), str):
                raise BadRequest(f"'{p}.call_id' must be a string", f"{p}.call_id")
            turn = _flush(out, turn)
            text = _content_text(it.get("output"), f"{p}.output", ("input_text", "output_text", "text"))
            out.append({"role": "tool", "tool_call_id": it["call_id"], "content": text})
        else:
            raise BadRequest(
                f"'{p}' is a {t!r} item: this server reads message, function_call, function_call_output and "
                "reasoning items",
                p,
            )
    _flush(out, turn)
    return out


def _flush(out: list[dict], turn: dict | None) -> None:
    if turn is not None:
        out.append(turn)
    return None


def parse_tools(body: dict) -> tuple[list[dict] | None, list[str]]:
    """Function tools in OpenAI chat's form, and the other tools' names (left out)."""
    tools = body.get("tools")
    if tools is None:
        return None, []
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list of tools", "tools")
    fns, left_out = [], []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            t = t if isinstance(t, dict) else {}
            left_out.append(str(t.get("type")) + (f":{t['name']}" if isinstance(t.get("name"), str) else ""))
            continue
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        fns.append((i, {"type": "function", "function": fn}))
    try:
        checked = check_tools([f for _, f in fns], "tools", lambda j: f"tools[{fns[j][0]}]")
    except FieldError as e:
        raise BadRequest(str(e).replace(".function", ""), "tools") from None
    return checked, left_out


def tool_choice(body: dict, tools: list[dict] | None):
    tc = body.get("tool_choice")
    if isinstance(tc, dict) and tc.get("type") == "function":
        tc = {"type": "function", "function": {"name": tc.get("name")}}
    try:
        return check_choice(tc, tools)
    except FieldError as e:
        raise BadRequest(str(e), "tool_choice") from None


def text_schema(body: dict) -> dict | None:
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise BadRequest("'text' must be an object", "text")
    # text.verbosity: accepted with no effect (the model has no verbosity control; Codex sends it)
    fmt = text.get("format")
    if fmt is None:
        return None
    t = fmt.get("type") if isinstance(fmt, dict) else None
    if t == "text":
        return None
    if t == "json_object":
        return JSON_OBJECT_SCHEMA
    if t == "json_schema" and isinstance(fmt.get("schema"), dict):
        return fmt["schema"]
    raise BadRequest("'text.format' must be text, json_object or json_schema with a 'schema' object", "text.format")


def thinking_of(body: dict) -> bool | None:
    r = body.get("reasoning")
    if r is None:
        return None
    if not isinstance(r, dict):
        raise BadRequest("'reasoning' must be an object", "reasoning")
    effort = r.get("effort")
    if effort is None:
        return None
    if effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
        raise BadRequest("'reasoning.effort' must be none, minimal, low, medium, high or xhigh", "reasoning.effort")
    return effort not in ("none", "minimal")


def chat_request(srv, body: dict, left_out: list[str], ignored: list[str]) -> tuple[ChatRequest, list[dict]]:
    """The ChatRequest, and the conversation a later response may continue (the previous
    response's, then this input; `instructions` are not carried over, as OpenAI's are not)."""
    tools, out = parse_tools(body)
    left_out += out
    d = Decoding()
    read_common(
        body, d, srv.limits, {"max_tokens": "max_output_tokens", "presence_penalty": None, "frequency_penalty": None}
    )
    d.stream = opt_bool(body, "stream") or False
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    ignored += fields.check_fields(so or {}, fields.STREAM_OPTIONS, "stream_options.")
    parse_clover(body.get("clover"), d, srv.limits)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    conv = parse_input(body)
    prev = opt_str(body, "previous_response_id")
    if prev is not None:
        got = _memory(srv).get(prev)
        if got is None:
            raise BadRequest(
                f"previous response '{prev[:80]}' is not known to this server: it keeps its last {MEMORY} stored "
                "responses (store: true) while it runs; send the whole conversation as input instead",
                "previous_response_id",
                "previous_response_not_found",
            )
        conv = got[0] + conv
    inst = opt_str(body, "instructions")
    messages = ([{"role": "system", "content": inst}] if inst else []) + conv
    return ChatRequest(
        messages=messages,
        decoding=d,
        tools=tools,
        tool_choice=tool_choice(body, tools),
        parallel_tool_calls=parallel is not False,
        schema=text_schema(body),
        thinking=thinking_of(body),
        names=NAMES,
    ), conv


# ----------------------------------------------------------------------------- output


def _headers(srv, ignored: list[str], left_out: list[str]) -> dict:
    return srv.headers("/v1/responses", ignored, left_out, "not functions")


class Output:
    """The output items of one response, with their ids, as they are built (streamed or not)."""

    def __init__(self, encrypted: bool):
        self.items: list[dict] = []
        self.encrypted = encrypted

    def reasoning(self, text: str) -> dict:
        it = {"type": "reasoning", "id": "rs_" + secrets.token_hex(12), "summary": []}
        it["content"] = [{"type": "reasoning_text", "text": text}]
        if self.encrypted:
            it["encrypted_content"] = base64.b64encode(json.dumps({"reasoning": text}).encode()).decode()
        return it

    @staticmethod
    def message(text: str, status: str = "completed") -> dict:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {
            "type": "message",
            "id": "msg_" + secrets.token_hex(12),
            "status": status,
            "role": "assistant",
            "content": [part],
        }

    @staticmethod
    def call(c: dict, status: str = "completed") -> dict:
        fn = c["function"]
        return {
            "type": "function_call",
            "id": "fc_" + secrets.token_hex(12),
            "call_id": c["id"],
            "name": fn["name"],
            "arguments": fn["arguments"],
            "status": status,
        }


def usage(u: dict, reasoning_tokens: int = 0) -> dict:
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": u["total_tokens"],
        "clover": u["clover"],
    }


def _response(srv, rid: str, created: int, body: dict, req: ChatRequest, status: str, output: list, u=None) -> dict:
    """The response object (status in_progress, completed or incomplete)."""
    text_fmt = body.get("text") if isinstance(body.get("text"), dict) else {"format": {"type": "text"}}
    r = {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": srv.config.model_id,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": body.get("reasoning")
        if isinstance(body.get("reasoning"), dict)
        else {"effort": None, "summary": None},
        "store": body.get("store") is not False,
        "temperature": body.get("temperature"),
        "text": text_fmt,
        "tool_choice": body.get("tool_choice") or ("auto" if req.tools else "none"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "truncation": body.get("truncation") or "disabled",
        "usage": u,
        "metadata": body.get("metadata") or {},
    }
    return r


def _remember(srv, rid: str, body: dict, conv: list[dict], msg: dict, response: dict) -> None:
    if body.get("store") is not False:
        _memory(srv).put(rid, conv + [msg], response)


# ----------------------------------------------------------------------------- routes


async def create(srv, request: Request):
    body, ignored = await srv.read(request, fields.RESPONSES)
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise BadRequest("'include' must be a list of strings", "include")
    left_out: list[str] = []
    req, conv = chat_request(srv, body, left_out, ignored)
    headers = _headers(srv, ignored, left_out)
    run = ChatRun(srv, request, req)
    await run.start()
    rid, created = "resp_" + secrets.token_hex(12), int(time.time())
    out = Output(ENCRYPTED in include)
    if req.decoding.stream:
        return StreamingResponse(
            _sse(srv, run, rid, created, body, req, conv, out),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
        )
    r = await run.result()
    items = []
    if r.reasoning is not None:
        items.append(out.reasoning(r.reasoning))
    if r.content or not r.calls:
        items.append(out.message(r.content, "incomplete" if r.finish_reason == "length" else "completed"))
    items += [out.call(c) for c in r.calls]
    status = {"length": "incomplete", "error": "failed"}.get(r.finish_reason, "completed")
    resp = _response(srv, rid, created, body, req, status, items, usage(r.usage))
    if r.error:
        resp["error"] = {"code": "constraint_failed", "message": r.error}
    msg = {"role": "assistant", "content": r.content}
    if r.reasoning is not None:
        msg["reasoning_content"] = r.reasoning
    if r.calls:
        msg["tool_calls"] = r.calls
    _remember(srv, rid, body, conv, msg, resp)
    return srv.json(resp, headers)


async def retrieve(srv, request: Request):
    rid = request.path_params["response_id"]
    got = _memory(srv).get(rid)
    if got is None:
        raise BadRequest(f"response '{rid[:80]}' is not known to this server", "response_id", status=404)
    return srv.json(got[1])


class _Stream:
    """The Responses SSE of one reply: the events' sequence numbers, the output items done so far
    and the open one ({"item", "index", "text"})."""

    def __init__(self, srv, rid: str, created: int, body: dict, req: ChatRequest, out: Output):
        self.srv, self.rid, self.created, self.body, self.req, self.out = srv, rid, created, body, req, out
        self.seq = 0
        self.items: list[dict] = []
        self.cur: dict | None = None

    def event(self, kind: str, data: dict) -> str:
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.seq - 1, **data})}\n\n"

    def resp(self, status: str, u=None) -> dict:
        items = list(self.items) if status != "in_progress" else []
        return _response(self.srv, self.rid, self.created, self.body, self.req, status, items, u)

    def open_item(self, item: dict) -> str:
        self.cur = {"item": item, "index": len(self.items), "text": []}
        s = self.event("response.output_item.added", {"output_index": self.cur["index"], "item": item})
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            ref = {"item_id": item["id"], "output_index": self.cur["index"], "content_index": 0}
            s += self.event("response.content_part.added", ref | {"part": part})
        return s

    def close_item(self, status: str = "completed") -> str:
        item, i, text = self.cur["item"], self.cur["index"], "".join(self.cur["text"])
        ref = {"item_id": item["id"], "output_index": i, "content_index": 0}
        s = ""
        if item["type"] == "reasoning":
            s += self.event("response.reasoning_text.done", ref | {"text": text})
            done = self.out.reasoning(text) | {"id": item["id"]}
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            s += self.event("response.output_text.done", ref | {"text": text, "logprobs": []})
            s += self.event("response.content_part.done", ref | {"part": part})
            done = item | {"status": status, "content": [part]}
        s += self.event("response.output_item.done", {"output_index": i, "item": done})
        self.items.append(done)
        self.cur = None
        return s

    def text(self, kind: str, text: str) -> list[str]:
        """A reasoning or message delta, opening its item (and closing another) first."""
        o = []
        if self.cur is None or self.cur["item"]["type"] != kind:
            if self.cur is not None:
                o.append(self.close_item())
            new = ({"type": "reasoning", "id": "rs_" + secrets.token_hex(12), "summary": []} if kind == "reasoning"
                   else {**self.out.message("", "in_progress"), "content": []})  # fmt: skip
            o.append(self.open_item(new))
        self.cur["text"].append(text)
        ref = {"item_id": self.cur["item"]["id"], "output_index": self.cur["index"], "content_index": 0, "delta": text}
        if kind == "reasoning":
            o.append(self.event("response.reasoning_text.delta", ref))
        else:
            o.append(self.event("response.output_text.delta", ref | {"logprobs": []}))
        return o

    def call(self, c: dict) -> list[str]:
        """A function call: its item whole (added, arguments delta and done, item done)."""
        o = [self.close_item()] if self.cur is not None else []
        item = self.out.call(c, "in_progress") | {"arguments": ""}
        i = len(self.items)
        o.append(self.event("response.output_item.added", {"output_index": i, "item": item}))
        args = c["function"]["arguments"]
        ref = {"item_id": item["id"], "output_index": i}
        o.append(self.event("response.function_call_arguments.delta", ref | {"delta": args}))
        o.append(self.event("response.function_call_arguments.done", ref | {"arguments": args, "name": item["name"]}))
        done = item | {"arguments": args, "status": "completed"}
        o.append(self.event("response.output_item.done", {"output_index": i, "item": done}))
        self.items.append(done)
        return o

    def end(self, ev: dict, conv: list) -> list[str]:
        cut = ev["finish_reason"] == "length"
        o = [self.close_item("incomplete" if cut else "completed")] if self.cur is not None else []
        if not self.items:  # an empty reply is an empty message, as non-streamed
            o.append(self.open_item({**self.out.message("", "in_progress"), "content": []}))
            o.append(self.close_item("incomplete" if cut else "completed"))
        status = "incomplete" if cut else ("failed" if ev.get("error") else "completed")
        final = self.resp(status, usage(ev["usage"]))
        if ev.get("error"):
            final["error"] = {"code": "constraint_failed", "message": ev["error"]}
        o.append(self.event(f"response.{status}", {"response": final}))
        _remember(self.srv, self.rid, self.body, conv, ev["message"], final)
        return o


async def _sse(srv, run: ChatRun, rid: str, created: int, body: dict, req: ChatRequest, conv: list, out: Output):
    """response.created, response.in_progress; per output item output_item.added, its parts and
    deltas (reasoning_text, content_part + output_text, function_call_arguments), their .done
    events and output_item.done; then response.completed (or response.incomplete when cut at
    max_output_tokens) with usage and cached tokens. Every event has a sequence_number."""
    st = _Stream(srv, rid, created, body, req, out)
    s = st.event("response.created", {"response": st.resp("in_progress")})
    yield s + st.event("response.in_progress", {"response": st.resp("in_progress")})
    async for ev in run.events():
        if ev["type"] == "error":
            failed = st.resp("failed") | {"error": {"code": "server_error", "message": ev["message"]}}
            yield st.event("error", {"code": "server_error", "message": ev["message"], "param": None}) + st.event(
                "response.failed", {"response": failed}
            )
            return
        o = []
        if ev["type"] == "delta":
            for kind, text in (("reasoning", ev["reasoning"]), ("message", ev["content"])):
                if text:
                    o += st.text(kind, text)
            for c in ev["calls"]:
                o += st.call(c)
        else:
            o += st.end(ev, conv)
        if o:
            yield "".join(o)
