#!/usr/bin/env python3
"""Run real coding agents against `clover-gguf serve`, behind a recording reverse proxy.

Each agent (Claude Code, Codex CLI, opencode, Qwen Code, aider, mini-swe-agent, OpenHands SDK)
is installed from its registry into a cache folder (reused when present), configured at the
proxy's base URL with the server's API key, and given one task in a throwaway git repository
(a `calc.py` whose `add` is wrong and a `test_calc.py`). The proxy forwards every request to
the server (SSE streamed through chunk by chunk) and logs each exchange: route, status, sizes,
whether the request carried tool results back to the model (OpenAI: a `tool` message;
Anthropic: a `tool_result` block; Responses: a `function_call_output` item), and the usage the
server returned (prompt and cached tokens; for SSE the final usage event).

The table (agent and version, routes and statuses, tool executed, exit code, cached tokens on
turn 2, request count, first-request size, tests after the run) is written as JSON + Markdown
(evaldata/agents/agents.json, agents.md). Usually run through scripts/agents_check.sh:

    scripts/agents_check.sh                          # every agent, clover-tiny-v3-wip Q8_0
    scripts/agents_check.sh --only opencode,aider --timeout 300 --keep out/agents
    scripts/agents_check.sh --model out/tiny.gguf --threads 1 --ctx 65536

Only the standard library is used (the project's venv provides `clover-gguf`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gzip
import http.client
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zlib
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path

from check_common import (
    REPO,
    QuietHandler,
    clover_gguf_bin,
    free_port,
    git_describe,
    parse_sse,
    python_version,
    run_quiet,
)

DEFAULT_MODEL_DIR = REPO / "models" / "clover-tiny-v3-wip"
TASK = "Read calc.py and fix the bug in add so that test_calc.py passes"
MODEL_NAME = "clover"  # what every agent is told the model is called (the server answers any name)

AGENT_ORDER = ["claude-code", "codex", "opencode", "qwen-code", "aider", "mini-swe-agent", "openhands"]
ALIASES = {"claude": "claude-code", "qwen": "qwen-code", "mini": "mini-swe-agent", "openhands-sdk": "openhands"}

# npm agents: package, binary name under node_modules/.bin
NPM_AGENTS = {
    "claude-code": ("@anthropic-ai/claude-code", "claude"),
    "codex": ("@openai/codex", "codex"),
    "opencode": ("opencode-ai", "opencode"),
    "qwen-code": ("@qwen-code/qwen-code", "qwen"),
}
# pip agents: venv folder, packages, distribution whose version is reported, Python range
PIP_AGENTS = {
    "aider": ("venv-aider", ["aider-chat"], "aider-chat", (3, 10), (3, 12)),
    "mini-swe-agent": ("venv-mini", ["mini-swe-agent"], "mini-swe-agent", (3, 10), (3, 13)),
    "openhands": ("venv-openhands", ["openhands-sdk", "openhands-tools"], "openhands-sdk", (3, 12), (3, 13)),
}

HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "trailers",
    "transfer-encoding",
    "upgrade",
}

SANDBOX_FILES = {
    "calc.py": '''"""A small calculator."""


def add(a, b):
    """Return the sum of a and b."""
    return a - b


def mul(a, b):
    """Return the product of a and b."""
    return a * b
''',
    "test_calc.py": """import unittest

from calc import add, mul


class CalcTest(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)
        self.assertEqual(add(-1, 1), 0)

    def test_mul(self):
        self.assertEqual(mul(2, 3), 6)


if __name__ == "__main__":
    unittest.main()
""",
    "text_utils.py": '''"""String helpers."""


def slugify(text):
    """Lower-case words joined by dashes."""
    return "-".join(text.lower().split())
''',
    "README.md": "# calc\n\nA tiny calculator. Run the tests with `python -m unittest` (or `pytest`).\n",
}

# The script the OpenHands run executes (the SDK has no CLI of its own): its documented
# quick start, LLM(model="openai/...", base_url=..., api_key=...) with the default tools.
OPENHANDS_SCRIPT = """import json
import os
import sys

from pydantic import SecretStr

from openhands.sdk import LLM, Agent, Conversation, Tool
from openhands.tools.file_editor import FileEditorTool
from openhands.tools.task_tracker import TaskTrackerTool
from openhands.tools.terminal import TerminalTool

