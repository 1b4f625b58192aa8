"""The HTTP side of `clover-gguf serve`: OpenAI-compatible routes on FastAPI, SSE streaming with
one event per committed block, request validation with OpenAI-style errors naming the field.

Routes: GET /health, GET /v1/models, GET /props (configuration and counters, as llama-server),
GET /metrics (Prometheus text, llama-server's names), POST /v1/completions,
POST /v1/chat/completions, POST /infill, POST /tokenize, /detokenize, /apply-template
(llama-server's). Every request field is implemented or refused (fields.py has the table);
`clover` is this server's extension object (CLOVER_FIELDS).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..reference.generate import GenerationConfig
from . import fields
from . import logprobs as lp
from .engine import Engine, Job
from .fields import MAX_STOP, MAX_STOP_CHARS, FieldProblem
from .tools import ChatDeltas, FieldError, chat_message, parse_tool_calls, request_constraint

MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_N_PREDICT = 8192  # the server's limit on the tokens of one reply (--n-predict)
DEFAULT_QUEUE_TIMEOUT = 300.0  # seconds a request may wait for a sequence (--queue-timeout)
ROLES = ("system", "developer", "user", "assistant", "tool")
# the `clover` extension object of a request
CLOVER_FIELDS = {
    "block_size": "decoding block size B (1 .. the context's n_ubatch); default: the model's",
    "steps": "`steps` schedule: denoising steps per block (>= 1)",
    "threshold": "`threshold` schedule: unmask every position at least this confident, in (0, 1]; default 0.9",
    "cache_prompt": "reuse and keep memory snapshots for this request (default true)",
}


@dataclass
class ServerConfig:
    model_path: str
    model_id: str
    ctx_size: int
    api_key: str | None = None
    parallel: int = 1
    ctx_cache: int = 16
    threads: int | None = None
    n_gpu_layers: int = 0
    experts_on_cpu: bool = False
    host: str = "127.0.0.1"
    port: int = 8080
    rpc: list[str] = field(default_factory=list)
    placement: dict = field(default_factory=dict)  # CloverRuntime.placement: layers and buffers per device
    n_predict: int = DEFAULT_N_PREDICT  # tokens of one reply at most; the default for chat
    queue_timeout: float | None = DEFAULT_QUEUE_TIMEOUT  # None: wait for ever
    extra: dict = field(default_factory=dict)

    def public(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "api_key"}
        d["api_key"] = bool(self.api_key)
        return d


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


def error_body(message: str, param=None, code=None, etype="invalid_request_error") -> dict:
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


def _err(e: BadRequest) -> JSONResponse:
    etype = {401: "authentication_error", 503: "server_busy"}.get(e.status)
    etype = etype or ("server_error" if e.status >= 500 else "invalid_request_error")
    headers = {"Retry-After": "5"} if e.status == 503 else None
    return JSONResponse(error_body(e.message, e.param, e.code, etype), status_code=e.status, headers=headers)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


# ----------------------------------------------------------------------------- request parsing


async def read_json(request: Request, limit: int = MAX_BODY_BYTES) -> dict:
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > limit:
        raise BadRequest(f"request body of {cl} bytes is over the limit of {limit} bytes", status=413)
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise BadRequest(f"request body is over the limit of {limit} bytes", status=413)
        chunks.append(chunk)
    raw = b"".join(chunks)
    # a large body takes a while to parse and check: not on the event loop
    return await asyncio.to_thread(parse_body, raw) if len(raw) > 1 << 20 else parse_body(raw)


def parse_body(raw: bytes) -> dict:
    """A request body as a JSON object: UTF-8, strict JSON (no NaN / Infinity), nested at most
    fields.MAX_JSON_DEPTH deep, every string valid Unicode."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"request body is not valid UTF-8 (byte {e.start})", code="invalid_encoding") from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except ValueError as e:  # JSONDecodeError, NaN / Infinity
        raise BadRequest(f"request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise BadRequest(
            f"request body is nested deeper than {fields.MAX_JSON_DEPTH} levels", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    fields.check_json(body)
    return body


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _opt_bool(d: dict, key: str, param: str | None = None):
    v = d.get(key)
    if v is not None and not isinstance(v, bool):
        p = param or key
        raise BadRequest(f"'{p}' must be true or false, got {json.dumps(v)}", p)
    return v


@dataclass
class Sampling:
    cfg: GenerationConfig
    stop: list[str]
    cache: bool
    stream: bool
    include_usage: bool
    logprobs: int | None = None  # None: off; else the alternatives per token (top_logprobs)


def parse_sampling(
    body: dict, n_prompt: int, chat: bool, default_block: int, max_block: int, ctx: int, n_predict: int
) -> Sampling:
    """The sampling fields of a completion or chat request, each checked against fields.NUMERIC.
    `max_tokens` past the context is refused; the reply's limit is the smallest of `max_tokens`
    (chat default: none), the server's --n-predict and the room the context leaves."""
    limits = {"ctx": ctx, "n_ubatch": max_block}
    num = lambda d, k, param=None: fields.number(d, k, limits, param)
    logprobs = _parse_logprobs(body, chat, limits)
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = num(body, key)
    if max_tokens is None:
        max_tokens = n_predict if chat else 16
    max_tokens = min(max_tokens, n_predict, ctx - n_prompt)
    temp, top_p, top_k, seed = (num(body, k) for k in ("temperature", "top_p", "top_k", "seed"))
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if (
        not isinstance(stop, list)
        or len(stop) > MAX_STOP
        or not all(isinstance(s, str) and len(s) <= MAX_STOP_CHARS for s in stop)
    ):
        raise BadRequest(
            f"'stop' must be a string or a list of at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters",
            "stop",
        )
    stream = _opt_bool(body, "stream") or False
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    fields.check_fields(so or {}, fields.STREAM_OPTIONS, "stream_options.")
    include_usage = bool(_opt_bool(so or {}, "include_usage", "stream_options.include_usage"))
    ext = body.get("clover")
    if ext is None:
        ext = {}
    if not isinstance(ext, dict):
        raise BadRequest("'clover' must be an object with " + ", ".join(CLOVER_FIELDS), "clover")
    for k in ext:
        if k not in CLOVER_FIELDS:
            raise BadRequest(f"unknown field 'clover.{k}'; known: {', '.join(CLOVER_FIELDS)}", f"clover.{k}")
    block = num(ext, "block_size", "clover.block_size") or default_block
    limits["block_size"] = block
    steps = num(ext, "steps", "clover.steps")
    thr = num(ext, "threshold", "clover.threshold")
    if steps is not None and thr is not None:
        raise BadRequest("give 'clover.steps' or 'clover.threshold', not both", "clover.steps")
    cache = _opt_bool(ext, "cache_prompt", "clover.cache_prompt")
    temperature = temp if temp is not None else 0.0
    if seed is None:
        seed = secrets.randbits(32) if temperature > 0 else 0
    cfg = GenerationConfig(
        max_new_tokens=max_tokens,
        block_size=block,
        steps=steps,
        threshold=thr,
        temperature=temperature,
        top_k=top_k or 0,
        top_p=top_p if top_p is not None else 1.0,
        seed=seed,
    )
    cfg.n_probs = logprobs or 0
    return Sampling(cfg, stop, cache is not False, stream, include_usage, logprobs)


def _parse_logprobs(body: dict, chat: bool, limits: dict) -> int | None:
    """chat: `logprobs` true/false and `top_logprobs` 0..20; completions: `logprobs` 0..5."""
    if chat:
        on = _opt_bool(body, "logprobs")
        top = fields.number(body, "top_logprobs", limits)
        if top is not None and not on:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (top or 0) if on else None
    return fields.number(body, "logprobs", limits)


def parse_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"'{p}' must be an object", p)
        fields.check_fields(m, fields.MESSAGE, f"{p}.")
        for k in ("name", "reasoning_content", "tool_call_id"):
            if m.get(k) is not None and not isinstance(m[k], str):
                raise BadRequest(f"'{p}.{k}' must be a string", f"{p}.{k}")
        role = m.get("role")
        if role not in ROLES:
            raise BadRequest(f"'{p}.role' must be one of {', '.join(ROLES)}, got {json.dumps(role)}", f"{p}.role")
        c = m.get("content")
        if isinstance(c, list):
            parts = []
            for j, part in enumerate(c):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise BadRequest(f"'{p}.content[{j}]' must be a text part", f"{p}.content[{j}]")
                parts.append(part["text"])
            c = "".join(parts)
        elif c is None:
            c = ""
        elif not isinstance(c, str):
            raise BadRequest(f"'{p}.content' must be a string or a list of text parts", f"{p}.content")
        msg = {"role": "system" if role == "developer" else role, "content": c}
        for k, only in (("reasoning_content", "assistant"), ("tool_calls", "assistant"), ("tool_call_id", "tool")):
            if m.get(k) is not None and role != only:
                raise BadRequest(f"'{p}.{k}' belongs to a message of role {only}", f"{p}.{k}")
        if m.get("reasoning_content") is not None:
            msg["reasoning_content"] = m["reasoning_content"]
        if m.get("tool_calls") is not None:
            msg["tool_calls"] = parse_tool_calls(m["tool_calls"], f"{p}.tool_calls")
        if m.get("tool_call_id") is not None:
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


