"""The one internal chat request that every chat front door (OpenAI chat completions, Anthropic
messages, OpenAI responses) translates into, and its run on the engine.

A ChatRequest holds messages in the chat template's form (roles system, user, assistant, tool;
text content; an assistant's `reasoning_content` and `tool_calls` with `arguments` as a JSON
string; a tool message's `tool_call_id`), tools and tool_choice in OpenAI's function form, the
output constraint, thinking, and the decoding fields. A ChatRun renders it, queues it and gives
the reply whole (`result`) or as it is decoded (`events`): reasoning, content and complete tool
calls, then the end. No front door decodes anything itself.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request

from .decoding import Decoding, Sampling, sampling
from .engine import Job
from .http import BadRequest, Pending, job_error, unless_gone
from .text import split_reasoning
from .tools import ChatDeltas, Constraint, chat_message

# chat_template_kwargs the server sets itself
TEMPLATE_RESERVED = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")
CALL_MEMORY = 4096  # tool calls whose exact text the server keeps (by call id)


@dataclass
class ChatRequest:
    messages: list[dict]
    decoding: Decoding = field(default_factory=Decoding)
    tools: list[dict] | None = None  # OpenAI function tools, checked (tools.check_tools)
    tool_choice: str | dict | None = None  # auto, none, required, {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool = True
    schema: dict | None = None  # the content must match this JSON schema
    grammar: str | None = None  # or this GBNF grammar
    thinking: bool | None = None  # None: on, unless the reply is constrained to calls, a schema or a grammar
    template_kwargs: dict = field(default_factory=dict)
    # the front door's names of our fields, for the errors that name them ({"schema": "text.format"})
    names: dict[str, str] = field(default_factory=dict)

    def name(self, ours: str) -> str:
        return self.names.get(ours, ours)


class ContextOverflow(BadRequest):
    """The prompt does not fit the context: each front door words it as its API's clients
    recognise it (litellm maps those words to ContextWindowExceededError)."""

    def __init__(self, n_prompt: int, limit: int, param: str):
        super().__init__(
            f"This model's maximum context length is {limit} tokens. However, your messages resulted in "
            f"{n_prompt} tokens. Please reduce the length of the messages.",
            param,
            "context_length_exceeded",
        )
        self.n_prompt, self.limit = n_prompt, limit


class CallMemory:
    """The exact text of the tool calls the server generated, by call id (bounded, LRU), and the
    reasoning of the turn that made them. A client that sends a call back re-serialised
    (`{"a":1}` for `{"a": 1}`) or without its turn's reasoning gets the history rendered as the
    model wrote it, so the next turn reuses the snapshot of this one (state reuse)."""

    def __init__(self, capacity: int = CALL_MEMORY):
        self.capacity = capacity
        self._d: OrderedDict[str, tuple[str, str, str | None]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, msg: dict) -> None:
        for c in msg.get("tool_calls") or []:
            fn = c["function"]
            with self._lock:
                self._d[c["id"]] = (fn["name"], fn["arguments"], msg.get("reasoning_content"))
                self._d.move_to_end(c["id"])
                while len(self._d) > self.capacity:
                    self._d.popitem(last=False)

    def restore(self, msg: dict) -> dict:
        """An assistant message with its calls' text as generated, when the client sent back
        the same call (same name, equal arguments); other calls in the template's JSON form."""
        calls = msg.get("tool_calls")
        if not calls:
            return msg
        out, reasoning = [], None
        for c in calls:
            fn = c["function"]
            with self._lock:
                known = self._d.get(c.get("id") or "")
            args = fn["arguments"]
            if known and known[0] == fn["name"] and _same_json(known[1], args):
                args, reasoning = known[1], reasoning or known[2]
            else:
                args = _canonical(args)
            out.append({**c, "function": {"name": fn["name"], "arguments": args}})
        msg = {**msg, "tool_calls": out}
        if reasoning and not msg.get("reasoning_content"):
            msg["reasoning_content"] = reasoning
        return msg


def _same_json(a: str, b: str) -> bool:
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return False


def _canonical(args: str) -> str:
    """Arguments as the template's examples and the model write them (json.dumps: ", " and ": ")."""
    try:
        return json.dumps(json.loads(args), ensure_ascii=False)
    except ValueError:
        return args


@dataclass
class ChatPrompt:
    """A chat request rendered: the prompt's text and tokens, where the history ends (its tokens
    rendered without the generation prompt), and how the template was called."""

    text: str
    ids: list[int]
    n_hist: int
    msgs: list[dict]
    thinking: bool
    con: Constraint
    template_kw: dict

    def history(self, rt, reply: str) -> list[int]:
        """The tokens the next turn starts with: this conversation and the reply, as the next
        turn renders them (without the generation prompt and an empty think block)."""
        m = self.msgs + [chat_message(reply, self.thinking, self.con.parse_calls)]
        return rt.tokenize(rt.chat_prompt(m, add_generation_prompt=False, **self.template_kw))