llm = LLM(
    model=os.environ["CLOVER_MODEL"],
    base_url=os.environ["CLOVER_BASE_URL"],
    api_key=SecretStr(os.environ["CLOVER_API_KEY"]),
    usage_id="agent",
)
agent = Agent(
    llm=llm,
    tools=[Tool(name=TerminalTool.name), Tool(name=FileEditorTool.name), Tool(name=TaskTrackerTool.name)],
)
conversation = Conversation(
    agent=agent, workspace=os.getcwd(), max_iteration_per_run=int(os.environ["CLOVER_MAX_ITERATIONS"])
)
conversation.send_message(sys.argv[1])
conversation.run()
status = str(conversation.state.execution_status).rsplit(".", 1)[-1].lower()
print("AGENTS_CHECK_RESULT " + json.dumps({"execution_status": status}))
sys.exit(0 if status == "finished" else 3)
"""


def log(msg: str) -> None:
    print(f"[agents_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07|\r", "", text)


def tail(text: str, n: int = 1500) -> str:
    text = strip_ansi(text)
    return text if len(text) <= n else "..." + text[-n:]


# ---------------------------------------------------------------------------------------------
# request / response analysis


def api_of(path: str) -> str:
    route = path.split("?", 1)[0].rstrip("/")
    if route.endswith("/messages/count_tokens"):
        return "anthropic-count-tokens"
    if route.endswith("/messages"):
        return "anthropic"
    if route.endswith("/chat/completions"):
        return "chat"
    if route.endswith("/responses"):
        return "responses"
    if route.endswith("/completions"):
        return "completions"
    return "other"


def tool_results_in(api: str, body: object) -> int:
    """How many tool results the request sends back to the model."""
    if not isinstance(body, dict):
        return 0
    n = 0
    if api == "chat":
        for m in body.get("messages") or []:
            if isinstance(m, dict) and m.get("role") in ("tool", "function"):
                n += 1
    elif api in ("anthropic", "anthropic-count-tokens"):
        for m in body.get("messages") or []:
            if isinstance(m, dict) and isinstance(m.get("content"), list):
                n += sum(1 for b in m["content"] if isinstance(b, dict) and b.get("type") == "tool_result")
    elif api == "responses":
        items = body.get("input")
        if isinstance(items, list):
            for it in items:
                if isinstance(it, dict) and str(it.get("type", "")).endswith("_output"):
                    n += 1  # function_call_output, custom_tool_call_output, local_shell_call_output, ...
    return n


def tool_summary(body: object) -> dict:
    tools = body.get("tools") if isinstance(body, dict) else None
    if not isinstance(tools, list):
        return {"count": 0, "types": {}, "bytes": 0}
    types: dict[str, int] = {}
    for t in tools:
        kind = str(t.get("type", "(none)")) if isinstance(t, dict) else "?"
        types[kind] = types.get(kind, 0) + 1
    return {"count": len(tools), "types": types, "bytes": len(json.dumps(tools))}


def _get(d: object, *keys):
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def normalize_usage(api: str, usage: object) -> dict | None:
    if not isinstance(usage, dict):
        return None
    if api == "chat" or api == "completions":
        return {
            "input_tokens": usage.get("prompt_tokens"),
            "cached_tokens": _get(usage, "prompt_tokens_details", "cached_tokens"),
            "output_tokens": usage.get("completion_tokens"),
        }
    if api in ("anthropic", "anthropic-count-tokens"):
        return {
            "input_tokens": usage.get("input_tokens"),
            "cached_tokens": usage.get("cache_read_input_tokens"),
            "cache_creation_input_tokens": usage.get("cache_creation_input_tokens"),
            "output_tokens": usage.get("output_tokens"),
        }
    if api == "responses":
        return {
            "input_tokens": usage.get("input_tokens"),
            "cached_tokens": _get(usage, "input_tokens_details", "cached_tokens"),
            "output_tokens": usage.get("output_tokens"),
        }
    return None


def analyze_response(api: str, content_type: str, data: bytes) -> dict:
    """Usage, the final usage event (SSE), stop reason, tool calls and errors of one response."""
    out: dict = {"sse": "text/event-stream" in content_type}
    if out["sse"]:
        events = parse_sse(data)
        kinds: dict[str, int] = {}
        usage = None
        final_event = None
        calls = 0
        stop = None
        for name, ev in events:
            kind = (
                name or (ev.get("type") if isinstance(ev, dict) else None) or ("[DONE]" if ev == "[DONE]" else "data")
            )
            kinds[kind] = kinds.get(kind, 0) + 1
            if not isinstance(ev, dict):
                continue
            if api == "chat":
                if ev.get("usage"):
                    usage, final_event = ev["usage"], {"event": "chunk with usage", "usage": ev["usage"]}
                for ch in ev.get("choices") or []:
                    calls += len(_get(ch, "delta", "tool_calls") or [])
                    stop = ch.get("finish_reason") or stop
                if ev.get("error"):
                    out["error"] = ev["error"]
            elif api == "anthropic":
                t = ev.get("type")
                if t == "message_start":
                    usage = dict(_get(ev, "message", "usage") or {})
                elif t == "message_delta":
                    usage = {**(usage or {}), **(ev.get("usage") or {})}
                    final_event = {"event": "message_delta", "usage": ev.get("usage")}
                    stop = _get(ev, "delta", "stop_reason") or stop
                elif t == "content_block_start" and _get(ev, "content_block", "type") in (
                    "tool_use",
                    "server_tool_use",
                ):
                    calls += 1
                elif t == "error":
                    out["error"] = ev.get("error")
            elif api == "responses":
                t = ev.get("type", name)
                if t in ("response.completed", "response.incomplete", "response.failed", "response.done"):
                    usage = _get(ev, "response", "usage")
                    final_event = {"event": t, "usage": usage}
                    stop = _get(ev, "response", "status")
                    if _get(ev, "response", "error"):
                        out["error"] = _get(ev, "response", "error")
                elif t == "response.output_item.done" and str(_get(ev, "item", "type")).endswith("_call"):
                    calls += 1
                elif t == "error":
                    out["error"] = ev
        out.update(events=kinds, usage_raw=usage, final_usage_event=final_event, tool_calls=calls, stop=stop)
    else:
        try:
            body = json.loads(data) if data else None
        except ValueError:
            body = None
            out["body_text"] = data[:300].decode("utf-8", "replace")
        if isinstance(body, dict):
            if api == "anthropic-count-tokens":
                out["usage_raw"] = {"input_tokens": body.get("input_tokens")}
            else:
                out["usage_raw"] = body.get("usage")
            if body.get("error"):
                out["error"] = body["error"]
            if api == "chat":
                ch = (body.get("choices") or [{}])[0]
                out["tool_calls"] = len(_get(ch, "message", "tool_calls") or [])
                out["stop"] = ch.get("finish_reason")
            elif api == "anthropic":
                out["tool_calls"] = sum(1 for b in body.get("content") or [] if _get(b, "type") == "tool_use")
                out["stop"] = body.get("stop_reason")
            elif api == "responses":
                out["tool_calls"] = sum(1 for it in body.get("output") or [] if str(_get(it, "type")).endswith("_call"))
                out["stop"] = body.get("status")
    out["usage"] = normalize_usage(api, out.get("usage_raw"))
    return out


def decode_body(raw: bytes, encoding: str) -> object:
    enc = (encoding or "").lower().strip()
    try:
        if enc == "gzip":
            raw = gzip.decompress(raw)
        elif enc == "deflate":
            raw = zlib.decompress(raw)
        elif enc not in ("", "identity"):
            return {"_undecoded": f"content-encoding {enc}"}
        return json.loads(raw) if raw else None
    except (ValueError, OSError, zlib.error):
        return {"_undecoded": "not JSON"}


# ---------------------------------------------------------------------------------------------
# the recording reverse proxy


class RecordingProxy(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int, upstream_port: int, log_dir: Path | None):
        super().__init__(("127.0.0.1", port), ProxyHandler)
        self.upstream_port = upstream_port
        self.log_dir = log_dir
        self.lock = threading.Lock()
        self.exchanges: list[dict] = []
        self.counter = 0
        self.agent = ""

    def reset(self, agent: str, upstream_port: int, log_dir: Path | None) -> None:
        with self.lock:
            self.agent, self.upstream_port, self.log_dir = agent, upstream_port, log_dir
            self.exchanges, self.counter = [], 0
        if log_dir:
            (log_dir / "bodies").mkdir(parents=True, exist_ok=True)

    def next_id(self) -> int:
        with self.lock:
            self.counter += 1
            return self.counter

    def record(self, ex: dict, req_body: bytes, resp_body: bytes) -> None:
        with self.lock:
            self.exchanges.append(ex)
            log_dir = self.log_dir
        if log_dir:
            with open(log_dir / "proxy.jsonl", "a") as f:
                f.write(json.dumps(ex) + "\n")
            n = ex["n"]
            if req_body:
                (log_dir / "bodies" / f"{n:03d}-request.json").write_bytes(req_body)
            if resp_body:
                (log_dir / "bodies" / f"{n:03d}-response.txt").write_bytes(resp_body)


class ProxyHandler(QuietHandler):
    server: RecordingProxy

    def _forward(self) -> None:
        n = self.server.next_id()
        t0 = time.time()
        body = self._read_body()
        api = api_of(self.path)
        parsed = decode_body(body, self.headers.get("Content-Encoding", "")) if body else None
        hdrs = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP | {"host", "content-length"}}
        hdrs["Accept-Encoding"] = "identity"  # so the proxy can read what it forwards
        if body or self.command in ("POST", "PUT", "PATCH"):
            hdrs["Content-Length"] = str(len(body))
        ex: dict = {
            "n": n,
            "agent": self.server.agent,
            "time": round(t0, 3),
            "method": self.command,
            "path": self.path,
            "route": f"{self.command} {self.path.split('?', 1)[0]}",
            "api": api,
            "request_bytes": len(body),
            "auth": "x-api-key"
            if self.headers.get("x-api-key")
            else ("bearer" if self.headers.get("Authorization", "").lower().startswith("bearer") else "none"),
            "user_agent": self.headers.get("User-Agent"),
            "anthropic_version": self.headers.get("anthropic-version"),
            "anthropic_beta": self.headers.get("anthropic-beta"),
        }
        if isinstance(parsed, dict):
            ex.update(
                fields=sorted(parsed.keys()),
                model=parsed.get("model"),
                stream=parsed.get("stream"),
                max_tokens=parsed.get("max_tokens", parsed.get("max_output_tokens")),
                messages=len(parsed.get("messages") or parsed.get("input") or []),
                tools=tool_summary(parsed),
                tool_results=tool_results_in(api, parsed),
            )
            ex["carries_tool_results"] = ex["tool_results"] > 0
        resp_data = bytearray()
        upstream = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=3600)
        try:
            upstream.request(self.command, self.path, body=body if body else None, headers=hdrs)
            resp = upstream.getresponse()
        except OSError as e:
            ex.update(status=502, error=f"upstream: {e!r}", seconds=round(time.time() - t0, 3))
            msg = json.dumps({"error": {"message": f"agents_check proxy: upstream unreachable: {e}", "type": "proxy"}})
            self._send_simple(502, msg.encode())
            self.server.record(ex, body, b"")
            upstream.close()
            return
        ex["status"] = resp.status
        ctype = resp.getheader("Content-Type", "")
        self.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in HOP_BY_HOP | {"content-length", "server", "date"}:
                self.send_header(k, v)
        length = resp.getheader("Content-Length")
        disconnected = False
        try:
            if self.command == "HEAD":
                if length is not None:
                    self.send_header("Content-Length", length)
                self.end_headers()
                resp.read()
            elif length is not None and resp.getheader("Transfer-Encoding") is None:
                data = resp.read()
                resp_data += data
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                self.wfile.flush()
            else:  # stream through (SSE), re-chunked, chunk by chunk as it comes
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.wfile.flush()
                while True:
                    chunk = resp.read1(65536)
                    if not chunk:
                        break
                    resp_data += chunk
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            disconnected = True  # the agent went away; closing upstream cancels the generation
            self.close_connection = True
        except (OSError, http.client.HTTPException) as e:
            ex["error"] = f"upstream stream: {e!r}"
            self.close_connection = True
        finally:
            upstream.close()
        ex["seconds"] = round(time.time() - t0, 3)
        ex["response_bytes"] = len(resp_data)
        ex["client_disconnected"] = disconnected
        info = analyze_response(api, ctype, bytes(resp_data))
        for k in ("sse", "usage", "usage_raw", "final_usage_event", "tool_calls", "stop", "events"):
            if k in info:
                ex[k] = info[k]
        if resp.status >= 400 or "error" in info:
            ex["error"] = (
                info.get("error") or info.get("body_text") or bytes(resp_data[:400]).decode("utf-8", "replace")
            )
        self.server.record(ex, body, bytes(resp_data))

    def _send_simple(self, status: int, data: bytes) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _forward


# ---------------------------------------------------------------------------------------------
# installing the agents


def find_python(lo: tuple[int, int], hi: tuple[int, int], explicit: str | None = None) -> str | None:
    """A Python interpreter in [lo, hi] (not a venv's): explicit, this one's base, PATH, pyenv."""
    cands: list[str] = []
    if explicit:
        cands.append(explicit)
    cands.append(getattr(sys, "_base_executable", sys.executable))
    for minor in range(lo[1], hi[1] + 1):  # the oldest fitting minor first (the agents' tested ones)
        exe = shutil.which(f"python{lo[0]}.{minor}")
        if exe:
            cands.append(exe)
        pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
        if pyenv.is_dir():
            for d in sorted(pyenv.glob(f"{lo[0]}.{minor}.*")):
                if (d / "bin" / "python").exists():
                    cands.append(str(d / "bin" / "python"))
    for exe in cands:
        v = python_version(exe)
        if v and lo <= v <= hi:
            return exe
    return None


@dataclass
class Installed:
    ok: bool
    version: str = ""
    install: str = ""
    reason: str = ""
    paths: dict = field(default_factory=dict)


def install_npm_agent(agent: str, adir: Path, no_install: bool) -> Installed:
    pkg, binname = NPM_AGENTS[agent]
    prefix = adir / "npm"
    binpath = prefix / "node_modules" / ".bin" / binname
    cmd = ["npm", "install", "--prefix", str(prefix), "--no-fund", "--no-audit", pkg]
    shown = f"npm install --prefix {prefix} {pkg}"

    def version() -> str | None:
        try:
            out = run_quiet([str(binpath), "--version"], timeout=120)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else None

    v = version() if binpath.exists() else None
    if v is None and not no_install:
        if not shutil.which("npm"):
            return Installed(False, install=shown, reason="npm not found")
        log(f"installing {agent}: {shown}")
        out = run_quiet(cmd)
        if out.returncode != 0:
            return Installed(False, install=shown, reason=f"npm install failed: {tail(out.stderr, 600)}")
        v = version()
        if v is None and agent == "claude-code":
            # npm >= 11 may leave the native binary's postinstall unrun (allowScripts): run it
            run_quiet(["node", "install.cjs"], cwd=prefix / "node_modules" / pkg, timeout=300)
            v = version()
    if v is None:
        return Installed(False, install=shown, reason=f"{binpath} does not run (`--version` failed)")
    return Installed(True, version=v, install=shown, paths={"bin": str(binpath)})


def install_pip_agent(agent: str, adir: Path, no_install: bool, python312: str | None) -> Installed:
    venv_name, pkgs, dist, lo, hi = PIP_AGENTS[agent]
    venv = adir / venv_name
    py = venv / "bin" / "python"
    shown = f"python{lo[0]}.{lo[1]}+ -m venv {venv} && {venv}/bin/pip install {' '.join(pkgs)}"

    def version() -> str | None:
        if not py.exists():
            return None
        try:
            out = run_quiet([str(py), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"], timeout=60)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    v = version()
    if v is None and not no_install:
        base = find_python(lo, hi, python312 if agent == "openhands" else None)
        if base is None:
            return Installed(False, install=shown, reason=f"no Python {lo[0]}.{lo[1]}-{hi[0]}.{hi[1]} found")
        shown = f"{base} -m venv {venv} && {venv}/bin/pip install {' '.join(pkgs)}"
        log(f"installing {agent}: {shown}")
        out = run_quiet([base, "-m", "venv", str(venv)])
        if out.returncode != 0:
            return Installed(False, install=shown, reason=f"venv failed: {tail(out.stderr, 600)}")
        out = run_quiet([str(py), "-m", "pip", "install", "--quiet", *pkgs], timeout=3600)
        if out.returncode != 0:
            return Installed(False, install=shown, reason=f"pip install failed: {tail(out.stderr, 800)}")
        v = version()
    if v is None:
        return Installed(False, install=shown, reason=f"{venv} has no {dist}")
    return Installed(True, version=v, install=shown, paths={"venv": str(venv)})


def install_agent(agent: str, adir: Path, args) -> Installed:
    if agent in NPM_AGENTS:
        return install_npm_agent(agent, adir, args.no_install)
    return install_pip_agent(agent, adir, args.no_install, args.python312)


# ---------------------------------------------------------------------------------------------
# the server


def default_model(adir: Path) -> Path:
    out = adir / "clover-tiny-v3-wip-q8_0.gguf"
    src = DEFAULT_MODEL_DIR / "model.safetensors"
    if out.exists() and (not src.exists() or out.stat().st_mtime >= src.stat().st_mtime):
        return out
    cmd = [clover_gguf_bin(), "convert", str(DEFAULT_MODEL_DIR), "-o", str(out), "--experts", "q8_0", "--force", "-q"]
    log("converting the default model: " + shlex.join(cmd))
    subprocess.run(cmd, check=True)
    return out


class Server:
    def __init__(self, args, model: Path, log_path: Path):
        self.port = free_port()
        self.cmd = [
            clover_gguf_bin(),
            "serve",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--api-key",
            args.api_key,
            "-t",
            str(args.threads),
            "-c",
            str(args.ctx),
            "-n",
            str(args.n_predict),
            "--alias",
            MODEL_NAME,
        ]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.key = args.api_key

    def shown_cmd(self) -> str:
        cmd = ["clover-gguf", *self.cmd[1:]]
        cmd[cmd.index("--port") + 1] = "$PORT"
        cmd[cmd.index("--api-key") + 1] = "$KEY"
        model = Path(cmd[2])
        with contextlib.suppress(ValueError):
            cmd[2] = "~/" + str(model.relative_to(Path.home()))
        return " ".join(x if x in ("$PORT", "$KEY") or x.startswith("~/") else shlex.quote(x) for x in cmd)

    def start(self) -> None:
        self.logf = open(self.log_path, "a")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.cmd, stdout=self.logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: see {self.log_path}")
            if self.healthy():
                return
            time.sleep(0.5)
        raise RuntimeError(f"server not healthy after 180 s: see {self.log_path}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def props(self) -> dict | None:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/props", headers={"Authorization": f"Bearer {self.key}"}
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if getattr(self, "logf", None):
            self.logf.close()


# ---------------------------------------------------------------------------------------------
# the agents' configurations and command lines


def make_sandbox(path: Path) -> str:
    path.mkdir(parents=True)
    for name, text in SANDBOX_FILES.items():
        (path / name).write_text(text)
    git = [
        "git",
        "-c",
        "user.name=agents-check",
        "-c",
        "user.email=agents-check@localhost",
        "-c",
        "commit.gpgsign=false",
    ]
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=path, check=True)
    subprocess.run([*git, "add", "-A"], cwd=path, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "calc with a bug"], cwd=path, check=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True).stdout.strip()


@dataclass
class Plan:
    cmd: list[str]
    env: dict
    files: dict  # path -> text written before the run (configuration)
    shown_env: dict  # what the docs show (key as $KEY)


def plan_agent(agent: str, inst: Installed, proxy_url: str, key: str, home: Path, sandbox: Path, args) -> Plan:
    """Configuration and command of one agent, pointed at proxy_url (http://127.0.0.1:PORT)."""
    v1 = proxy_url + "/v1"
    steps = str(args.max_steps)
    env: dict = {}
    files: dict = {}
    if agent == "claude-code":
        env = {
            "ANTHROPIC_BASE_URL": proxy_url,
            "ANTHROPIC_API_KEY": key,
            "ANTHROPIC_MODEL": MODEL_NAME,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL_NAME,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        }
        cmd = [inst.paths["bin"], "-p", TASK, "--output-format", "json", "--max-turns", steps]
        cmd += ["--permission-mode", "acceptEdits", "--allowedTools", "Bash,Read,Edit,Write,Glob,Grep"]
    elif agent == "codex":
        codex_home = home / ".codex"
        files[codex_home / "config.toml"] = (
            f'model = "{MODEL_NAME}"\n'
            'model_provider = "clover"\n\n'
            "[model_providers.clover]\n"
            'name = "clover-gguf serve"\n'
            f'base_url = "{v1}"\n'
            'env_key = "CLOVER_API_KEY"\n'
            'wire_api = "responses"\n'
        )
        env = {"CODEX_HOME": str(codex_home), "CLOVER_API_KEY": key}
        cmd = [inst.paths["bin"], "exec", "--skip-git-repo-check", "--sandbox", "workspace-write", TASK]
    elif agent == "opencode":
        conf = {
            "$schema": "https://opencode.ai/config.json",
            "provider": {
                "clover": {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "Clover (clover-gguf serve)",
                    "options": {"baseURL": v1, "apiKey": "{env:CLOVER_API_KEY}"},
                    "models": {
                        MODEL_NAME: {
                            "name": "Clover",
                            "tool_call": True,
                            "limit": {"context": args.ctx, "output": args.n_predict},
                        }
                    },
                }
            },
            "model": f"clover/{MODEL_NAME}",
            "small_model": f"clover/{MODEL_NAME}",
            "agent": {"build": {"steps": args.max_steps}},
            "autoupdate": False,
            "share": "disabled",
        }
        path = home / ".config" / "opencode" / "opencode.json"
        files[path] = json.dumps(conf, indent=2) + "\n"
        env = {"OPENCODE_CONFIG": str(path), "CLOVER_API_KEY": key, "OPENCODE_DISABLE_MODELS_FETCH": "1"}
        cmd = [inst.paths["bin"], "run", "--auto", TASK]
    elif agent == "qwen-code":
        env = {"OPENAI_BASE_URL": v1, "OPENAI_API_KEY": key, "OPENAI_MODEL": MODEL_NAME}
        cmd = [inst.paths["bin"], "--yolo", "--auth-type", "openai", "--max-session-turns", steps, TASK]
    elif agent == "aider":
        env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}
        cmd = [f"{inst.paths['venv']}/bin/aider", "--model", f"openai/{MODEL_NAME}", "--openai-api-base", v1]
        cmd += ["--openai-api-key", key, "--message", TASK, "--yes-always", "--no-check-update"]
        cmd += ["--analytics-disable", "--no-show-model-warnings", "calc.py", "test_calc.py"]
    elif agent == "mini-swe-agent":
        env = {
            "MSWEA_CONFIGURED": "true",
            "MSWEA_COST_TRACKING": "ignore_errors",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        }
        cmd = [f"{inst.paths['venv']}/bin/mini", "-m", f"openai/{MODEL_NAME}", "-t", TASK, "-y", "--exit-immediately"]
        cmd += ["-c", "mini.yaml", "-c", f"model.model_kwargs.api_base={v1}", "-c", f"model.model_kwargs.api_key={key}"]
        cmd += ["-c", f"agent.step_limit={steps}", "-o", str(home / "trajectory.json")]
    elif agent == "openhands":
        script = home / "run_openhands.py"
        files[script] = OPENHANDS_SCRIPT
        env = {
            "CLOVER_MODEL": f"openai/{MODEL_NAME}",
            "CLOVER_BASE_URL": v1,
            "CLOVER_API_KEY": key,
            "CLOVER_MAX_ITERATIONS": steps,
        }
        cmd = [f"{inst.paths['venv']}/bin/python", str(script), TASK]
    else:
        raise ValueError(agent)
    shown = {k: ("$KEY" if v == key else v) for k, v in env.items()}
    return Plan(cmd=cmd, env=env, files=files, shown_env=shown)


def agent_env(home: Path, extra: dict, npm_bin: Path) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OPENAI_", "ANTHROPIC_", "CLAUDE_", "CODEX_", "OPENCODE_", "QWEN_", "XDG_", "LITELLM_"))
        and k not in ("VIRTUAL_ENV", "PYTHONPATH", "MSWEA_CONFIGURED", "CLOVER_GGUF_API_KEY")
    }
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and not p.startswith(str(REPO / ".venv"))]
    env["PATH"] = os.pathsep.join([str(npm_bin), *path])
    env["HOME"] = str(home)
    env.update(extra)
    return env


