"""The HTTP side of `clover-gguf serve`: OpenAI-compatible routes on FastAPI, SSE streaming with
one event per committed block, request validation with OpenAI-style errors naming the field.

Routes: GET /health, GET /v1/models, GET /props (configuration and counters, as llama-server),
POST /v1/completions, POST /v1/chat/completions. Request fields beyond OpenAI's:
`top_k`; `chat_template_kwargs` (vLLM / llama-server: `enable_thinking`); `clover` (see
CLOVER_FIELDS). Fields this server does not implement (penalties, tools, logit_bias, ...) are
ignored; `n` > 1, `echo`, `logprobs`, `best_of` and `suffix` are refused.
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
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..reference.generate import GenerationConfig
from . import logprobs as lp
from .engine import Engine, Job
from .tools import ChatDeltas, FieldError, chat_message, parse_tool_calls, request_constraint

MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_STOP = 16
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
    etype = "authentication_error" if e.status == 401 else "invalid_request_error"
    return JSONResponse(error_body(e.message, e.param, e.code, etype), status_code=e.status)


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
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"request body is not valid UTF-8 (byte {e.start})", code="invalid_encoding") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    return body


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _opt_int(d: dict, key: str, lo: int | None = None, hi: int | None = None, param: str | None = None):
    v = d.get(key)
    if v is None:
        return None
    p = param or key
    if not _is_int(v):
        raise BadRequest(f"'{p}' must be an integer, got {json.dumps(v)}", p)
    if lo is not None and v < lo:
        raise BadRequest(f"'{p}' must be >= {lo}, got {v}", p)
    if hi is not None and v > hi:
        raise BadRequest(f"'{p}' must be <= {hi}, got {v}", p)
    return v


def _opt_num(d: dict, key: str, param: str | None = None):
    v = d.get(key)
    if v is None:
        return None
    p = param or key
    if not _is_num(v):
        raise BadRequest(f"'{p}' must be a number, got {json.dumps(v)}", p)
    return float(v)


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


def parse_sampling(body: dict, n_prompt: int, chat: bool, default_block: int, max_block: int, ctx: int) -> Sampling:
    for k in ("echo", "suffix", "best_of"):
        if body.get(k) and not (k == "best_of" and body[k] == 1):
            raise BadRequest(f"'{k}' is not supported by this server", k, "unsupported_parameter")
    logprobs = _parse_logprobs(body, chat)
    n = _opt_int(body, "n")
    if n is not None and n != 1:
        raise BadRequest("'n' must be 1: one choice per request", "n", "unsupported_parameter")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _opt_int(body, key, lo=0)
    room = ctx - n_prompt
    if max_tokens is None:
        max_tokens = room if chat else 16
    max_tokens = min(max_tokens, room)
    temp = _opt_num(body, "temperature")
    if temp is not None and not 0.0 <= temp <= 2.0:
        raise BadRequest(f"'temperature' must be in [0, 2], got {temp}", "temperature")
    top_p = _opt_num(body, "top_p")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise BadRequest(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = _opt_int(body, "top_k", lo=0)
    seed = _opt_int(body, "seed")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOP:
        raise BadRequest(f"'stop' must be a string or a list of at most {MAX_STOP} strings", "stop")
    stream = _opt_bool(body, "stream") or False
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    include_usage = bool(_opt_bool(so or {}, "include_usage", "stream_options.include_usage"))
    ext = body.get("clover")
    if ext is None:
        ext = {}
    if not isinstance(ext, dict):
        raise BadRequest("'clover' must be an object with " + ", ".join(CLOVER_FIELDS), "clover")
    for k in ext:
        if k not in CLOVER_FIELDS:
            raise BadRequest(f"unknown field 'clover.{k}'; known: {', '.join(CLOVER_FIELDS)}", f"clover.{k}")
    block = _opt_int(ext, "block_size", lo=1, hi=max_block, param="clover.block_size") or default_block
    steps = _opt_int(ext, "steps", lo=1, param="clover.steps")
    thr = _opt_num(ext, "threshold", param="clover.threshold")
    if thr is not None and not 0.0 < thr <= 1.0:
        raise BadRequest(f"'clover.threshold' must be in (0, 1], got {thr}", "clover.threshold")
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
        seed=seed & 0xFFFFFFFF,
    )
    cfg.n_probs = logprobs or 0
    return Sampling(cfg, stop, cache is not False, stream, include_usage, logprobs)


def _parse_logprobs(body: dict, chat: bool) -> int | None:
    """chat: `logprobs` true/false and `top_logprobs` 0..20; completions: `logprobs` 0..5."""
    if chat:
        on = _opt_bool(body, "logprobs")
        top = _opt_int(body, "top_logprobs", lo=0, hi=lp.MAX_TOP_CHAT)
        if top is not None and not on:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (top or 0) if on else None
    return _opt_int(body, "logprobs", lo=0, hi=lp.MAX_TOP_COMPLETIONS)


def parse_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"'{p}' must be an object", p)
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
        if isinstance(m.get("reasoning_content"), str):
            msg["reasoning_content"] = m["reasoning_content"]
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = parse_tool_calls(m["tool_calls"], f"{p}.tool_calls")
        if role == "tool" and m.get("tool_call_id") is not None:
            if not isinstance(m["tool_call_id"], str):
                raise BadRequest(f"'{p}.tool_call_id' must be a string", f"{p}.tool_call_id")
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


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    from contextlib import asynccontextmanager

    rt = engine.rt

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        await asyncio.to_thread(engine.close)

    app = FastAPI(title="clover-gguf", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    pieces = lp.Pieces(rt)
    model_names = {config.model_id, config.model_path}

    @app.exception_handler(BadRequest)
    async def _bad(request, e: BadRequest):
        return _err(e)

    @app.exception_handler(FieldError)
    async def _field(request, e: FieldError):
        return _err(BadRequest(str(e), e.param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e):
        return JSONResponse(error_body(str(e.detail), code=str(e.status_code)), status_code=e.status_code)

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
            "stats": engine.stats(),
        }

    def check_model(body):
        m = body.get("model")
        if m is not None and m not in model_names:
            raise BadRequest(
                f"model {json.dumps(m)} does not exist; this server has '{config.model_id}'", "model", "model_not_found"
            )

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
        return parse_sampling(body, n_prompt, chat, rt.default_block_size, rt.n_ubatch, config.ctx_size)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request)
        check_model(body)
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
        body = await read_json(request)
        check_model(body)
        msgs = parse_messages(body)
        kw = body.get("chat_template_kwargs") or {}
        if not isinstance(kw, dict):
            raise BadRequest("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        thinking = _opt_bool(kw, "enable_thinking", "chat_template_kwargs.enable_thinking")
        extra = {k: v for k, v in kw.items() if k not in ("enable_thinking", "tools")}
        # a reply constrained to calls, a schema or a grammar is read by a program: thinking is
        # on for it only when asked for (then the grammar lets a think block come first)
        con = await asyncio.to_thread(request_constraint, body, bool(thinking), rt.token_id)
        if thinking is None:
            thinking = con.grammar is None or con.trigger is not None
        tools = {"tools": con.tools} if con.tools else {}
        # The next turn renders this conversation without the generation prompt (and without an
        # empty think block): snapshot where the history ends, and the history with the reply.
        render = lambda m: rt.chat_prompt(m, enable_thinking=thinking, add_generation_prompt=False, **tools, **extra)

        def prompts():
            p = rt.chat_prompt(msgs, enable_thinking=thinking, **tools, **extra)
            return rt.tokenize(p), len(rt.tokenize(render(msgs)))

        try:
            ids, n_hist = await asyncio.to_thread(prompts)
        except Exception as e:  # a template error is the request's fault
            raise BadRequest(f"the chat template failed on these messages: {e}", "messages") from None
        check_context(len(ids), "messages")
        s = sampling(body, len(ids), chat=True)
        s.cfg.grammar = con.grammar
        s.cfg.grammar_triggers = [rt.token_id(con.trigger)] if con.trigger else None

        def history(reply: str) -> list[int]:
            return rt.tokenize(render(msgs + [chat_message(reply, thinking, con.parse_calls)]))

        return await respond(request, ids, s, "chat.completion", thinking, [n_hist], history, con)

    @app.post("/infill")
    async def infill(request: Request):
        """llama-server's /infill fields (input_prefix, input_suffix, prompt), by fixing the suffix's
        tokens inside the one block that is denoised: [n_predict masks][suffix] after the prefix."""
        body = await read_json(request)
        check_model(body)
        for k in ("input_prefix", "input_suffix", "prompt"):
            if not isinstance(body.get(k, ""), str):
                raise BadRequest(f"'{k}' must be a string", k)
        if body.get("input_extra"):
            raise BadRequest(
                "'input_extra' (other files' context) is not supported: put it in input_prefix", "input_extra"
            )
        if body.get("stream"):
            raise BadRequest("'stream': the middle is one block, decoded at once; ask without stream", "stream")
        prefix = await tokenize(body.get("input_prefix", "") + body.get("prompt", ""))
        suffix = await tokenize(body.get("input_suffix", ""))
        n_max = rt.n_ubatch - len(suffix)
        key = "n_predict" if body.get("n_predict") is not None else "max_tokens"
        m = _opt_int(body, key, lo=1, hi=max(1, n_max)) or min(rt.default_block_size, n_max)
        if n_max < 1:
            raise BadRequest(
                f"the suffix has {len(suffix)} tokens: with the middle it must fit in one block of at most "
                f"{rt.n_ubatch} tokens (the context's n_ubatch)",
                "input_suffix",
            )
        check_context(len(prefix) + m + len(suffix), "input_prefix")
        s = sampling({k: v for k, v in body.items() if k not in ("n_predict", "max_tokens")}, len(prefix), chat=False)
        block = [rt.mask_token_id] * m + suffix
        s.cfg.first_block, s.cfg.max_new_tokens, s.stream = block, len(block), False
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        job = Job(prefix, s.cfg, lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev), [], s.cache, [], lambda _t: [])
        engine.submit(job)
        try:
            while (ev := await q.get())["type"] == "block":
                pass
        finally:
            job.cancel()
        if ev["type"] == "error":
            return JSONResponse(error_body(ev["message"], etype="server_error"), status_code=500)
        mid = ev["tokens"][:m]
        cut = next((i for i, t in enumerate(mid) if t in rt.eog), len(mid))
        return {
            "content": rt.detokenize(mid[:cut]),
            "model": config.model_id,
            "tokens_predicted": cut,
            "tokens_evaluated": len(prefix),
            "stop": True,
            "stop_type": "eos" if cut < m else "limit",
            "usage": ev["usage"] | {"completion_tokens": cut, "total_tokens": len(prefix) + cut},
        }

    async def respond(
        request: Request, ids, s: Sampling, kind: str, thinking: bool, snapshot_at=(), history=None, con=None
    ):
        parse_calls = bool(con and con.parse_calls)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def emit(ev):
            loop.call_soon_threadsafe(q.put_nowait, ev)

        job = Job(ids, s.cfg, emit, s.stop, s.cache, list(snapshot_at), history)
        rid = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + secrets.token_hex(12)
        created = int(time.time())
        engine.submit(job)
        if s.stream:
            return StreamingResponse(
                _sse(job, q, rid, created, kind, thinking, s, config.model_id, parse_calls, pieces),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(q.get(), 0.25)
                except TimeoutError:
                    if await request.is_disconnected():
                        job.cancel()
                        return JSONResponse(error_body("client disconnected"), status_code=499)
                    continue
                if ev["type"] == "error":
                    if ev.get("status") == 400:  # the request's grammar (see Engine)
                        param = {"json": "response_format", "tools": "tools"}.get(con.kind if con else "", "grammar")
                        raise BadRequest(ev["message"], param)
                    return JSONResponse(error_body(ev["message"], etype="server_error"), status_code=500)
                if ev["type"] == "done":
                    break
        finally:
            job.cancel()  # no-op when done; stops the generation if this handler was cancelled
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


async def _sse(
    job: Job, q: asyncio.Queue, rid, created, kind, thinking, s: Sampling, model, parse_calls, pieces
) -> AsyncIterator[str]:
    """One `data:` event per block (text may be empty while it is held back), then one with the
    finish_reason and usage, then `[DONE]`. With logprobs, each block's event carries those of
    its tokens."""
    include_usage = s.include_usage
    chat = kind == "chat.completion"
    offset = 0
    obj = "chat.completion.chunk" if chat else "text_completion"
    deltas = ChatDeltas(thinking, parse_calls) if chat else None

    def chunk(delta_text: str | None, finish=None, usage=None, last=False, ev=None):
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
        if usage is not None:
            d["usage"] = usage
        return f"data: {json.dumps(d)}\n\n"

    try:
        while True:
            ev = await q.get()
            if ev["type"] == "block":
                yield chunk(ev["text"], ev=ev)
            elif ev["type"] == "error":
                yield f"data: {json.dumps(error_body(ev['message'], etype='server_error'))}\n\n"
                return
            else:
                yield chunk("" if chat else None, ev["finish_reason"], ev["usage"], last=True)
                if include_usage:
                    d = {"id": rid, "object": obj, "created": created, "model": model, "choices": []}
                    yield f"data: {json.dumps({**d, 'usage': ev['usage']})}\n\n"
                yield "data: [DONE]\n\n"
                return
    finally:
        job.cancel()