# ----------------------------------------------------------------------------- the app


class ApiKey:
    """ASGI middleware: every route but /health needs `Authorization: Bearer KEY` (or `X-Api-Key`)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            h = {k.lower(): v for k, v in scope.get("headers", [])}
            auth = h.get(b"authorization", b"")
            key = auth[7:].strip() if auth[:7].lower() == b"bearer " else h.get(b"x-api-key", b"")
            if not hmac.compare_digest(key, self.key):
                await _err(BadRequest("invalid or missing API key", code="invalid_api_key", status=401))(
                    scope, receive, send
                )
                return
        await self.app(scope, receive, send)


class Pending:
    """A submitted job as its request handler sees it: the worker's events as an asyncio queue,
    the wait until the worker takes it (503 past --queue-timeout), and the client's disconnect,
    which cancels it at once (the worker stops it before its next denoising step), streamed or
    not: a task waits on the ASGI receive channel, where the server reports the disconnect."""

    def __init__(self, request: Request, engine: Engine, queue_timeout: float | None, counters: dict):
        self.loop = asyncio.get_running_loop()
        self.q: asyncio.Queue = asyncio.Queue()
        self.request, self.engine, self.timeout, self.counters = request, engine, queue_timeout, counters
        self.job: Job | None = None
        self._watch: asyncio.Task | None = None
        self._first: dict | None = None

    def emit(self, ev: dict) -> None:  # called on the worker thread
        self.loop.call_soon_threadsafe(self.q.put_nowait, ev)

    async def start(self, job: Job) -> None:
        """Queue the job and wait until the worker takes it (or refuses it: that event is kept)."""
        self.job = job
        self.engine.submit(job)
        self._watch = asyncio.create_task(self._cancel_on_disconnect())
        try:
            ev = await asyncio.wait_for(self.q.get(), self.timeout)
        except TimeoutError:
            job.timed_out = True
            self.close()
            self.counters["queue_timeouts"] += 1
            raise BadRequest(
                f"the request waited {self.timeout:g} s for a free sequence (--queue-timeout); try again later",
                code="queue_timeout",
                status=503,
            ) from None
        if ev["type"] != "start":
            self._first = ev

    def refused(self) -> dict | None:
        """The error event if the worker refused the job instead of starting it."""
        return self._first if self._first is not None and self._first["type"] == "error" else None

    async def next(self) -> dict:
        if self._first is not None:
            ev, self._first = self._first, None
            return ev
        return await self.q.get()

    async def _cancel_on_disconnect(self) -> None:
        while (await self.request.receive())["type"] != "http.disconnect":
            pass
        self.job.cancel()

    def close(self) -> None:
        """Stops the job if it still runs (a no-op when it is done)."""
        if self.job is not None:
            self.job.cancel()
        if self._watch is not None:
            self._watch.cancel()


def _job_error(ev: dict, con=None) -> BadRequest:
    """The error event of a job as the HTTP error: the request's grammar is the request's fault
    (the engine marks it 400), a job cancelled before it started has no client left to answer
    (499, nginx's "client closed request"); anything else is the server's (500)."""
    if ev.get("status") == 499:
        return BadRequest(ev["message"], code="client_closed_request", status=499)
    if ev.get("status") == 400:
        param = {"json": "response_format", "tools": "tools"}.get(con.kind if con else "", "grammar")
        return BadRequest(ev["message"], param)
    return BadRequest(ev["message"], code="server_error", status=500)


# chat_template_kwargs the server sets itself
TEMPLATE_RESERVED = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


@dataclass
class ChatPrompt:
    """A chat request rendered: the prompt's text and tokens, where the history ends (its tokens
    rendered without the generation prompt), and how the template was called."""

    text: str
    ids: list[int]
    n_hist: int
    msgs: list[dict]
    thinking: bool
    con: object  # tools.Constraint
    template_kw: dict

    def history(self, rt, reply: str) -> list[int]:
        """The tokens the next turn starts with: this conversation and the reply, as the next
        turn renders them (without the generation prompt and an empty think block)."""
        m = self.msgs + [chat_message(reply, self.thinking, self.con.parse_calls)]
        return rt.tokenize(rt.chat_prompt(m, add_generation_prompt=False, **self.template_kw))


def prepare_chat(rt, body: dict) -> ChatPrompt:
    """What a chat request renders to (run in a thread: the constraint's grammar is built here
    too). Thinking is on unless the request turns it off, or constrains the reply to calls, a
    schema or a grammar: that reply is read by a program (then thinking only when asked for, and
    the grammar lets a think block come first)."""
    msgs = parse_messages(body)
    kw = body.get("chat_template_kwargs") or {}
    if not isinstance(kw, dict):
        raise BadRequest("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    bad = next((k for k in kw if k in TEMPLATE_RESERVED), None)
    if bad:
        p = f"chat_template_kwargs.{bad}"
        raise BadRequest(f"'{p}' is set by the server (from the request's own fields)", p)
    thinking = _opt_bool(kw, "enable_thinking", "chat_template_kwargs.enable_thinking")
    extra = {k: v for k, v in kw.items() if k != "enable_thinking"}
    con = request_constraint(body, bool(thinking), rt.token_id)
    if thinking is None:
        thinking = con.grammar is None or con.trigger is not None
    tkw = {"enable_thinking": thinking, **({"tools": con.tools} if con.tools else {}), **extra}
    try:
        text = rt.chat_prompt(msgs, **tkw)
        n_hist = len(rt.tokenize(rt.chat_prompt(msgs, add_generation_prompt=False, **tkw)))
    except Exception as e:  # a template error is the request's fault
        raise BadRequest(f"the chat template failed on these messages: {e}", "messages") from None
    return ChatPrompt(text, rt.tokenize(text), n_hist, msgs, thinking, con, tkw)


def create_app(engine: Engine, config: ServerConfig, log=None) -> FastAPI:
    """The app; `log(line)` gets one line of counters at shutdown."""
    from contextlib import asynccontextmanager

    from .metrics import prometheus_text

    rt = engine.rt

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        await asyncio.to_thread(engine.close)
        if log is not None:
            st = engine.stats()
            log(
                f"clover-gguf serve: stopped after {st['requests']} requests ({st['cancelled']} cancelled, "
                f"{st['errors']} errors), {st['sequence_steps']} denoising steps, "
                f"{st['completion_tokens']} tokens returned"
            )

    app = FastAPI(title="clover-gguf", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    pieces = lp.Pieces(rt)
    http = {"queue_timeouts": 0, "server_errors": 0}  # counted here, not by the engine

    @app.exception_handler(BadRequest)
    async def _bad(request, e: BadRequest):
        if e.status == 500:
            http["server_errors"] += 1
        return _err(e)

    @app.exception_handler(FieldError)
    async def _field(request, e: FieldError):
        return _err(BadRequest(str(e), e.param))

    @app.exception_handler(FieldProblem)
    async def _problem(request, e: FieldProblem):
        return _err(BadRequest(str(e), e.param, e.code))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e):
        return JSONResponse(error_body(str(e.detail), code=str(e.status_code)), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _bug(request, e: Exception):  # a bug: said as JSON (uvicorn logs the traceback)
        http["server_errors"] += 1
        return JSONResponse(error_body(f"{type(e).__name__}: {e}", etype="server_error"), status_code=500)

    if config.api_key:
        app.add_middleware(ApiKey, key=config.api_key)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": config.model_id,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "clover-gguf",
                    "meta": {
                        "n_vocab": rt.n_vocab,
                        "n_layer": rt.n_layer,
                        "block_size": rt.default_block_size,
                        "n_ctx": config.ctx_size,
                    },
                }
            ],
        }

    @app.get("/props")
    async def props():
        return {
            "config": config.public(),
            "model": {"block_size": rt.default_block_size, "n_ubatch": rt.n_ubatch, "threads": rt.n_threads},
            "clover_fields": CLOVER_FIELDS,
            "stats": engine.stats() | http,
        }

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(engine.stats() | http), media_type="text/plain; version=0.0.4")

    def check_model(body):
        """Any name: the server has one model (as llama-server); replies name it config.model_id."""
        m = body.get("model")
        if m is not None and not isinstance(m, str):
            raise BadRequest(f"'model' must be a string, got {json.dumps(m)[:60]}", "model")

    async def read(request: Request, table: dict) -> dict:
        body = await read_json(request)
        fields.check_fields(body, table)
        check_model(body)
        return body

    async def tokenize(text: str) -> list[int]:
        return await asyncio.to_thread(rt.tokenize, text)

    def check_context(n: int, param: str):
        if n > config.ctx_size:
            raise BadRequest(
                f"the prompt has {n} tokens, more than the context limit of {config.ctx_size}",
                param,
                "context_length_exceeded",
            )

    def sampling(body, n_prompt, chat):
        return parse_sampling(
            body, n_prompt, chat, rt.default_block_size, rt.n_ubatch, config.ctx_size, config.n_predict
        )

    def pending(request: Request) -> Pending:
        return Pending(request, engine, config.queue_timeout, http)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read(request, fields.COMPLETIONS)
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = await tokenize(prompt)
        elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
            bad = next((t for t in prompt if not 0 <= t < rt.n_vocab), None)
            if bad is not None:
                raise BadRequest(f"token id {bad} in 'prompt' is outside the vocabulary [0, {rt.n_vocab})", "prompt")
            ids = list(prompt)
        else:
            raise BadRequest("'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")
        check_context(len(ids), "prompt")
        s = sampling(body, len(ids), chat=False)
        return await respond(request, ids, s, "text_completion", False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await read(request, fields.CHAT)
        cp = await asyncio.to_thread(prepare_chat, rt, body)
        check_context(len(cp.ids), "messages")
        s = sampling(body, len(cp.ids), chat=True)
        s.cfg.grammar = cp.con.grammar
        s.cfg.grammar_triggers = [rt.token_id(cp.con.trigger)] if cp.con.trigger else None
        # snapshots where the history ends, and of the history with the reply (the next turn's start)
        hist = lambda reply: cp.history(rt, reply)
        return await respond(request, cp.ids, s, "chat.completion", cp.thinking, [cp.n_hist], hist, cp.con)

    _add_text_routes(app, rt, read)

    @app.post("/infill")
    async def infill(request: Request):
        """llama-server's /infill fields (input_prefix, input_suffix, prompt), by fixing the suffix's
        tokens inside the one block that is denoised: [n_predict masks][suffix] after the prefix."""
        body = await read(request, fields.INFILL)
        for k in ("input_prefix", "input_suffix", "prompt"):
            if not isinstance(body.get(k) or "", str):
                raise BadRequest(f"'{k}' must be a string", k)
        cache = _opt_bool(body, "cache_prompt")
        prefix = await tokenize((body.get("input_prefix") or "") + (body.get("prompt") or ""))
        suffix = await tokenize(body.get("input_suffix") or "")
        n_max = rt.n_ubatch - len(suffix)
        if n_max < 1:
            raise BadRequest(
                f"the suffix has {len(suffix)} tokens: with the middle it must fit in one block of at most "
                f"{rt.n_ubatch} tokens (the context's n_ubatch)",
                "input_suffix",
            )
        key = "n_predict" if body.get("n_predict") is not None else "max_tokens"
        try:
            m = fields.number(body, key, {"n_ubatch": n_max}, "n_predict") or min(rt.default_block_size, n_max)
        except FieldProblem as e:  # max_tokens: llama-server's other name for n_predict here
            raise BadRequest(str(e).replace("'n_predict'", f"'{key}'"), key, e.code) from None
        check_context(len(prefix) + m + len(suffix), "input_prefix")
        drop = ("n_predict", "max_tokens", "input_prefix", "input_suffix", "prompt", "cache_prompt", "input_extra")
        s = sampling({k: v for k, v in body.items() if k not in drop}, len(prefix), chat=False)
        s.cache = s.cache and cache is not False
        block = [rt.mask_token_id] * m + suffix
        s.cfg.first_block, s.cfg.max_new_tokens, s.stream = block, len(block), False
        pend = pending(request)
        try:
            await pend.start(Job(prefix, s.cfg, pend.emit, [], s.cache, [], lambda _t: []))
            while (ev := await pend.next())["type"] == "block":
                pass
        finally:
            pend.close()
        if ev["type"] == "error":
            raise _job_error(ev)
        mid = ev["tokens"][:m]
        cut = next((i for i, t in enumerate(mid) if t in rt.eog), len(mid))
        text, stop_type = rt.detokenize(mid[:cut]), "eos" if cut < m else "limit"
        at = min((i for i in (text.find(x) for x in s.stop) if i >= 0), default=-1)
        if at >= 0:  # the middle ends before the first stop string
            text, stop_type = text[:at], "word"
        return {
            "content": text,
            "model": config.model_id,
            "tokens_predicted": cut,
            "tokens_evaluated": len(prefix),
            "stop": True,
            "stop_type": stop_type,
            "usage": ev["usage"] | {"completion_tokens": cut, "total_tokens": len(prefix) + cut},
        }

    async def respond(
        request: Request, ids, s: Sampling, kind: str, thinking: bool, snapshot_at=(), history=None, con=None
    ):
        parse_calls = bool(con and con.parse_calls)
        rid = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + secrets.token_hex(12)
        created = int(time.time())
        pend = pending(request)
        try:
            await pend.start(Job(ids, s.cfg, pend.emit, s.stop, s.cache, list(snapshot_at), history))
            if (ev := pend.refused()) is not None:
                raise _job_error(ev, con)  # before it started (a bad grammar): an HTTP error, not a stream
        except BaseException:
            pend.close()
            raise
        if s.stream:
            return StreamingResponse(
                _sse(pend, rid, created, kind, thinking, s, config.model_id, parse_calls, pieces),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            while (ev := await pend.next())["type"] == "block":
                pass
        finally:
            pend.close()  # no-op when done; stops the generation if this handler was cancelled
        if ev["type"] == "error":
            raise _job_error(ev, con)
        choice = {"index": 0, "finish_reason": ev["finish_reason"], "logprobs": None}
        if s.logprobs is not None:
            n = lp.returned(pieces, ev["tokens"], ev["text"])
            got = (ev["tokens"][:n], ev["probs"][:n], ev["top"][:n], s.logprobs)
            choice["logprobs"] = (
                {"content": lp.chat_content(pieces, *got)} if kind == "chat.completion" else lp.completion(pieces, *got)
            )
        if kind == "chat.completion":
            msg = chat_message(ev["text"], thinking, parse_calls)
            if msg.get("tool_calls") and ev["finish_reason"] == "stop":
                choice["finish_reason"] = "tool_calls"
            choice["message"] = msg
        else:
            choice["text"] = ev["text"]
        return {
            "id": rid,
            "object": kind,
            "created": created,
            "model": config.model_id,
            "choices": [choice],
            "usage": ev["usage"],
        }

    return app


def _add_text_routes(app: FastAPI, rt, read) -> None:
    """llama-server's /apply-template, /tokenize and /detokenize; `read(request, table)` reads
    and checks a body."""

    @app.post("/apply-template")
    async def apply_template(request: Request):
        """llama-server's: the prompt a chat request renders to (tools included), not generated."""
        body = await read(request, fields.CHAT)
        cp = await asyncio.to_thread(prepare_chat, rt, body)
        return {"prompt": cp.text}

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        """llama-server's: `content` (a string), `add_special`, `parse_special`, `with_pieces`."""
        body = await read(request, fields.TOKENIZE)
        content = body.get("content", "")
        if not isinstance(content, str):
            raise BadRequest("'content' must be a string", "content")
        add = bool(_opt_bool(body, "add_special"))
        parse = _opt_bool(body, "parse_special") is not False
        ids = await asyncio.to_thread(rt.tokenize, content, add, parse)
        if not _opt_bool(body, "with_pieces"):
            return {"tokens": ids}
        return {"tokens": [{"id": t, "piece": _piece(rt.token_bytes(t))} for t in ids]}

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        """llama-server's: `tokens` (ids) to `content`."""
        body = await read(request, fields.DETOKENIZE)
        toks = body.get("tokens", [])
        if not isinstance(toks, list) or not all(_is_int(t) for t in toks):
            raise BadRequest("'tokens' must be a list of token ids", "tokens")
        bad = next((t for t in toks if not 0 <= t < rt.n_vocab), None)
        if bad is not None:
            raise BadRequest(f"token id {bad} in 'tokens' is outside the vocabulary [0, {rt.n_vocab})", "tokens")
        return {"content": await asyncio.to_thread(rt.detokenize, toks)}