def run_agent_process(plan: Plan, sandbox: Path, log_path: Path, timeout: float) -> tuple[int | None, bool, float]:
    t0 = time.time()
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            plan.cmd,
            cwd=sandbox,
            env=plan.env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        timed_out = False
        try:
            rc: int | None = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(15)
            rc = None
        # children the agent left behind in its session (shells, language servers)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    return rc, timed_out, time.time() - t0


def check_sandbox(sandbox: Path, base_commit: str) -> dict:
    git = ["git", "-c", "core.quotepath=off"]
    changed = subprocess.run(
        [*git, "diff", "--name-only", base_commit], cwd=sandbox, capture_output=True, text=True
    ).stdout.split()
    untracked = subprocess.run(
        [*git, "ls-files", "--others", "--exclude-standard"], cwd=sandbox, capture_output=True, text=True
    ).stdout.split()
    commits = subprocess.run(
        [*git, "rev-list", "--count", f"{base_commit}..HEAD"], cwd=sandbox, capture_output=True, text=True
    ).stdout.strip()
    try:
        t = subprocess.run(
            [sys.executable, "-m", "unittest", "-q", "test_calc"],
            cwd=sandbox,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        )
        tests_pass = t.returncode == 0
    except subprocess.TimeoutExpired:
        tests_pass = False
    diff = subprocess.run([*git, "diff", base_commit, "--", "calc.py"], cwd=sandbox, capture_output=True, text=True)
    return {
        "files_changed": sorted(set(changed)),
        "files_added": sorted(untracked),
        "commits_by_agent": int(commits or 0),
        "tests_pass": tests_pass,
        "calc_diff": diff.stdout[-1500:],
    }


