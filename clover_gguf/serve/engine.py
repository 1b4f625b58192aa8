"""The one object that owns the CloverRuntime: a worker thread takes queued jobs, up to
`parallel` of them as a group, and decodes them; state snapshots make a turn that extends an
earlier history prefill only what is new.

Every job goes the same way whatever the cache holds (restore or reset, commit the prompt up to
its last full block, snapshot, then `rt.generate(..., reset=False)` on the rest), so a cache hit
never changes an output: it equals a fresh run of the same request (docs/CONTRACTS.md).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..constants import DEFAULT_THRESHOLD
from ..reference.generate import BlockStats, GenerationConfig
from .cache import StateCache
from .text import TextStream


@dataclass
class Job:
    """One request. `emit` receives the events (called on the worker thread):
    {"type": "block", "text", "n_tokens", "steps"} after each block, then one
    {"type": "done", "text", "finish_reason", "usage"} or {"type": "error", "message"}."""

    prompt: list[int]
    cfg: GenerationConfig
    emit: Callable[[dict], None]
    stop: list[str] = field(default_factory=list)
    cache: bool = True
    # prompt lengths whose last block boundary gets a snapshot too (where a chat's history ends,
    # before the generation prompt that the next turn renders differently)
    snapshot_at: list[int] = field(default_factory=list)
    # the tokens the next turn will start with, given the reply's text; None: prompt + reply tokens
    history: Callable[[str], list[int]] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    t_submit: float = field(default_factory=time.perf_counter)
    t_start: float = 0.0  # the worker took it
    reused: int = 0  # prompt tokens restored from a snapshot

    def cancel(self) -> None:
        self.cancelled.set()


class Engine:
    def __init__(self, rt, parallel: int = 1, ctx_cache: int = 16):
        self.rt = rt
        self.parallel = max(1, int(parallel))
        self.cache = StateCache(ctx_cache)
        lc, vocab = rt._lib.lc, rt.vocab
        self.eog = {t for t in range(rt.n_vocab) if lc.llama_vocab_is_eog(vocab, t)}
        self._q: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._pending: list[tuple[list[int], int]] = []  # histories to snapshot when idle
        self.counters = dict(
            requests=0, cancelled=0, errors=0, prefill_tokens=0, reused_tokens=0, groups=0, largest_group=0
        )

    # ------------------------------------------------------------------ lifetime
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="clover-engine", daemon=True)
            self._thread.start()

    def close(self, timeout: float | None = None) -> None:
        """Finish the queued jobs, stop the worker."""
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout)
            self._thread = None

    def submit(self, job: Job) -> None:
        self._q.put(job)

    def stats(self) -> dict:
        return {**self.counters, "queued": self._q.qsize(), "cache": self.cache.stats()}

    # ------------------------------------------------------------------ worker
    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            group = [job]
            while len(group) < self.parallel:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._q.put(None)
                    break
                group.append(nxt)
            self.counters["groups"] += 1
            self.counters["largest_group"] = max(self.counters["largest_group"], len(group))
            self.run_group(group)
            while self._pending and self._q.empty():
                self._snapshot_history(*self._pending.pop())
            self._pending.clear()

    def run_group(self, jobs: list[Job]) -> None:
        """Decode the jobs that waited together. The runtime decodes one sequence, so they run one
        after the other, each exactly as it would alone. A batched runtime replaces the loop over
        `_decode` by one call for all of them (each job's `_prepare` on its own sequence first)."""
        for job in jobs:
            if job.cancelled.is_set():
                self.counters["cancelled"] += 1
                _send(job, {"type": "error", "message": "cancelled before it started"})
                continue
            try:
                start, t_prefill = self._prepare(job)
                self._decode(job, start, t_prefill)
            except Exception as e:  # one failed request must not stop the server
                self.counters["errors"] += 1
                _send(job, {"type": "error", "message": f"{type(e).__name__}: {e}"})

    # ------------------------------------------------------------------ one job
    def _prepare(self, job: Job) -> tuple[int, float]:
        """Restore the longest cached prefix (else reset) and commit the prompt up to its last
        full block, snapshotting there. Returns (position generation starts from, seconds)."""
        rt, P, B = self.rt, job.prompt, job.cfg.block_size
        t0 = job.t_start = time.perf_counter()
        n, snap = self.cache.lookup(P, B) if job.cache and self.cache.capacity else (0, None)
        if snap is not None:
            rt.load_state(snap)
        else:
            rt.reset()
            n = 0
        job.reused = start = n
        if job.cache and self.cache.capacity:
            for m in sorted({k // B * B for k in [*job.snapshot_at, len(P)] if k <= len(P)}):
                if m > start:
                    rt.commit(P[start:m], B)
                    self.cache.store(P[:m], B, rt.save_state())
                    start = m
        return start, time.perf_counter() - t0

    def _decode(self, job: Job, start: int, t_prefill: float) -> None:
        rt, cfg = self.rt, job.cfg
        self.counters["requests"] += 1
        text = TextStream(rt.detokenize, job.stop)
        out: list[int] = []
        state = {"finish": None, "eog": None, "t_first": None}
        t0 = time.perf_counter()

        def on_block(toks: list[int], st: BlockStats):
            if state["t_first"] is None:
                state["t_first"] = time.perf_counter()
            cut = next((i for i, t in enumerate(toks) if t in self.eog), None)
            if cut is not None:
                state["eog"] = toks[cut]
                toks = toks[:cut]
                state["finish"] = "stop"
            out.extend(toks)
            last = cut is not None or len(out) >= cfg.max_new_tokens
            delta = text.feed(toks, last=last)
            if text.stopped:
                state["finish"] = "stop"
            _send(job, {"type": "block", "text": delta, "n_tokens": st.n_tokens, "steps": st.steps})
            if job.cancelled.is_set():
                state["finish"] = "cancelled"
                return False
            return state["finish"] is None

        res = rt.generate(job.prompt[start:], cfg, on_block=on_block, reset=False)
        t_end = time.perf_counter()
        if state["finish"] is None:
            state["finish"] = "length"
            tail = text.feed([], last=True)
            if tail:
                _send(job, {"type": "block", "text": tail, "n_tokens": 0, "steps": 0})
        if state["finish"] == "cancelled":
            self.counters["cancelled"] += 1
        prefill_tokens = len(job.prompt) - job.reused
        self.counters["prefill_tokens"] += prefill_tokens
        self.counters["reused_tokens"] += job.reused
        steps = sum(b.steps for b in res.blocks)
        gen_tokens = sum(b.n_tokens for b in res.blocks)
        prefill_ms = t_prefill * 1e3 + res.prefill_ms
        t_first = state["t_first"] or t_end
        ms = lambda a, b: (b - a) * 1e3
        usage = {
            "prompt_tokens": len(job.prompt),
            "completion_tokens": len(out),
            "total_tokens": len(job.prompt) + len(out),
            "prompt_tokens_details": {"cached_tokens": job.reused},
            "clover": {
                "block_size": cfg.block_size,
                "schedule": f"steps={cfg.steps}" if cfg.steps is not None else f"threshold={_thr(cfg)}",
                "prefill_tokens": prefill_tokens,
                "reused_tokens": job.reused,
                "blocks": len(res.blocks),
                "steps": steps,
                "generated_tokens": gen_tokens,
                "tokens_per_step": gen_tokens / steps if steps else None,
                "timings": {
                    "queue_ms": ms(job.t_submit, job.t_start),
                    "prefill_ms": prefill_ms,
                    "first_block_ms": ms(job.t_start, t_first),
                    "generation_ms": ms(t0, t_end) - res.prefill_ms,
                    "total_ms": ms(job.t_start, t_end),
                },
            },
        }
        _send(job, {"type": "done", "text": text.text, "finish_reason": state["finish"], "usage": usage})
        if job.cache and self.cache.capacity and state["finish"] != "cancelled":
            end = [] if state["eog"] is None else [state["eog"]]
            try:
                hist = job.history(text.text) if job.history else job.prompt + out + end
            except Exception:  # only an optimisation: the next turn prefills these tokens itself
                hist = []
            self._pending.append((hist, cfg.block_size))

    def _snapshot_history(self, hist: list[int], B: int) -> None:
        """Commit prompt + reply up to its last full block and keep the snapshot: the next turn of
        the conversation then prefills only what follows (done when no job is waiting)."""
        target = len(hist) // B * B
        if target == 0 or self.cache.has(hist[:target], B):
            return
        try:
            n, snap = self.cache.lookup(hist[:target], B)
            if snap is not None:
                self.rt.load_state(snap)
            else:
                self.rt.reset()
                n = 0
            self.rt.commit(hist[n:target], B)
            self.cache.store(hist[:target], B, self.rt.save_state())
        except Exception:  # only an optimisation: the next turn prefills these tokens itself
            self.counters["errors"] += 1


def _thr(cfg: GenerationConfig) -> float:
    return cfg.threshold if cfg.threshold is not None else DEFAULT_THRESHOLD


def _send(job: Job, ev: dict) -> None:
    try:
        job.emit(ev)
    except Exception:  # the client's event loop is gone
        job.cancel()
