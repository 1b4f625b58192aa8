"""A chat request's preparation where a slow one holds only itself: building its constraint (the
JSON-schema conversion and llama.cpp's grammar, checked over the vocabulary) and rendering the
chat template run in worker processes that load the GGUF's vocabulary alone (runtime/vocab.py).
Each job has a time budget (PREP_TIMEOUT) and each worker a memory budget (MEMORY_HEADROOM
above what it uses when ready): a job past either is killed with its worker, which is replaced,
and the request is answered 400 naming the field. A client that leaves cancels its job the
same way. Two pools, so that slow grammars never delay the rendering that every chat request
needs: `constraints` and `templates`.

Nothing here holds the engine's worker thread or the event loop; threads cannot be stopped,
processes can (issue 47: an ambiguous grammar held the server for minutes after its client left,
a hostile template filled the thread pool).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import multiprocessing as mp
import os
import threading
import time
from collections import OrderedDict

from .http import BadRequest

PREP_TIMEOUT = 4.0  # seconds one job may take (a request ends within 5 s of its own work)
PREP_QUEUE_WAIT = 1.0  # seconds a request may wait for a free worker before a 503
STEP_BUDGET_X, STEP_BUDGET_MIN = 20.0, 0.05  # one constrained position: x a JSON grammar's, seconds
MEMORY_HEADROOM = 1 << 30  # bytes a worker may add to what it holds when ready
DONE_KEPT = 64  # constraints remembered (an agent's tools, each turn)


def _rlimit_as(extra: int) -> None:
    """Cap this process's address space at its size now plus `extra`."""
    import resource

    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[0])
    limit = pages * os.sysconf("SC_PAGE_SIZE") + extra
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _constraint(v, tools, choice, parallel, schema, grammar, thinking, names):
    """The request's Constraint, its grammar checked by llama.cpp over the vocabulary."""
    from .tools import FieldError, request_constraint

    c = request_constraint(tools, choice, parallel, schema, grammar, thinking, v.token_id, names)
    if c.grammar is not None:
        triggers = [v.token_id(c.trigger)] if c.trigger else None
        v.check_grammar(c.grammar, triggers)
        took = v.grammar_step_seconds(c.grammar, triggers)
        if took > v.step_budget:
            field = (names or {}).get(c.kind_field, c.kind_field)
            raise FieldError(
                f"'{field}': one constrained position takes {took:.2f} s over the vocabulary (the grammar is "
                f"too ambiguous; the server's budget is {v.step_budget:.2f} s)",
                field,
            )
    return c


def step_budget(v) -> float:
    """What one constrained position may cost: STEP_BUDGET_X times a JSON object grammar's on this
    vocabulary (at least STEP_BUDGET_MIN): a step of every sequence in the batch waits for it."""
    from ..runtime.grammar import JSON_OBJECT_SCHEMA, json_schema_to_grammar

    base = v.grammar_step_seconds(json_schema_to_grammar(JSON_OBJECT_SCHEMA))
    return max(STEP_BUDGET_MIN, STEP_BUDGET_X * base)


def _render(v, msgs, tkw, limit, param):
    """(text, ids, history tokens) of the chat template on these messages."""
    from .chat import ContextOverflow, fits

    text = v.chat_prompt(msgs, **tkw)
    hist = v.chat_prompt(msgs, add_generation_prompt=False, **tkw)
    if limit is not None:
        try:
            fits(v, text, limit, param)
        except ContextOverflow as e:
            return ("overflow", e.n_prompt)
    return text, v.tokenize(text), len(v.tokenize(hist))


JOBS = {"constraint": _constraint, "render": _render}


def _serve(path: str, conn, headroom: int, budget: float) -> None:
    """A worker: load the vocabulary, cap memory, answer jobs until the pipe closes."""
    from ..runtime.vocab import Vocab

    os.nice(10)  # the engine's decoding comes first when preparation and decoding share the cores
    v = Vocab.open(path)
    v.step_budget = budget
    v.tokenize("<|im_start|>")  # the special-token table, and the longest token
    assert v.max_token_bytes > 0
    if headroom:
        _rlimit_as(headroom)
    conn.send(("ready", None))
    while True:
        try:
            kind, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send(("ok", JOBS[kind](v, *args)))
        except MemoryError:
            conn.send(("err", ("MemoryError", f"it needed more than {headroom >> 20} MiB", None)))
        except Exception as e:  # the request's fault: said to its client
            conn.send(
                ("err", (type(e).__name__, str(e).splitlines()[0][:500] if str(e) else "", getattr(e, "param", None)))
            )