def agent_status(agent: str, output: str, home: Path) -> dict:
    """What the agent itself says about how the run ended."""
    st: dict = {}
    if agent == "claude-code":
        for line in reversed(output.splitlines()):
            line = line.strip()
            if line.startswith("{") and '"type":"result"' in line.replace(" ", ""):
                with contextlib.suppress(ValueError):
                    r = json.loads(line)
                    st = {
                        k: r.get(k) for k in ("subtype", "is_error", "num_turns", "terminal_reason", "api_error_status")
                    }
                    st["result"] = str(r.get("result"))[:300]
                break
    elif agent == "mini-swe-agent":
        traj = home / "trajectory.json"
        if traj.exists():
            with contextlib.suppress(ValueError):
                info = json.loads(traj.read_text()).get("info", {})
                st = {"exit_status": info.get("exit_status"), "submission": str(info.get("submission"))[:300]}
    elif agent == "openhands":
        m = re.findall(r"AGENTS_CHECK_RESULT (\{.*\})", output)
        if m:
            with contextlib.suppress(ValueError):
                st = json.loads(m[-1])
    return st


def server_stats(props: dict | None) -> dict | None:
    stats = props.get("stats") if isinstance(props, dict) else None
    if not isinstance(stats, dict):
        return None
    keys = ("requests", "cancelled", "errors", "server_errors", "prefill_tokens", "reused_tokens", "completion_tokens")
    out = {k: stats.get(k) for k in keys}
    out["cache"] = stats.get("cache")
    return out


