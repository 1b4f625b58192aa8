"""Small things every part of the package needs: where the checkout's data lives, how many
threads to use, file hashes."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO_ROOT / "models" / "clover-tiny"
EVALDATA = REPO_ROOT / "evaldata"  # held-out split, prompt sets, committed reports


def _busy_cores(interval: float = 0.1) -> float | None:
    """Cores other processes keep busy now, from two samples of /proc/stat (None elsewhere)."""

    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + (v[4] if len(v) > 4 else 0)  # total, idle + iowait

    try:
        t0, i0 = sample()
        time.sleep(interval)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    total = t1 - t0
    return (os.cpu_count() or 1) * (1 - (i1 - i0) / total) if total > 0 else None


_busy_cache: list = [float("-inf"), None]


def default_threads() -> int:
    """$CLOVER_GGUF_THREADS, else the cores this process may run on that no other process keeps
    busy now (at least 1): ggml's CPU threads meet at a barrier after every op, so one thread
    sharing a core with a busy process makes every op wait for it (scripts/bench_threads.py:
    clover-tiny's step at 2 threads took 1.5x its 1-thread time with one core busy)."""
    env = int(os.environ.get("CLOVER_GGUF_THREADS", "0") or 0)
    if env > 0:
        return env
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    now = time.monotonic()
    if now - _busy_cache[0] > 10.0:  # callers in loops must not sample every time
        _busy_cache[:] = [now, _busy_cores()]
    busy = _busy_cache[1]
    if busy is None:
        try:
            busy = os.getloadavg()[0]
        except OSError:  # pragma: no cover
            busy = 0.0
    return max(1, cores - int(busy + 0.5))


def sha256_file(path: str | Path) -> str:
    from .inputs import open_input

    h = hashlib.sha256()
    with open_input(path) as f:  # a regular file only (a FIFO would block, /dev/zero never end)
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