def _piece(b: bytes) -> str | list[int]:
    """A token's text as llama-server's /tokenize gives it: a string, or its bytes when they are
    not valid UTF-8 on their own."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return list(b)


async def _sse(
    pend: Pending, rid, created, kind, thinking, s: Sampling, model, parse_calls, pieces
) -> AsyncIterator[str]:
    """One `data:` event per block (text may be empty while it is held back), then one with the
    finish_reason, then (stream_options.include_usage) OpenAI's usage-only event, then `[DONE]`:
    usage is sent once. With logprobs, each block's event carries those of its tokens."""
    chat = kind == "chat.completion"
    offset = 0
    obj = "chat.completion.chunk" if chat else "text_completion"
    deltas = ChatDeltas(thinking, parse_calls) if chat else None

    def chunk(delta_text: str | None, finish=None, last=False, ev=None):
        nonlocal offset
        logprobs = None
        if s.logprobs is not None and ev is not None:
            got = (ev["tokens"], ev["probs"], ev["top"], s.logprobs)
            if chat:
                logprobs = {"content": lp.chat_content(pieces, *got)}
            else:
                logprobs = lp.completion(pieces, *got, offset=offset)
                offset += sum(len(t) for t in logprobs["tokens"])
        if chat:
            delta = deltas.feed(delta_text, last=last)
            if finish == "stop" and deltas.n_calls:
                finish = "tool_calls"
            c = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        else:
            c = {"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": logprobs}
        d = {"id": rid, "object": obj, "created": created, "model": model, "choices": [c]}
        return f"data: {json.dumps(d)}\n\n"

    try:
        while True:
            ev = await pend.next()
            if ev["type"] == "block":
                yield chunk(ev["text"], ev=ev)
            elif ev["type"] == "error":
                yield f"data: {json.dumps(error_body(ev['message'], etype='server_error'))}\n\n"
                return
            else:
                yield chunk("" if chat else None, ev["finish_reason"], last=True)
                if s.include_usage:
                    d = {"id": rid, "object": obj, "created": created, "model": model, "choices": []}
                    yield f"data: {json.dumps({**d, 'usage': ev['usage']})}\n\n"
                yield "data: [DONE]\n\n"
                return
    finally:
        pend.close()