def fits(rt, text: str, limit: int, param: str) -> None:
    """ContextOverflow, without tokenizing, when `text` holds more bytes than `limit` tokens can
    (a token is at most rt.max_token_bytes bytes): a 15 MB prompt is refused at once."""
    n = len(text.encode("utf-8", "surrogatepass"))
    if n > limit * rt.max_token_bytes:
        raise ContextOverflow(-(-n // rt.max_token_bytes), limit, param)


def template_kwargs(req: ChatRequest) -> dict:
    """The request's chat_template_kwargs other than enable_thinking, the reserved ones refused."""
    kw = req.template_kwargs
    bad = next((k for k in kw if k in TEMPLATE_RESERVED), None)
    if bad:
        p = f"chat_template_kwargs.{bad}"
        raise BadRequest(f"'{p}' is set by the server (from the request's own fields)", p)
    return {k: v for k, v in kw.items() if k != "enable_thinking"}


def constraint_field(req: ChatRequest) -> str:
    """The field a constraint that cannot be built is blamed on."""
    return req.name("grammar" if req.grammar is not None else "schema" if req.schema is not None else "tools")


async def prepare_chat(srv, req: ChatRequest, limit: int | None = None) -> ChatPrompt:
    """What a chat request renders to, prepared in the server's worker processes (serve/prep.py):
    its constraint (grammar built and checked), then the template. Thinking is on unless the
    request turns it off, or constrains the reply to calls, a schema or a grammar: that reply is
    read by a program (then thinking only when asked for, and the grammar lets a think block
    come first)."""
    extra = template_kwargs(req)
    args = (req.tools, req.tool_choice, req.parallel_tool_calls, req.schema, req.grammar, bool(req.thinking))
    con = await srv.prep.constraints.run(
        "constraint", (*args, req.names), constraint_field(req), "building the constraint"
    )
    thinking = req.thinking
    if thinking is None:
        thinking = con.grammar is None or con.trigger is not None
    msgs = [srv.calls.restore(m) if m["role"] == "assistant" else m for m in req.messages]
    tkw = {"enable_thinking": thinking, **({"tools": con.tools} if con.tools else {}), **extra}
    param = req.name("messages")
    out = await srv.prep.templates.run("render", (msgs, tkw, limit, param), param, "the chat template")
    if out[0] == "overflow":
        raise ContextOverflow(out[1], limit, param)
    text, ids, n_hist = out
    return ChatPrompt(text, ids, n_hist, msgs, thinking, con, tkw)


@dataclass
class ChatReply:
    """A finished reply. finish_reason: stop (an end token), stop_word (a stop string: which is
    `stop_word`), length, tool_calls (it ended with calls), error (its constraint dead-ended:
    `error` says where; the text does not match it)."""

    reasoning: str | None
    content: str
    calls: list[dict]
    finish_reason: str
    stop_word: str | None
    usage: dict
    tokens: list[int]
    probs: list[float]
    top: list
    text: str  # all of it, as generated (up to the end token or stop string)
    error: str | None = None  # finish_reason error: the constraint allowed no token (its message)


def schema_mismatch(text: str, cp: ChatPrompt, req: ChatRequest) -> str | None:
    """Why a finished constrained reply does not fit the request's schemas (None: it does): the
    content against `schema`, each returned call's arguments against its tool's parameters."""
    import jsonschema

    msg = chat_message(text, cp.thinking, cp.con.parse_calls)
    try:
        if cp.con.kind == "json" and req.schema is not None and not msg.get("tool_calls"):
            jsonschema.validate(json.loads(msg.get("content") or ""), req.schema)
        params = {t["function"]["name"]: t["function"]["parameters"] for t in cp.con.tools or []}
        for c in msg.get("tool_calls") or []:
            fn = c["function"]
            jsonschema.validate(json.loads(fn["arguments"]), params.get(fn["name"], {}))
    except ValueError as e:  # the content is not JSON
        return f"not JSON ({e})"
    except jsonschema.ValidationError as e:
        return f"does not fit the schema ({e.message[:200]})"
    except jsonschema.SchemaError:
        return None  # a schema jsonschema cannot read: the grammar is all there is to check
    return None


def _finish(ev: dict, has_calls: bool) -> str:
    if ev.get("constraint_error"):
        return "error"
    if ev.get("stop_word") is not None:
        return "stop_word"
    if ev["finish_reason"] == "stop" and has_calls:
        return "tool_calls"
    return ev["finish_reason"]


class ChatRun:
    """A ChatRequest on the engine. `await run.start()` renders it (a FieldError or BadRequest
    is the request's fault), checks it fits the context and queues it; then either
    `await run.result()` or `async for ev in run.events()`."""

    def __init__(self, srv, request: Request, req: ChatRequest):
        self.srv, self.request, self.req = srv, request, req
        self.cp: ChatPrompt | None = None
        self.s: Sampling | None = None
        self.pend: Pending | None = None

    @property
    def n_prompt(self) -> int:
        return len(self.cp.ids)

    async def render(self) -> ChatPrompt:
        srv = self.srv
        self.cp = await unless_gone(self.request, prepare_chat(srv, self.req, srv.config.ctx_size))
        if len(self.cp.ids) > srv.config.ctx_size:
            raise ContextOverflow(len(self.cp.ids), srv.config.ctx_size, self.req.name("messages"))
        return self.cp

    async def start(self) -> None:
        srv, cp = self.srv, self.cp or await self.render()
        rt = srv.rt
        self.s = s = sampling(self.req.decoding, len(cp.ids), srv.limits, srv.config.n_predict)
        s.cfg.grammar = cp.con.grammar
        s.cfg.grammar_triggers = [rt.token_id(cp.con.trigger)] if cp.con.trigger else None
        # snapshots where the history ends, and of the history with the reply (the next turn's start)
        job = Job(cp.ids, s.cfg, None, s.stop, s.cache, [cp.n_hist], lambda reply: cp.history(rt, reply))
        self.pend = pend = srv.pending(self.request)
        job.emit = pend.emit
        try:
            await pend.start(job)
            if (ev := pend.refused()) is not None:
                raise job_error(ev, self.req.name(cp.con.kind_field))
        except BaseException:
            pend.close()
            raise

    async def result(self) -> ChatReply:
        try:
            while (ev := await self.pend.next())["type"] == "block":
                pass
        finally:
            self.pend.close()  # no-op when done; stops the generation if this handler was cancelled
        if ev["type"] == "error":
            raise job_error(ev, self.req.name(self.cp.con.kind_field))
        await self._check_constraint(ev)
        msg = chat_message(ev["text"], self.cp.thinking, self.cp.con.parse_calls)
        self.srv.calls.remember(msg)
        calls = msg.get("tool_calls") or []
        return ChatReply(
            msg.get("reasoning_content"),
            msg.get("content") or "",
            calls,
            _finish(ev, bool(calls)),
            ev.get("stop_word"),
            ev["usage"],
            ev["tokens"],
            ev["probs"],
            ev["top"],
            ev["text"],
            ev.get("constraint_error"),
        )

    async def _check_constraint(self, ev: dict) -> None:
        """A constrained reply that ended on an end token must end where its grammar may end
        (libclover ends a sequence whose grammar allows no token, a dead end, the same way: the
        reply is replayed through the grammar), and what it holds must fit the request's JSON
        schemas (the converter does not express every schema: `{"not": {}}`); else
        ev["constraint_error"] says what failed."""
        g = self.s.cfg.grammar
        if g is None or ev["finish_reason"] != "stop" or ev.get("stop_word") is not None:
            return
        rt, field = self.srv.rt, self.req.name(self.cp.con.kind_field)
        ok = await asyncio.to_thread(rt.grammar_complete, g, self.s.cfg.grammar_triggers, ev["tokens"])
        why = None if ok else f"allowed no token after {len(ev['tokens'])} tokens"
        if why is None:
            why = schema_mismatch(ev["text"], self.cp, self.req)
        if why is not None:
            ev["constraint_error"] = f"the reply's constraint ('{field}') failed: {why}; the text does not match it"

    async def events(self) -> AsyncIterator[dict]:
        """The reply as it is decoded: {"type": "delta", "reasoning", "content", "calls", "block"}
        per block (any part may be empty; `block` is the engine's event, for logprobs), then
        {"type": "done", "finish_reason", "stop_word", "usage", "message"} or {"type": "error",
        "message"}. The text of the deltas, joined, is the text result() gives."""
        deltas = ChatDeltas(self.cp.thinking, self.cp.con.parse_calls)
        reasoning, content, calls = [], [], []
        try:
            while True:
                ev = await self.pend.next()
                if ev["type"] == "error":
                    yield {"type": "error", "message": ev["message"]}
                    return
                last = ev["type"] == "done"
                if last:
                    await self._check_constraint(ev)
                d = deltas.feed(ev["text"] if ev["type"] == "block" else "", last=last)
                r, c, k = d.get("reasoning_content") or "", d.get("content") or "", d.get("tool_calls") or []
                reasoning.append(r)
                content.append(c)
                calls += k
                if r or c or k or ev["type"] == "block":
                    yield {"type": "delta", "reasoning": r, "content": c, "calls": k, "block": ev}
                if last:
                    msg = {"role": "assistant", "content": "".join(content)}
                    if self.cp.thinking and split_reasoning(ev["text"])[0] is not None:
                        msg["reasoning_content"] = "".join(reasoning)
                    if calls:
                        msg["tool_calls"] = [{k: x[k] for k in ("id", "type", "function")} for x in calls]
                    self.srv.calls.remember(msg)
                    yield {
                        "type": "done",
                        "finish_reason": _finish(ev, bool(calls)),
                        "stop_word": ev.get("stop_word"),
                        "usage": ev["usage"],
                        "message": msg,
                        "error": ev.get("constraint_error"),
                    }
                    return
        finally:
            self.pend.close()
