"""The one object that owns the CloverRuntime: a worker thread takes queued jobs, up to
`parallel` of them as a group, and decodes them together (one sequence each, one graph per
denoising step); state snapshots make a turn that extends an earlier history prefill only what
is new.

Every job goes the same way whatever the cache holds and whatever it is grouped with (restore or
clear its sequence, commit the prompt up to its last full block, snapshot, then generate from
there), so neither a cache hit nor a group changes an output: it equals a fresh run of the same
request alone (docs/CONTRACTS.md).
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
    """One request. `emit` receives the events (called on the worker thread): {"type": "start"}
    when the worker takes it, {"type": "block", "text", "n_tokens", "steps", "reused"} after each block,
    then one {"type": "done", "text", "finish_reason", "usage"} or {"type": "error", "message"}
    (an error may come instead of "start"). `cancel()` stops it before the next denoising step."""

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
    timed_out: bool = False  # cancelled by the queue timeout (answered 503), not by its client

    def cancel(self) -> None:
        self.cancelled.set()


class Engine:
    """`rt` needs n_seq_max >= parallel + 1: sequences 0 .. parallel-1 decode a group, the last one
    commits finished conversations for the snapshot of their next turn."""

    def __init__(self, rt, parallel: int = 1, ctx_cache: int = 16):
        self.rt = rt
        self.parallel = max(1, int(parallel))
        if rt.n_seq_max < self.parallel + 1:
            raise ValueError(f"Engine(parallel={self.parallel}) needs a runtime with n_seq_max >= {self.parallel + 1}")
        self.scratch = rt.n_seq_max - 1
        self.cache = StateCache(ctx_cache)
        lc, vocab = rt._lib.lc, rt.vocab
        self.eog = {t for t in range(rt.n_vocab) if lc.llama_vocab_is_eog(vocab, t)}
        self._q: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._graphs0 = 0  # denoise_graphs when the current group began
        self.counters = dict(
            requests=0,
            cancelled=0,
            errors=0,
            prefill_tokens=0,
            reused_tokens=0,
            history_tokens=0,
            groups=0,
            largest_group=0,
            # denoising graphs run, and the steps of every sequence: fewer graphs than sequence
            # steps is the proof that requests were decoded together; largest_group: the most
            # requests decoding at once
            denoise_graphs=0,
            sequence_steps=0,
            # tokens returned to clients (up to an end token or stop string) and block positions
            # denoised; seconds restoring/committing prompts and decoding (for /metrics)
            completion_tokens=0,
            generated_tokens=0,
            prompt_seconds=0.0,
            generation_seconds=0.0,
            processing=0,  # requests decoding now
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
        return {**self.counters, "queued": self.queued(), "cache": self.cache.stats()}

    def queued(self) -> int:
        """Jobs waiting for the worker (not those cancelled meanwhile, which it will drop)."""
        return sum(j is not None and not j.cancelled.is_set() for j in list(self._q.queue))

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
            self.run_group(group)

    def run_group(self, jobs: list[Job]) -> None:
        """Decode the jobs that waited together, and those that arrive meanwhile: each is
        prepared on a free sequence (restore or clear, commit the prompt up to its last full
        block), then one generate_batch decodes them all, every denoising step one graph with the
        current block of each unfinished job; a job that arrives while others decode joins at
        the next step, on the sequence of one that ended (continuous batching). A long prompt
        that arrives while others decode is committed a chunk between their steps, each chunk
        about as long as a step (llama-server's chunked prefill), so that it delays them by one
        chunk a step, not by its whole prefill. A job is reported done as soon as it ends, after
        its history snapshot is stored."""
        _Group(self).run(jobs)

    def _count_graphs(self) -> None:
        """denoise_graphs now, inside a group (the runtime counts its graphs since the group began)."""
        self.counters["denoise_graphs"] = self._graphs0 + int(self.rt.perf().get("n_steps", 0))

    def _take(self) -> Job | None:
        """A queued job, without waiting; None when there is none or the engine is closing."""
        try:
            job = self._q.get_nowait()
        except queue.Empty:
            return None
        if job is None:
            self._q.put(None)  # closing: the worker loop sees it after this group
        return job

    # ------------------------------------------------------------------ one job
    def _snapshot_history(self, hist: list[int], B: int) -> None:
        """Commit prompt + reply up to its last full block on the scratch sequence and keep the
        snapshot: the next turn of the conversation then prefills only what follows."""
        target = len(hist) // B * B
        if target == 0 or self.cache.has(hist[:target], B):
            return
        rt, seq = self.rt, self.scratch
        try:
            n, snap = self.cache.lookup(hist[:target], B)
            if snap is not None:
                rt.load_state(snap, seq)
            else:
                rt.reset(seq)
                n = 0
            rt.commit(hist[n:target], B, seq)
            self.cache.store(hist[:target], B, rt.save_state(seq))
            self.counters["history_tokens"] += target - n
        except Exception:  # only an optimisation: the next turn prefills these tokens itself
            self.counters["errors"] += 1


_MIN_CHUNK_S = 0.005  # a chunk of a long prompt commits at least this long between steps


class _Cancelled(Exception):
    pass


class _Prefill:
    """A job's prompt committed on its sequence: the longest cached prefix restored (else the
    sequence cleared), then the prompt up to its last full block, snapshotting at the job's
    snapshot points; `advance(budget)` commits all of it (None) or about `budget` seconds of it,
    in whole blocks (a commit split at block boundaries equals one commit: docs/CONTRACTS.md).
    The tail after the last full block is committed when the job starts decoding."""

    def __init__(self, engine: Engine, job: Job, seq: int):
        self.e, self.job, self.seq = engine, job, seq
        rt, P, B = engine.rt, job.prompt, job.cfg.block_size
        t0 = job.t_start = time.perf_counter()
        cache = job.cache and engine.cache.capacity
        n, snap = engine.cache.lookup(P, B) if cache else (0, None)
        if snap is not None:
            rt.load_state(snap, seq)
        else:
            rt.reset(seq)
            n = 0
        job.reused = self.pos = n
        self.end = len(P) // B * B
        marks = {k // B * B for k in [*job.snapshot_at, len(P)] if k <= len(P)} if cache else set()
        self.marks = sorted(m for m in marks if m > n)
        self.chunk = 8 * B  # tokens a commit takes, adapted to the budget
        self.seconds = time.perf_counter() - t0

    def advance(self, budget: float | None) -> bool:
        rt, P, B, e = self.e.rt, self.job.prompt, self.job.cfg.block_size, self.e
        t0 = time.perf_counter()
        while self.pos < self.end:
            stop = min([self.end, *(m for m in self.marks if m > self.pos)])
            if budget is not None:
                stop = min(stop, self.pos + self.chunk)
            t1 = time.perf_counter()
            rt.commit(P[self.pos : stop], B, self.seq)
            dt = time.perf_counter() - t1
            if budget is not None and dt > 0:  # the next chunk about as long as the budget
                rate = (stop - self.pos) / dt
                self.chunk = max(B, int(rate * budget) // B * B)
            self.pos = stop
            if stop in self.marks:
                e.cache.store(P[:stop], B, rt.save_state(self.seq))
            if budget is not None and time.perf_counter() - t0 >= budget:
                break
            if budget is not None and self.job.cancelled.is_set():
                raise _Cancelled
        self.seconds += time.perf_counter() - t0
        return self.pos >= self.end


class _Run:
    """One job of a group while it decodes: its block callback and its end."""

    def __init__(self, engine: Engine, job: Job, seq: int, start: int, t_prefill: float):
        self.e, self.job, self.seq, self.start, self.t_prefill = engine, job, seq, start, t_prefill
        self.text = TextStream(engine.rt.detokenize, job.stop)
        self.out: list[int] = []
        # per token of out: its probability when unmasked, and its row's most probable tokens
        self.probs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.finish_reason: str | None = None
        self.eog: int | None = None
        self.t0 = self.t_first = self.t_last = 0.0
        self.n_gen = 0
        self.steps = 0  # denoising steps this sequence took part in (a cancelled block's too)
        self.finished = False
        engine.counters["requests"] += 1
        engine.counters["processing"] += 1

    def after_step(self) -> bool:
        """After each denoising step: a cancelled job stops here, mid-block."""
        self.steps += 1
        self.e.counters["sequence_steps"] += 1
        if self.job.cancelled.is_set() and self.finish_reason is None:
            self.finish_reason = "cancelled"
        return self.finish_reason != "cancelled"

    def on_block(self, toks: list[int], st: BlockStats) -> bool:
        self.t_last = time.perf_counter()
        self.t_first = self.t_first or self.t_last
        self.n_gen += st.n_tokens
        cut = next((i for i, t in enumerate(toks) if t in self.e.eog), None)
        if cut is not None:
            self.eog = toks[cut]
            toks = toks[:cut]
            self.finish_reason = "stop"
        self.out.extend(toks)
        self.probs.extend(st.probs[: len(toks)])
        self.top.extend(st.top[: len(toks)] if st.top else [[] for _ in toks])
        last = cut is not None or self.n_gen >= self.job.cfg.max_new_tokens
        delta = self.text.feed(toks, last=last)
        if self.text.stopped:
            self.finish_reason = "stop"
        n = len(self.out) - len(toks)
        ev = {"type": "block", "text": delta, "n_tokens": st.n_tokens, "steps": st.steps, "reused": self.job.reused}
        _send(self.job, ev | {"tokens": toks, "probs": self.probs[n:], "top": self.top[n:]})
        if self.job.cancelled.is_set():
            self.finish_reason = "cancelled"
            return False
        return self.finish_reason is None

    def finish(self, res) -> None:
        """The sequence has ended: store the snapshot of the conversation as the next turn will
        start (before reporting done, so that a next turn sent at once finds it), then report."""
        self.finished = True
        e, job, cfg = self.e, self.job, self.job.cfg
        e.counters["processing"] -= 1
        t_end = time.perf_counter()
        if self.finish_reason is None:
            self.finish_reason = "length"
            tail = self.text.feed([], last=True)
            if tail:
                _send(job, {"type": "block", "text": tail, "n_tokens": 0, "steps": 0, "reused": job.reused})
        if self.finish_reason == "cancelled":
            e.counters["cancelled"] += 1
        elif job.cache and e.cache.capacity:
            end = [] if self.eog is None else [self.eog]
            try:
                hist = job.history(self.text.text) if job.history else job.prompt + self.out + end
            except Exception:  # only an optimisation: the next turn prefills these tokens itself
                hist = []
            e._snapshot_history(hist, cfg.block_size)
        prefill_tokens = len(job.prompt) - job.reused
        e._count_graphs()  # counters are up to date when the client reads them after its reply
        e.counters["prefill_tokens"] += prefill_tokens
        e.counters["reused_tokens"] += job.reused
        steps = sum(b.steps for b in res.blocks)
        gen_tokens = sum(b.n_tokens for b in res.blocks)
        n_out = self.text.n_tokens()  # the tokens of the text returned (a stop string cuts it)
        t_gen_end = self.t_last or t_end
        ms = lambda a, b: (b - a) * 1e3
        e.counters["completion_tokens"] += n_out
        e.counters["generated_tokens"] += gen_tokens
        e.counters["prompt_seconds"] += self.t_prefill + res.prefill_ms / 1e3
        e.counters["generation_seconds"] += max(0.0, t_gen_end - self.t0 - res.prefill_ms / 1e3)
        usage = {
            "prompt_tokens": len(job.prompt),
            "completion_tokens": n_out,
            "total_tokens": len(job.prompt) + n_out,
            "prompt_tokens_details": {"cached_tokens": job.reused},
            "clover": {
                "block_size": cfg.block_size,
                "max_tokens": cfg.max_new_tokens,
                "schedule": f"steps={cfg.steps}" if cfg.steps is not None else f"threshold={_thr(cfg)}",
                "prefill_tokens": prefill_tokens,
                "reused_tokens": job.reused,
                "blocks": len(res.blocks),
                "steps": steps,
                "generated_tokens": gen_tokens,
                "tokens_per_step": gen_tokens / steps if steps else None,
                "sequence": self.seq,
                "timings": {
                    "queue_ms": ms(job.t_submit, job.t_start),
                    "prefill_ms": self.t_prefill * 1e3 + res.prefill_ms,
                    "first_block_ms": ms(job.t_start, self.t_first or t_gen_end),
                    "generation_ms": max(0.0, ms(self.t0, t_gen_end) - res.prefill_ms),
                    "history_ms": ms(t_end, time.perf_counter()),
                    "total_ms": ms(job.t_start, time.perf_counter()),
                },
            },
        }
        done = {"type": "done", "text": self.text.text, "finish_reason": self.finish_reason, "usage": usage}
        done["stop_word"] = self.text.stop_word
        _send(job, done | {"tokens": self.out, "probs": self.probs, "top": self.top})


def _thr(cfg: GenerationConfig) -> float:
    return cfg.threshold if cfg.threshold is not None else DEFAULT_THRESHOLD


def _send(job: Job, ev: dict) -> None:
    try:
        job.emit(ev)
    except Exception:  # the client's event loop is gone
        job.cancel()


class _Group:
    """One run_group: the sequences decoding (runs) and those whose prompt is being committed
    (prefilling), and the callbacks generate_batch calls between steps."""

    def __init__(self, engine: Engine):
        self.e = engine
        self.runs: dict[int, _Run] = {}  # sequence -> the job decoding there
        self.prefilling: dict[int, _Prefill] = {}  # sequence -> the job whose prompt is being committed
        self.last = time.perf_counter()  # when the last step ended: a chunk is about one step long
        self.starting: list[tuple[int, list[int], GenerationConfig]] = []  # the first refill's runs

    def admit(self, job: Job, seq: int) -> _Prefill | None:
        if job.cancelled.is_set():
            self.e.counters["cancelled"] += not job.timed_out
            _send(job, {"type": "error", "message": "cancelled before it started", "status": 499})
            return None
        # a grammar was built and checked before the job was queued (serve/prep.py): the
        # worker thread never parses a request's grammar before it decodes
        _send(job, {"type": "start"})
        try:
            return _Prefill(self.e, job, seq)
        except Exception as e:  # one failed request must not stop the server
            self.e.counters["errors"] += 1
            _send(job, {"type": "error", "message": f"{type(e).__name__}: {e}"})
            return None

    def advance(self, p: _Prefill, budget: float | None) -> bool:
        """Commit more of p's prompt; True when it is ready to decode (its run started)."""
        counters = self.e.counters
        try:
            if p.job.cancelled.is_set():
                raise _Cancelled
            if not p.advance(budget):
                return False
            self.runs[p.seq] = _Run(self.e, p.job, p.seq, p.pos, p.seconds)
        except _Cancelled:
            counters["cancelled"] += 1
            _send(p.job, {"type": "error", "message": "cancelled while its prompt was committed", "status": 499})
            self.prefilling.pop(p.seq, None)
            return False
        except Exception as e:  # one failed request must not stop the server
            counters["errors"] += 1
            _send(p.job, {"type": "error", "message": f"{type(e).__name__}: {e}"})
            self.prefilling.pop(p.seq, None)
            return False
        self.prefilling.pop(p.seq, None)
        self.runs[p.seq].t0 = time.perf_counter()
        live = sum(not r.finished for r in self.runs.values())
        counters["largest_group"] = max(counters["largest_group"], live)
        return True

    def refill(self, free: list[int]) -> list[tuple[int, list[int], GenerationConfig]]:
        out, self.starting = self.starting, []
        idle = all(not (r.job and not r.finished) for r in self.runs.values())
        budget = None if idle else max(_MIN_CHUNK_S, time.perf_counter() - self.last)
        waiting = sorted(self.prefilling.values(), key=lambda p: p.job.t_submit)
        for p in waiting if idle else waiting[:1]:
            if self.advance(p, budget):
                out.append((p.seq, p.job.prompt[p.pos :], p.job.cfg))
        taken = set(self.prefilling) | {s for s, _, _ in out}
        for seq in (q for q in free if q < self.e.parallel and q not in taken):  # the last is the scratch one
            while (job := self.e._take()) is not None:
                if (p := self.admit(job, seq)) is None:
                    continue
                self.prefilling[seq] = p
                if self.advance(p, budget):
                    out.append((seq, job.prompt[p.pos :], job.cfg))
                break
            else:
                break
        self.last = time.perf_counter()
        return out

    def after_step(self, i: int) -> bool:
        self.last = time.perf_counter()
        return self.runs[i].after_step()

    def run(self, jobs: list[Job]) -> None:
        e, runs = self.e, self.runs
        # nothing decodes yet: prompts are committed whole, the shortest first (the others wait
        # for them, not the other way round)
        for seq, job in enumerate(jobs):
            if (p := self.admit(job, seq)) is not None:
                self.prefilling[seq] = p
        for p in sorted(self.prefilling.values(), key=lambda p: p.end - p.pos):
            self.advance(p, None)
        if not runs:
            return
        # they start through refill, on the sequences their prompts were committed on
        self.starting = [(r.seq, r.job.prompt[r.start :], r.job.cfg) for r in runs.values()]
        e.counters["groups"] += 1
        e._graphs0 = e.counters["denoise_graphs"]
        try:
            e.rt.generate_batch(
                [],
                [],
                on_block=lambda i, toks, st: runs[i].on_block(toks, st),
                reset=False,
                on_finish=lambda i, res: runs[i].finish(res),
                refill=self.refill,
                after_step=self.after_step,
            )
            e.counters["denoise_graphs"] = e._graphs0 + int((e.rt.last_perf or {}).get("n_steps", 0))
        except Exception as ex:
            for r in runs.values():
                if not r.finished:
                    r.finished = True
                    e.counters["errors"] += 1
                    e.counters["processing"] -= 1
                    _send(r.job, {"type": "error", "message": f"{type(ex).__name__}: {ex}"})
        for p in list(self.prefilling.values()):  # left when every decoding sequence failed
            e.counters["errors"] += 1
            _send(p.job, {"type": "error", "message": "the group it joined failed before its prompt was committed"})
