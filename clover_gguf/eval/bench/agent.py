"""`clover-gguf eval agent`: replay multi-turn coding-agent traces against `clover-gguf serve`
through the `openai` client (streaming), with real tool steps between the turns, and separate
the model's time from the rest.

A trace (evaldata/agent/*.json) is a task, a workspace folder and a scripted list of tool calls
(list_files, read_file, grep, run a Python file, edit). Turn 0 asks the task; before each later
turn the next tool runs for real on a copy of the workspace and its output is appended as a
user message asking for the next action; the model's reply joins the history, so each turn
extends the last one, as in an agent loop. Each replay runs twice with the same history seed:
**cold** (`clover.cache_prompt: false`: every turn prefills its whole history) and **warm**
(state reuse on: a turn prefills what the cache does not hold). A nonce at the start of the
system message keeps replays from reusing each other's snapshots. Greedy decoding makes the
two modes' replies comparable: they must be identical.
"""

from __future__ import annotations

import difflib
import json
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ...outputs import write_json
from ...util import EVALDATA
from ..quality.metrics import spread
from ..render.agent import render_agent
from . import BenchError

AGENT_TRACES = EVALDATA / "agent"
TOOLS = ("list_files", "read_file", "grep", "run", "edit")
TOOL_OUTPUT_CHARS = 4000
RUN_TIMEOUT_S = 60


# ----------------------------------------------------------------------------- traces and tools


def load_traces(paths=None) -> list[dict]:
    """Traces from JSON files or folders of them (default evaldata/agent/)."""
    files: list[Path] = []
    for p in [Path(x) for x in (paths or [AGENT_TRACES])]:
        if p.is_dir():
            files += sorted(p.glob("*.json"))
        elif p.is_file():
            files.append(p)
        else:
            raise ValueError(f"{p}: no such trace file or folder")
    if not files:
        raise ValueError(f"no *.json traces in {', '.join(str(p) for p in paths or [AGENT_TRACES])}")
    traces = []
    for f in files:
        try:
            t = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{f}: not a JSON trace ({e})") from None
        for k in ("name", "workspace", "system", "task", "steps"):
            if k not in t:
                raise ValueError(f"{f}: missing key '{k}'")
        ws = (f.parent / t["workspace"]).resolve()
        if not ws.is_dir():
            raise ValueError(f"{f}: workspace '{t['workspace']}' is not a folder")
        for i, s in enumerate(t["steps"]):
            if s.get("tool") not in TOOLS:
                raise ValueError(f"{f}: steps[{i}].tool must be one of {', '.join(TOOLS)}")
        traces.append({**t, "workspace": ws, "file": str(f)})
    return traces


def describe(step: dict) -> str:
    args = [step[k] for k in ("path", "pattern") if k in step]
    return " ".join([step["tool"], *args])


