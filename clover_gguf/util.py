"""Small things every part of the package needs: where the checkout's data lives, how many
threads to use, file hashes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO_ROOT / "models" / "clover-tiny"
EVALDATA = REPO_ROOT / "evaldata"  # held-out split, prompt sets, committed reports


def default_threads() -> int:
    """$CLOVER_GGUF_THREADS, else every core this process may run on -- or 1 when the machine
    is already busy (load average above the core count): thread pools that spin-wait for
    their workers stall on an oversubscribed CPU."""
    env = int(os.environ.get("CLOVER_GGUF_THREADS", "0") or 0)
    if env > 0:
        return env
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    try:
        if os.getloadavg()[0] > cores:
            return 1
    except OSError:  # pragma: no cover
        pass
    return max(1, cores)


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
