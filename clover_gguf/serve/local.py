"""`clover-gguf serve` in a subprocess on a free loopback port (for the agent benchmark and tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from ..outputs import open_log
from ..util import REPO_ROOT
from . import ServeError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """`with LocalServer(gguf, "-t", "1") as srv:` srv.url is http://127.0.0.1:PORT, up and healthy.
    Leaving the block sends SIGTERM (in-flight requests finish) and waits for the exit."""

    def __init__(self, gguf, *args: str, log_path: str | Path | None = None, startup_timeout: float = 120.0):
        self.gguf, self.args = str(gguf), [str(a) for a in args]
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 3000) -> str:
        if self.log_path and self.log_path.exists():
            return self.log_path.read_text(errors="replace")[-n:]
        return ""

    def start(self) -> LocalServer:
        self.port = free_port()
        cmd = [sys.executable, "-m", "clover_gguf.cli", "serve", self.gguf, "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), *self.args]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
        self._log = open_log(self.log_path) if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServeError(f"clover-gguf serve exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise ServeError(f"clover-gguf serve did not answer /health in {self.startup_timeout:.0f} s: {self.log_tail()}")

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, then wait (SIGKILL after `timeout`). Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
        self._log = None
        return self.proc.returncode

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