class _Worker:
    def __init__(self, ctx, path: str, headroom: int, budget: float):
        self.conn, child = ctx.Pipe()
        args = (path, child, headroom, budget)
        self.proc = ctx.Process(target=_serve, args=args, daemon=True, name="clover-prep")
        self.proc.start()
        child.close()
        self.ready = False

    def wait_ready(self, timeout: float = 120.0) -> None:
        if not self.ready:
            if not self.conn.poll(timeout):
                raise OSError("a preparation worker did not start")
            kind, _ = self.conn.recv()
            self.ready = kind == "ready"

    def call(self, kind: str, args: tuple):
        self.wait_ready()
        self.conn.send((kind, args))
        return self.conn.recv()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class Pool:
    """n workers for one kind of job; `run` waits for a free one."""

    def __init__(self, name: str, path: str, n: int, timeout: float, headroom: int, budget: float, shared=()):
        self.name, self.path, self.timeout, self.headroom, self.budget = name, path, timeout, headroom, budget
        self.ctx = _context()
        self.workers = [_Worker(self.ctx, path, headroom, budget) for _ in range(n)]
        self._free: asyncio.Queue | None = None
        self.shared = frozenset(shared)
        self._done: OrderedDict[str, tuple] = OrderedDict()  # key -> (status, out) of a finished job
        self._inflight: dict[str, list] = {}  # key -> [task, requests waiting]
        self.killed = 0
        self.jobs = self.reused = 0  # jobs sent to a worker; answered by an equal job's result
        self._lock = threading.Lock()

    def wait_ready(self) -> None:
        for w in self.workers:
            w.wait_ready()

    async def run(self, kind: str, args: tuple, param: str | None, what: str):
        """The job's result (its error raised as the request's 400). With `shared` kinds, a job
        equal to one done lately is answered from memory and one equal to a job in flight waits
        for that job (agents send the same tools every turn, often at once); the job is cancelled
        when the last request waiting for it leaves."""
        key = _key(kind, args) if kind in self.shared else None
        if key is None:
            return await self._run(kind, args, param, what)
        if key in self._done:
            self.reused += 1
            self._done.move_to_end(key)
            status, out = self._done[key]
            if status == "err":
                _raise(*out, param, what)
            return out
        job = self._inflight.get(key)
        self.reused += job is not None
        if job is None:
            job = self._inflight[key] = [asyncio.ensure_future(self._run(kind, args, param, what, raw=True)), 0]
            job[0].add_done_callback(lambda t: self._finished(key, t))
        job[1] += 1
        try:
            status, out = await asyncio.shield(job[0])
        except asyncio.CancelledError:
            job[1] -= 1
            if job[1] == 0:
                job[0].cancel()
            raise
        if status == "err":
            _raise(*out, param, what)
        return out

    def _finished(self, key: str, task: asyncio.Future) -> None:
        self._inflight.pop(key, None)
        if not task.cancelled() and task.exception() is None:
            self._done[key] = task.result()
            while len(self._done) > DONE_KEPT:
                self._done.popitem(last=False)

    async def _run(self, kind: str, args: tuple, param: str | None, what: str, raw: bool = False):
        self.jobs += 1
        if self._free is None:
            self._free = asyncio.Queue()
            for w in self.workers:
                self._free.put_nowait(w)
        w, deadline = None, time.monotonic() + PREP_QUEUE_WAIT
        while w is None:  # polled: a cancelled get() could lose a worker
            try:
                w = self._free.get_nowait()
            except asyncio.QueueEmpty:
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.02)
        if w is None:
            raise BadRequest(
                f"the server is busy preparing other requests ({what}); try again",
                code="server_busy",
                status=503,
            )
        try:
            status, out = await asyncio.wait_for(asyncio.to_thread(w.call, kind, args), self.timeout)
        except (TimeoutError, asyncio.CancelledError) as e:
            self._replace(w)
            if isinstance(e, asyncio.CancelledError):
                raise
            raise BadRequest(
                f"{what} took longer than {self.timeout:g} s: refused (the server's budget)", param
            ) from None
        except (EOFError, OSError):  # the worker died (a crash in llama.cpp's parser, a signal)
            self._replace(w)
            raise BadRequest(f"{what} failed: the worker preparing it stopped", param) from None
        self._free.put_nowait(w)
        if raw:
            return status, out
        if status == "err":
            _raise(*out, param, what)
        return out

    def _replace(self, w: _Worker) -> None:
        """Kill a worker whose job ran too long and start another, free once it has loaded (a
        request never waits for a worker's start: it finds the others, or a 503)."""
        with self._lock:
            self.killed += 1
            i = self.workers.index(w)
            w.kill()
            self.workers[i] = new = _Worker(self.ctx, self.path, self.headroom, self.budget)
        loop = asyncio.get_running_loop()

        def ready():
            try:
                new.wait_ready()
            except OSError:
                return  # it did not start: the pool has one worker fewer (logged by the server)
            loop.call_soon_threadsafe(self._free.put_nowait, new)

        threading.Thread(target=ready, daemon=True, name="clover-prep-start").start()

    def close(self) -> None:
        for w in self.workers:
            w.kill()


def _key(kind: str, args: tuple) -> str | None:
    """A job's identity: its kind and arguments as JSON (None when they are not JSON)."""
    try:
        text = json.dumps([kind, args], sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError):
        return None
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _raise(cls: str, message: str, field: str | None, param: str | None, what: str):
    """The worker's error as the request's 400: a FieldError names its own field."""
    if cls in ("FieldError", "BadRequest", "FieldProblem"):
        raise BadRequest(message, field or param)
    raise BadRequest(f"{what} failed: {message}", param)


def _context():
    """Workers are forked from a clean process that has imported what they need (multiprocessing's
    forkserver): a replacement starts in a fraction of a second, and no worker is a fork of the
    server, which holds llama.cpp's threads."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["clover_gguf.runtime.vocab", "clover_gguf.serve.tools", "clover_gguf.serve.chat"])
    return ctx


class Prep:
    """The two pools of a server; `budget`: what one constrained position may cost (step_budget of
    the server's vocabulary)."""

    def __init__(
        self, path: str, budget: float, n: int = 2, timeout: float = PREP_TIMEOUT, headroom: int = MEMORY_HEADROOM
    ):
        self.constraints = Pool("constraints", path, n, timeout, headroom, budget, shared=("constraint",))
        self.templates = Pool("templates", path, n, timeout, headroom, budget)

    def wait_ready(self) -> None:
        self.constraints.wait_ready()
        self.templates.wait_ready()

    def stats(self) -> dict:
        return {"prep_workers_replaced": self.constraints.killed + self.templates.killed,
                "prep_constraint_jobs": self.constraints.jobs, "prep_constraints_reused": self.constraints.reused}  # fmt: skip

    def close(self) -> None:
        self.constraints.close()
        self.templates.close()
