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
import multiprocessing as mp
import os
import threading

from .http import BadRequest

PREP_TIMEOUT = 10.0  # seconds one job may take
MEMORY_HEADROOM = 1 << 30  # bytes a worker may add to what it holds when ready


def _rlimit_as(extra: int) -> None:
    """Cap this process's address space at its size now plus `extra`."""
    import resource

    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[0])
    limit = pages * os.sysconf("SC_PAGE_SIZE") + extra
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _constraint(v, tools, choice, parallel, schema, grammar, thinking, names):
    """The request's Constraint, its grammar checked by llama.cpp over the vocabulary."""
    from .tools import request_constraint

    c = request_constraint(tools, choice, parallel, schema, grammar, thinking, v.token_id, names)
    if c.grammar is not None:
        triggers = [v.token_id(c.trigger)] if c.trigger else None
        v.check_grammar(c.grammar, triggers)
    return c


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


def _serve(path: str, conn, headroom: int) -> None:
    """A worker: load the vocabulary, cap memory, answer jobs until the pipe closes."""
    from ..runtime.vocab import Vocab

    v = Vocab.open(path)
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
    def __init__(self, ctx, path: str, headroom: int):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(path, child, headroom), daemon=True, name="clover-prep")
        self.proc.start()
        child.close()
        self.ready = False

    def wait_ready(self, timeout: float = 120.0) -> None:
        if not self.ready:
            if not self.conn.poll(timeout):
                raise RuntimeError("a preparation worker did not start")
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

    def __init__(self, name: str, path: str, n: int, timeout: float, headroom: int):
        self.name, self.path, self.timeout, self.headroom = name, path, timeout, headroom
        self.ctx = mp.get_context("spawn")  # not fork: the server holds llama.cpp's threads
        self.workers = [_Worker(self.ctx, path, headroom) for _ in range(n)]
        self._free: asyncio.Queue | None = None
        self.killed = 0
        self._lock = threading.Lock()

    def wait_ready(self) -> None:
        for w in self.workers:
            w.wait_ready()

    async def run(self, kind: str, args: tuple, param: str | None, what: str):
        if self._free is None:
            self._free = asyncio.Queue()
            for w in self.workers:
                self._free.put_nowait(w)
        w = await self._free.get()
        try:
            status, out = await asyncio.wait_for(asyncio.to_thread(w.call, kind, args), self.timeout)
        except (TimeoutError, asyncio.CancelledError) as e:
            w = self._replace(w)
            if isinstance(e, asyncio.CancelledError):
                raise
            raise BadRequest(
                f"{what} took longer than {self.timeout:g} s: refused (the server's budget)", param
            ) from None
        except (EOFError, OSError):  # the worker died (a crash in llama.cpp's parser, a signal)
            w = self._replace(w)
            raise BadRequest(f"{what} failed: the worker preparing it stopped", param) from None
        finally:
            self._free.put_nowait(w)
        if status == "err":
            _raise(*out, param, what)
        return out

    def _replace(self, w: _Worker) -> _Worker:
        """Kill a worker whose job ran too long and start another (it loads in the background)."""
        with self._lock:
            self.killed += 1
            i = self.workers.index(w)
            w.kill()
            self.workers[i] = _Worker(self.ctx, self.path, self.headroom)
            return self.workers[i]

    def close(self) -> None:
        for w in self.workers:
            w.kill()


def _raise(cls: str, message: str, field: str | None, param: str | None, what: str):
    """The worker's error as the request's 400: a FieldError names its own field."""
    if cls in ("FieldError", "BadRequest", "FieldProblem"):
        raise BadRequest(message, field or param)
    raise BadRequest(f"{what} failed: {message}", param)


class Prep:
    """The two pools of a server."""

    def __init__(self, path: str, n: int = 2, timeout: float = PREP_TIMEOUT, headroom: int = MEMORY_HEADROOM):
        self.constraints = Pool("constraints", path, n, timeout, headroom)
        self.templates = Pool("templates", path, n, timeout, headroom)

    def wait_ready(self) -> None:
        self.constraints.wait_ready()
        self.templates.wait_ready()

    def stats(self) -> dict:
        return {"prep_workers_replaced": self.constraints.killed + self.templates.killed}

    def close(self) -> None:
        self.constraints.close()
        self.templates.close()