def run_tool(step: dict, ws: Path) -> str:
    """Run one tool for real in the workspace copy `ws`; returns its output (truncated)."""
    tool = step["tool"]
    if tool == "list_files":
        out = "\n".join(
            sorted(str(p.relative_to(ws)) for p in ws.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
        )
    elif tool == "read_file":
        out = (ws / step["path"]).read_text()
    elif tool == "grep":
        hits = []
        for p in sorted(ws.rglob("*.py")):
            for i, line in enumerate(p.read_text().splitlines(), 1):
                if step["pattern"] in line:
                    hits.append(f"{p.relative_to(ws)}:{i}: {line}")
        out = "\n".join(hits) or "(no matches)"
    elif tool == "run":
        r = subprocess.run(
            [sys.executable, step["path"]], cwd=ws, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
        )
        out = f"$ python {step['path']}\n{r.stdout}{r.stderr}(exit code {r.returncode})"
    else:  # edit
        f = ws / step["path"]
        old = f.read_text()
        if step["old"] not in old:
            out = f"edit failed: the old text is not in {step['path']}"
        else:
            new = old.replace(step["old"], step["new"], 1)
            f.write_text(new)
            out = "".join(
                difflib.unified_diff(
                    old.splitlines(True), new.splitlines(True), f"a/{step['path']}", f"b/{step['path']}"
                )
            )
    # paths relative to the workspace, so that replays see the same text wherever their copy is
    return out.replace(f"{ws}/", "").replace(str(ws), ".")[-TOOL_OUTPUT_CHARS:]


def tool_message(step: dict, output: str) -> str:
    return f"Tool result ({describe(step)}):\n```\n{output}\n```\nWhat is your next action?"


# ----------------------------------------------------------------------------- replay


def chat_turn(client, model: str, messages: list[dict], max_tokens: int, clover: dict) -> dict:
    """One streamed chat request; client-side times and the server's usage."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"clover": clover, "chat_template_kwargs": {"enable_thinking": False}},
    )
    t_first, parts, usage, events, finish = None, [], None, 0, None
    for ch in stream:
        if ch.choices:
            if t_first is None:
                t_first = time.perf_counter()
            events += 1
            parts.append(ch.choices[0].delta.content or "")
            finish = ch.choices[0].finish_reason or finish
        if ch.usage is not None:
            usage = ch.usage.model_dump()
    t_end = time.perf_counter()
    if usage is None or "clover" not in usage:
        raise BenchError("the server sent no usage with clover statistics: is it `clover-gguf serve`?")
    return {"t0": t0, "t_first": t_first or t_end, "t_end": t_end, "content": "".join(parts), "usage": usage,
            "events": events, "finish_reason": finish}  # fmt: skip


def replay(client, model: str, trace: dict, cache: bool, nonce: str, max_tokens: int, clover: dict) -> dict:
    """One replay of a trace; times in the timeline are seconds from the replay's start."""
    ext = {**clover, "cache_prompt": cache}
    with tempfile.TemporaryDirectory(prefix="clover-agent-") as tmp:
        ws = Path(tmp) / "ws"
        shutil.copytree(trace["workspace"], ws)
        msgs = [
            {"role": "system", "content": f"[session {nonce}] {trace['system']}"},
            {"role": "user", "content": trace["task"]},
        ]
        turns = []
        t_run = time.perf_counter()
        for i in range(len(trace["steps"]) + 1):
            tool = None
            if i > 0:
                step = trace["steps"][i - 1]
                t0 = time.perf_counter()
                out = run_tool(step, ws)
                tool = {"call": describe(step), "start": t0 - t_run, "end": time.perf_counter() - t_run}
                msgs.append({"role": "user", "content": tool_message(step, out)})
            r = chat_turn(client, model, msgs, max_tokens, ext)
            msgs.append({"role": "assistant", "content": r["content"]})
            u, cu = r["usage"], r["usage"]["clover"]
            turns.append(
                {
                    "turn": i,
                    "tool": tool["call"] if tool else None,
                    "tool_ms": (tool["end"] - tool["start"]) * 1e3 if tool else 0.0,
                    "ttfb_ms": (r["t_first"] - r["t0"]) * 1e3,
                    "generation_ms": (r["t_end"] - r["t_first"]) * 1e3,
                    "model_ms": (r["t_end"] - r["t0"]) * 1e3,
                    "server_ms": cu["timings"],
                    "prompt_tokens": u["prompt_tokens"],
                    "prefill_tokens": cu["prefill_tokens"],
                    "reused_tokens": cu["reused_tokens"],
                    "completion_tokens": u["completion_tokens"],
                    "blocks": cu["blocks"],
                    "steps": cu["steps"],
                    "tokens_per_step": cu["tokens_per_step"],
                    "events": r["events"],
                    "finish_reason": r["finish_reason"],
                    "content": r["content"],
                    "timeline": {
                        "tool": [tool["start"], tool["end"]] if tool else None,
                        "request": [r["t0"] - t_run, r["t_first"] - t_run, r["t_end"] - t_run],
                    },
                }
            )
        wall = time.perf_counter() - t_run
    model_s = sum(t["model_ms"] for t in turns) / 1e3
    tool_s = sum(t["tool_ms"] for t in turns) / 1e3
    return {
        "trace": trace["name"],
        "mode": "warm" if cache else "cold",
        "nonce": nonce,
        "wall_s": wall,
        "model_s": model_s,
        "tool_s": tool_s,
        "other_s": wall - model_s - tool_s,
        "model_share": model_s / wall if wall > 0 else None,
        "prefill_tokens": sum(t["prefill_tokens"] for t in turns),
        "reused_tokens": sum(t["reused_tokens"] for t in turns),
        "turns": turns,
    }


# ----------------------------------------------------------------------------- the run

TURN_FIELDS = ("ttfb_ms", "generation_ms", "model_ms", "tool_ms", "prefill_tokens", "reused_tokens", "tokens_per_step")
RUN_FIELDS = ("wall_s", "model_s", "tool_s", "other_s", "model_share", "prefill_tokens", "reused_tokens")


def summarize(replays: list[dict]) -> dict:
    """median/p10/p90 over repeats: per (trace, mode) per turn, per (trace, mode) per run, per mode."""
    out: dict = {"by_trace": {}, "by_mode": {}}
    for mode in ("cold", "warm"):
        rs = [r for r in replays if r["mode"] == mode]
        out["by_mode"][mode] = {k: spread([r[k] for r in rs if r[k] is not None]) for k in RUN_FIELDS}
        out["by_mode"][mode]["ttfb_ms"] = spread([t["ttfb_ms"] for r in rs for t in r["turns"]])
        for name in dict.fromkeys(r["trace"] for r in rs):
            tr = [r for r in rs if r["trace"] == name]
            n_turns = len(tr[0]["turns"])
            out["by_trace"].setdefault(name, {})[mode] = {
                "run": {k: spread([r[k] for r in tr if r[k] is not None]) for k in RUN_FIELDS},
                "turns": [
                    {k: spread([r["turns"][i][k] for r in tr if r["turns"][i][k] is not None]) for k in TURN_FIELDS}
                    for i in range(n_turns)
                ],
            }
    pairs = {}
    for r in replays:
        pairs.setdefault((r["trace"], r["nonce"]), {})[r["mode"]] = [t["content"] for t in r["turns"]]
    both = [p for p in pairs.values() if len(p) == 2]
    out["identical_replies"] = {"replays": len(both), "identical": sum(p["cold"] == p["warm"] for p in both)}
    return out


def server_props(root: str, api_key: str | None) -> dict:
    import urllib.request

    req = urllib.request.Request(root + "/props", headers={"Authorization": f"Bearer {api_key or 'none'}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def run_agent_bench(
    url: str,
    out_dir: str | Path,
    traces=None,
    repeats: int = 3,
    max_tokens: int = 64,
    clover: dict | None = None,
    api_key: str | None = None,
    model: str | None = None,
    log=print,
) -> dict:
    """Replay every trace `repeats` times cold and warm against the server at `url` (its /v1
    root or the server root); writes agent.json, report.md and timeline.png to out_dir."""
    from openai import OpenAI

    from ..sysinfo import environment

    trs = load_traces(traces)
    base = url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    client = OpenAI(base_url=base, api_key=api_key or "none", timeout=600, max_retries=0)
    model = model or client.models.list().data[0].id
    props = server_props(base[: -len("/v1")], api_key)
    clover = dict(clover or {})
    # warm-up (graphs, allocations): not recorded
    chat_turn(client, model, [{"role": "user", "content": "hello"}], 8, {**clover, "cache_prompt": False})
    replays = []
    for rep in range(repeats):
        for t in trs:
            nonce = secrets.token_hex(4)
            for cache in (False, True):
                r = replay(client, model, t, cache, nonce, max_tokens, clover)
                r["repeat"] = rep
                replays.append(r)
                log(
                    f"{t['name']} {r['mode']} #{rep}: {r['wall_s']:.2f} s, model {100 * r['model_share']:.0f} %, "
                    f"prefill {r['prefill_tokens']} tokens, reused {r['reused_tokens']}"
                )
    run = {
        "kind": "agent",
        "config": {
            "url": base,
            "model": model,
            "repeats": repeats,
            "max_tokens": max_tokens,
            "clover": clover,
            "temperature": 0,
            "enable_thinking": False,
            "traces": [{"name": t["name"], "file": t["file"], "steps": len(t["steps"])} for t in trs],
            "server": props,
            "environment": environment(),
        },
        "summary": summarize(replays),
        "replays": replays,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "agent.json", run)
    render_agent(run, out)
    return run


def run_agent_eval(gguf=None, url: str | None = None, server_args: tuple = (), log=print, **kw) -> dict:
    """The command: against `url`, or against a `clover-gguf serve GGUF *server_args` started here
    on a free loopback port (stopped afterwards)."""
    if gguf is None:
        return run_agent_bench(url or "http://127.0.0.1:8080", log=log, **kw)
    from ...serve.local import LocalServer

    out = Path(kw["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    with LocalServer(gguf, *server_args, log_path=out / "server.log") as srv:
        log(f"started clover-gguf serve at {srv.url} (log: {out / 'server.log'})")
        return run_agent_bench(srv.url, log=log, **kw)