def summarize(exchanges: list[dict]) -> dict:
    routes: dict[str, dict[str, int]] = {}
    for ex in exchanges:
        st = str(ex.get("status"))
        routes.setdefault(ex["route"], {})
        routes[ex["route"]][st] = routes[ex["route"]].get(st, 0) + 1
    model_reqs = [ex for ex in exchanges if ex["api"] in ("chat", "anthropic", "responses", "completions")]
    with_results = [ex for ex in model_reqs if ex.get("carries_tool_results")]
    turn2 = with_results[0] if with_results else (model_reqs[1] if len(model_reqs) > 1 else None)
    first = model_reqs[0] if model_reqs else None
    first_tools = next((ex for ex in model_reqs if (ex.get("tools") or {}).get("count")), None)
    errors = []
    for ex in exchanges:
        if ex.get("error") and len(errors) < 6:
            err = ex["error"]
            errors.append(
                f"#{ex['n']} {ex['route']} {ex.get('status')}: {json.dumps(err)[:300] if not isinstance(err, str) else err[:300]}"
            )
    return {
        "requests": len(exchanges),
        "model_requests": len(model_reqs),
        "routes": routes,
        "tool_executed": bool(with_results),
        "tool_result_requests": len(with_results),
        "model_tool_calls": sum(ex.get("tool_calls") or 0 for ex in model_reqs),
        "turn2": None
        if turn2 is None
        else {
            "n": turn2["n"],
            "how": "first request carrying tool results" if with_results else "second model request (no tool results)",
            "status": turn2.get("status"),
            "usage": turn2.get("usage"),
        },
        "cached_tokens_turn2": (turn2.get("usage") or {}).get("cached_tokens") if turn2 else None,
        "first_request": None
        if first is None
        else {
            "n": first["n"],
            "route": first["route"],
            "bytes": first["request_bytes"],
            "fields": first.get("fields"),
            "stream": first.get("stream"),
            "max_tokens": first.get("max_tokens"),
            "tools": first.get("tools"),
            "status": first.get("status"),
            "usage": first.get("usage"),
        },
        "first_request_with_tools": None
        if first_tools is None
        else {"n": first_tools["n"], "bytes": first_tools["request_bytes"], "tools": first_tools.get("tools")},
        "errors": errors,
    }


