"""default_threads leaves a core that another process keeps busy to that process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from clover_gguf import util


def _fresh_default_threads(monkeypatch):
    monkeypatch.delenv("CLOVER_GGUF_THREADS", raising=False)
    monkeypatch.setattr(util, "_busy_cache", [float("-inf"), None])
    return util.default_threads()


def test_busy_core_is_left_alone(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        n = _fresh_default_threads(monkeypatch)
    finally:
        spinner.kill()
        spinner.wait()
    assert 1 <= n <= max(1, cores - 1)


def test_environment_wins(monkeypatch):
    monkeypatch.setenv("CLOVER_GGUF_THREADS", "3")
    assert util.default_threads() == 3


def test_busy_cores_reads_proc_stat():
    busy = util._busy_cores(0.05)
    assert busy is not None and 0.0 <= busy <= (os.cpu_count() or 1) + 1e-6
