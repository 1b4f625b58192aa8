"""What scripts/agents_check.py and scripts/frameworks_check.py share: running commands, finding
a Python and the server's command, describing the checked-out state, reading SSE, and the base
of their recording proxies' request handlers. Standard library only (frameworks_check.py runs
itself inside the frameworks' own venvs)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import socket
import subprocess
import sys
from http.server import BaseHTTPRequestHandler
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_quiet(cmd: list[str], timeout: float = 1800, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def python_version(exe: str) -> tuple[int, int] | None:
    try:
        out = run_quiet([exe, "-c", "import sys; print(sys.version_info[0], sys.version_info[1])"], timeout=30)
        major, minor = out.stdout.split()
        return int(major), int(minor)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def clover_gguf_bin() -> str:
    here = Path(sys.executable).parent / "clover-gguf"
    return str(here) if here.exists() else (shutil.which("clover-gguf") or "clover-gguf")


def git_describe() -> str:
    """HEAD, and when clover_gguf/ has uncommitted changes, a digest of them (which state was served)."""
    try:
        head = run_quiet(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, timeout=30).stdout.strip()
        dirty = run_quiet(["git", "status", "--porcelain", "--", "clover_gguf"], cwd=REPO, timeout=30).stdout.strip()
        if not dirty:
            return head
        # a digest of the diff and of the untracked files
        h = hashlib.sha256(
            run_quiet(["git", "diff", "HEAD", "--", "clover_gguf"], cwd=REPO, timeout=60).stdout.encode()
        )
        for line in sorted(dirty.splitlines()):
            if line.startswith("??"):
                path = REPO / line[3:]
                for f in sorted(path.rglob("*")) if path.is_dir() else [path]:
                    if f.is_file() and "__pycache__" not in f.parts:
                        h.update(str(f.relative_to(REPO)).encode() + f.read_bytes())
        return f"{head} + uncommitted changes under clover_gguf/ (state {h.hexdigest()[:12]})"
    except (OSError, subprocess.SubprocessError):
        return "?"


def parse_sse(data: bytes) -> list[tuple[str | None, object]]:
    """(event name, payload: JSON when it parses, else the text) of each SSE event with data."""
    events = []
    for raw in re.split(r"\r?\n\r?\n", data.decode("utf-8", "replace")):
        name, lines = None, []
        for line in raw.splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                lines.append(line[5:].lstrip(" "))
        if not lines:
            continue
        text = "\n".join(lines)
        try:
            payload: object = json.loads(text)
        except ValueError:
            payload = text
        events.append((name, payload))
    return events


class QuietHandler(BaseHTTPRequestHandler):
    """A proxy's request handler: HTTP/1.1, no access log, a client closing a kept-alive
    connection is no error, and the request body read whole (Content-Length or chunked)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        pass

    def handle(self) -> None:
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            super().handle()

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""