# ---------------------------------------------------------------------------------------------
# reports


def fmt_routes(routes: dict) -> str:
    parts = []
    for route, sts in routes.items():
        parts.append(f"{route} " + ", ".join(f"{s}×{n}" for s, n in sorted(sts.items())))
    return "; ".join(parts) or "none"


def fmt_exit(r: dict) -> str:
    if r.get("skipped"):
        return "skipped"
    if r.get("timed_out"):
        return f"timeout ({r['timeout_s']:.0f} s, killed)"
    s = str(r.get("exit_code"))
    st = r.get("agent_status") or {}
    extra = st.get("subtype") or st.get("exit_status") or st.get("execution_status")
    if st.get("is_error"):
        extra = f"is_error, API status {st.get('api_error_status')}"
    return f"{s} ({extra})" if extra else s


def write_reports(out_dir: Path, rows: dict, meta: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    ordered = [rows[a] for a in AGENT_ORDER if a in rows]
    (out_dir / "agents.json").write_text(json.dumps({"meta": meta, "agents": ordered}, indent=1) + "\n")
    cmds = sorted({r.get("command_line", "") for r in ordered if r.get("command_line")})
    lines = ["# Coding agents against `clover-gguf serve`", ""]
    lines += ["Made by:", "", "```sh", *cmds, "```", ""]
    lines += [
        f"Server: `{meta.get('server_command', '')}` (git {meta.get('git', '')}); model `{meta.get('model', '')}`; "
        f"{meta.get('machine', '')}. Each agent ran once, alone, in a fresh git sandbox (calc.py with a wrong `add`, "
        f'test_calc.py), with task: "{TASK}", through a recording proxy; a fresh server per agent.',
        "",
        "| agent | version | routes (status×count) | tool executed | exit | cached tokens, turn 2 | requests | "
        "first request | tests pass after | date |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ordered:
        if r.get("skipped"):
            lines.append(f"| {r['agent']} | {r.get('version') or '—'} | skipped: {r.get('reason', '')} | | | | | | | |")
            continue
        s = r["summary"]
        first = s.get("first_request") or {}
        fr = f"{first.get('bytes', 0):,} B" if first else "—"
        ft = s.get("first_request_with_tools")
        if ft and first and ft["n"] != first.get("n"):
            fr += f" (first with tools: {ft['bytes']:,} B)"
        tool = "yes" if s["tool_executed"] else ("n/a (no tools API)" if r["agent"] == "aider" else "no")
        if s["tool_executed"]:
            tool += f" ({s['tool_result_requests']} req.)"
        cached = s.get("cached_tokens_turn2")
        lines.append(
            f"| {r['agent']} | {r.get('version', '')} | {fmt_routes(s['routes'])} | {tool} | {fmt_exit(r)} | "
            f"{'—' if cached is None else cached} | {s['requests']} | {fr} | "
            f"{'yes' if r['sandbox']['tests_pass'] else 'no'} | {r.get('date', '')[:16]} |"
        )
    lines += [
        "",
        "Columns: *tool executed*: a request carried a tool result back to the model (OpenAI `tool` message, "
        "Anthropic `tool_result` block, Responses `*_call_output` item), i.e. the agent ran a tool the model called; "
        "aider has no tool calls (it edits from the reply's text). *exit*: the agent's own exit status (and what it "
        "reported: Claude Code's result subtype, mini-swe-agent's exit status, OpenHands' execution status); "
        "`timeout` when the harness killed it. *cached tokens, turn 2*: the usage the server returned for the first "
        "request that carried tool results (the agent loop's second turn), or for the second model request when "
        "none did (OpenAI `prompt_tokens_details.cached_tokens`, Anthropic `cache_read_input_tokens`, Responses "
        "`input_tokens_details.cached_tokens`); — when there was no such request or no usage. *first request*: "
        "the size of the first request to a model route. *tests pass after*: `python -m unittest test_calc` in the "
        "sandbox after the run (a 10M-parameter model is not expected to fix it).",
        "",
    ]
    for r in ordered:
        if r.get("skipped"):
            continue
        s = r["summary"]
        lines += [f"## {r['agent']} {r.get('version', '')}", ""]
        lines += ["```sh", r["shown_command"], "```", ""]
        first = s.get("first_request") or {}
        if first:
            t = first.get("tools") or {}
            lines.append(
                f"- first model request: {first.get('route')}, {first.get('bytes', 0):,} B, stream={first.get('stream')}, "
                f"max_tokens={first.get('max_tokens')}, {t.get('count', 0)} tools {t.get('types', {})} "
                f"({t.get('bytes', 0):,} B), fields {first.get('fields')}; answered {first.get('status')}, "
                f"usage {first.get('usage')}"
            )
        lines.append(
            f"- {s['requests']} requests ({s['model_requests']} to model routes), {s['model_tool_calls']} tool calls "
            f"returned by the model, {s['tool_result_requests']} requests carrying tool results"
        )
        if s.get("turn2"):
            lines.append(f"- turn 2 (#{s['turn2']['n']}, {s['turn2']['how']}): usage {s['turn2'].get('usage')}")
        sb = r["sandbox"]
        lines.append(
            f"- sandbox: changed {sb['files_changed'] or 'nothing'}, added {sb['files_added'] or 'nothing'}, "
            f"{sb['commits_by_agent']} commits by the agent; tests pass: {sb['tests_pass']}"
        )
        lines.append(
            f"- ran {r['seconds']:.0f} s (timeout {r['timeout_s']:.0f} s); server alive after: "
            f"{r['server_alive_after']}; load average before: {r.get('load_before')}; git {r.get('git')}"
        )
        if r.get("server_stats"):
            lines.append(f"- server counters after the run: {r['server_stats']}")
        for e in s.get("errors") or []:
            lines.append(f"- error: `{e}`")
        lines.append("")
    (out_dir / "agents.md").write_text("\n".join(lines))


# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog=os.environ.get("AGENTS_CHECK_ARGV0", "agents_check.py"),
        description="Run real coding agents against clover-gguf serve behind a recording proxy.",
    )
    ap.add_argument("--only", default="", help=f"comma-separated agents (default all: {','.join(AGENT_ORDER)})")
    ap.add_argument("--model", type=Path, help="GGUF to serve (default: models/clover-tiny-v3-wip as Q8_0)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per agent run (default 300)")
    ap.add_argument("--keep", type=Path, help="keep proxy logs, request/response bodies, sandboxes here")
    ap.add_argument("--threads", type=int, default=1, help="server threads, -t (default 1)")
    ap.add_argument("--ctx", type=int, default=65536, help="server context, -c (default 65536)")
    ap.add_argument("--n-predict", type=int, default=2048, help="server -n: most tokens of one reply (default 2048)")
    ap.add_argument("--max-steps", type=int, default=10, help="the agents' own turn/step caps where they have one")
    ap.add_argument("--api-key", default="agents-check-key", help="the server's API key (default agents-check-key)")
    ap.add_argument(
        "--agents-dir", type=Path, default=Path(os.environ.get("AGENTS_DIR") or "~/.cache/clover-gguf/agents")
    )
    ap.add_argument("--out", type=Path, default=REPO / "evaldata" / "agents", help="where agents.json/.md go")
    ap.add_argument("--no-install", action="store_true", help="use installed agents only")
    ap.add_argument("--install-only", action="store_true", help="install the agents and exit")
    ap.add_argument("--python312", help="Python >= 3.12 for the OpenHands venv (default: searched)")
    ap.add_argument("--fresh", action="store_true", help="drop earlier rows of agents.json instead of merging")
    ap.add_argument("--report-only", action="store_true", help="rewrite agents.md from agents.json and exit")
    args = ap.parse_args(argv)
    args.agents_dir = args.agents_dir.expanduser()
    names = [ALIASES.get(a.strip(), a.strip()) for a in args.only.split(",") if a.strip()] or AGENT_ORDER
    bad = [a for a in names if a not in AGENT_ORDER]
    if bad:
        ap.error(f"unknown agent(s) {bad}; known: {AGENT_ORDER}")
    args.agents = [a for a in AGENT_ORDER if a in names]
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    command_line = shlex.join([os.environ.get("AGENTS_CHECK_ARGV0", "python scripts/agents_check.py"), *argv])
    if args.report_only:
        data = json.loads((args.out / "agents.json").read_text())
        write_reports(args.out, {r["agent"]: r for r in data["agents"]}, data["meta"])
        return 0
    adir = args.agents_dir
    adir.mkdir(parents=True, exist_ok=True)
    installed = {a: install_agent(a, adir, args) for a in args.agents}
    for a, inst in installed.items():
        log(f"{a}: {inst.version if inst.ok else 'NOT AVAILABLE: ' + inst.reason}")
    if args.install_only:
        return 0 if all(i.ok for i in installed.values()) else 1

    model = (args.model or default_model(adir)).resolve()
    work = args.keep.resolve() if args.keep else Path(tempfile.mkdtemp(prefix="agents-check-"))
    work.mkdir(parents=True, exist_ok=True)
    proxy = RecordingProxy(free_port(), 0, None)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    proxy_url = f"http://127.0.0.1:{proxy.server_address[1]}"
    npm_bin = adir / "npm" / "node_modules" / ".bin"

    results_path = args.out / "agents.json"
    rows: dict = {}
    if results_path.exists() and not args.fresh:
        with contextlib.suppress(ValueError, KeyError):
            rows = {r["agent"]: r for r in json.loads(results_path.read_text())["agents"]}
    meta: dict = {
        "model": str(model.relative_to(REPO)) if model.is_relative_to(REPO) else model.name,
        "git": git_describe(),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}",
        "task": TASK,
    }
    try:
        for agent in args.agents:
            inst = installed[agent]
            date = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
            if not inst.ok:
                rows[agent] = {
                    "agent": agent,
                    "skipped": True,
                    "reason": inst.reason,
                    "install": inst.install,
                    "date": date,
                    "command_line": command_line,
                }
                continue
            adir_run = work / agent
            if adir_run.exists():
                shutil.rmtree(adir_run)
            home, sandbox = adir_run / "home", adir_run / "sandbox"
            home.mkdir(parents=True)
            base = make_sandbox(sandbox)
            server = Server(args, model, adir_run / "server.log")
            meta["server_command"] = server.shown_cmd()
            load_before = round(os.getloadavg()[0], 2)
            log(f"{agent}: starting the server ({server.shown_cmd()})")
            try:
                server.start()
                proxy.reset(agent, server.port, adir_run)
                plan = plan_agent(agent, inst, proxy_url, args.api_key, home, sandbox, args)
                for path, text in plan.files.items():
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(text)
                env = agent_env(home, plan.env, npm_bin)
                log(f"{agent} {inst.version}: running (timeout {args.timeout:.0f} s)")
                rc, timed_out, secs = run_agent_process(
                    Plan(plan.cmd, env, plan.files, plan.shown_env), sandbox, adir_run / "agent.log", args.timeout
                )
                time.sleep(1)  # let the last exchange be recorded
                alive = server.healthy()
                props = server.props() if alive else None
            except RuntimeError as e:  # the server did not start: say so, go on with the next agent
                log(f"{agent}: {e}")
                rows[agent] = {
                    "agent": agent,
                    "version": inst.version,
                    "skipped": True,
                    "reason": f"server: {e}",
                    "date": date,
                    "command_line": command_line,
                }
                continue
            finally:
                server.stop()
            output = (adir_run / "agent.log").read_text(errors="replace").replace(args.api_key, "$KEY")
            shown_cmd = " ".join(f"{k}={v if v == '$KEY' else shlex.quote(str(v))}" for k, v in plan.shown_env.items())
            shown_argv = shlex.join(plan.cmd).replace(args.api_key, "$KEY").replace(str(adir), "$AGENTS_DIR")
            shown_argv = shown_argv.replace(proxy_url, "http://127.0.0.1:$PORT")
            shown_cmd = (shown_cmd + " " + shown_argv).strip().replace(proxy_url, "http://127.0.0.1:$PORT")
            shown_cmd = shown_cmd.replace(str(home), "$HOME")
            summary = summarize(proxy.exchanges)
            row = {
                "agent": agent,
                "version": inst.version,
                "install": inst.install,
                "date": date,
                "command_line": command_line,
                "shown_command": shown_cmd,
                "config_files": {
                    str(p).replace(str(home), "$HOME"): t.replace(args.api_key, "$KEY").replace(
                        proxy_url, "http://127.0.0.1:$PORT"
                    )
                    for p, t in plan.files.items()
                },
                "exit_code": rc,
                "timed_out": timed_out,
                "timeout_s": args.timeout,
                "seconds": round(secs, 1),
                "agent_status": agent_status(agent, output, home),
                "summary": summary,
                "sandbox": check_sandbox(sandbox, base),
                "server_alive_after": alive,
                "server_command": server.shown_cmd(),
                "git": meta["git"],
                "load_before": load_before,
                "server_stats": server_stats(props),
                "output_tail": tail(output),
                "exchanges": [
                    {
                        k: ex.get(k)
                        for k in ("n", "route", "status", "request_bytes", "carries_tool_results", "usage", "stop")
                    }
                    for ex in proxy.exchanges
                ],
            }
            rows[agent] = row
            log(
                f"{agent}: exit {fmt_exit(row)}, {summary['requests']} requests, routes {fmt_routes(summary['routes'])}, "
                f"tool executed {summary['tool_executed']}, cached turn 2 {summary['cached_tokens_turn2']}, "
                f"tests pass {row['sandbox']['tests_pass']}"
            )
            write_reports(args.out, rows, meta)
    finally:
        proxy.shutdown()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    write_reports(args.out, rows, meta)
    log(f"wrote {args.out / 'agents.json'} and {args.out / 'agents.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
