"""The HTTP plumbing every front door shares: the request error (BadRequest) and OpenAI's error
shape, reading a JSON body within the limits, API-key authentication, and Pending, a job on the
engine as an asyncio handler sees it (the wait for a sequence, the client's disconnect)."""

from __future__ import annotations

import asyncio
import hmac
import json
import re

from fastapi import Request
from fastapi.responses import JSONResponse

from . import fields
from .engine import Engine, Job

MAX_BODY_BYTES = 16 * 1024 * 1024


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


def error_type(status: int) -> str:
    """OpenAI's error type for an HTTP status."""
    t = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large", 503: "server_busy"}
    return t.get(status) or ("server_error" if status >= 500 else "invalid_request_error")


def error_body(message: str, param=None, code=None, etype="invalid_request_error") -> dict:
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


def error_response(e: BadRequest, headers: dict | None = None) -> JSONResponse:
    h = dict(headers or {})
    if e.status == 503:
        h["Retry-After"] = "5"
    body = error_body(e.message, e.param, e.code, error_type(e.status))
    return JSONResponse(body, status_code=e.status, headers=h or None)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


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


MAX_JSON_VALUES = 1_000_000  # arrays, objects and items of one body, counted before parsing
_JSON_STRING = re.compile(rb'"[^"]*"')  # after the escapes are dropped: linear, no backtracking state


def parse_body(raw: bytes) -> dict:
    """A request body as a JSON object: UTF-8, strict JSON (no NaN / Infinity), at most
    MAX_JSON_VALUES values (counted on the text: 15 MB of nested arrays took 1.2 GB as Python
    objects), nested at most fields.MAX_JSON_DEPTH deep, every string valid Unicode."""
    # escaped backslashes, then escaped quotes, out first: strings hold no quote after that (an
    # alternation per character took 1.8 s and 2 GB on 15 MB, holding the GIL)
    bare = _JSON_STRING.sub(b'""', raw.replace(b"\\\\", b"").replace(b'\\"', b""))
    n = bare.count(b",") + bare.count(b"[") + bare.count(b"{")
    if n > MAX_JSON_VALUES:
        raise BadRequest(f"request body holds more than {MAX_JSON_VALUES} JSON values", code="invalid_json", status=413)
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


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def opt_bool(d: dict, key: str, param: str | None = None):
    v = d.get(key)
    if v is not None and not isinstance(v, bool):
        p = param or key
        raise BadRequest(f"'{p}' must be true or false, got {json.dumps(v)}", p)
    return v


def opt_str(d: dict, key: str, param: str | None = None, limit: int = 1 << 20):
    v = d.get(key)
    if v is not None and not (isinstance(v, str) and len(v) <= limit):
        p = param or key
        raise BadRequest(f"'{p}' must be a string of at most {limit} characters", p)
    return v


class ApiKey:
    """ASGI middleware: every route but /health needs the key, as `Authorization: Bearer KEY`
    (OpenAI's clients) or `x-api-key: KEY` (Anthropic's)."""

    def __init__(self, app, key: str, refuse):
        self.app, self.key, self.refuse = app, key.encode(), refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            h = {k.lower(): v for k, v in scope.get("headers", [])}
            auth = h.get(b"authorization", b"")
            key = auth[7:].strip() if auth[:7].lower() == b"bearer " else h.get(b"x-api-key", b"").strip()
            if not hmac.compare_digest(key, self.key):
                e = BadRequest("invalid or missing API key", code="invalid_api_key", status=401)
                await self.refuse(scope["path"], e)(scope, receive, send)
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


async def unless_gone(request: Request, work):
    """Await `work`, cancelling it as soon as the client disconnects (after the body is read, the
    ASGI receive channel has nothing but the disconnect to say): a preparation job in a worker
    process is then killed at once, not at the end of its budget."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        raise BadRequest("the client closed the request", code="client_closed_request", status=499)
    finally:
        watch.cancel()


def job_error(ev: dict, param: str | None = None) -> BadRequest:
    """The error event of a job as the HTTP error: the request's grammar is the request's fault
    (the engine marks it 400; `param` names the field it came from), a job cancelled before it
    started has no client left to answer (499, nginx's "client closed request"); anything else is
    the server's (500)."""
    if ev.get("status") == 499:
        return BadRequest(ev["message"], code="client_closed_request", status=499)
    if ev.get("status") == 400:
        return BadRequest(ev["message"], param or "grammar")
    return BadRequest(ev["message"], code="server_error", status=500)
