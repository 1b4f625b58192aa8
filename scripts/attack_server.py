#!/usr/bin/env python3
"""What each attack of issue 47 does to `clover-gguf serve`, measured: the latency of a plain
request sent while the attack runs (against its idle latency), the server's resident memory
(against its idle size), how long each attack request took and how it was answered, and whether
the server lived. Writes JSON + Markdown; a benchmark (figures), not a test.

    python scripts/attack_server.py --out evaldata/hardening            # clover-tiny, -t 1
    python scripts/attack_server.py --only ambiguous,tokens --repeats 5

The criteria of the issue, checked per attack: a concurrent plain request completes within 2x
its idle latency (median over the plain requests sent during the attack), the server's memory
stays within 1 GiB of its idle size, no attack request runs more than 5 s past its own
generation (its time minus the prefill and generation times the answer reports: waiting for
others counts), and no crash. Run it on a
quiet machine: latencies are wall-clock.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

KEY = "attack-key"
PLAIN = ("/v1/completions", {"model": "x", "prompt": "def add(a, b):\n", "max_tokens": 16})
USER = [{"role": "user", "content": "Give me the data"}]


def _schema(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def _chat(extra: dict, max_tokens: int = 8) -> tuple[str, dict]:
    return "/v1/chat/completions", {"model": "x", "messages": USER, "max_tokens": max_tokens,
                                    "chat_template_kwargs": {"enable_thinking": False}} | extra  # fmt: skip


def _many_tools(n_tools: int, n_props: int) -> dict:
    props = {f"p{i}": {"type": "string", "maxLength": 1999} for i in range(n_props)}
    tool = lambda k: {"type": "function", "function": {"name": f"f{k}", "parameters": {
        "type": "object", "properties": props, "required": list(props)}}}  # fmt: skip
    return {"tools": [tool(k) for k in range(n_tools)], "tool_choice": "required"}


def attacks(long_prompt: list[int]) -> dict[str, tuple[int, list[tuple[str, dict]]]]:
    """name -> (concurrent copies, [(route, body)])"""
    alts = "|".join(f'"w{i}"' for i in range(20_000))
    return {
        "deep nesting (200 KB grammar)": (4, [_chat({"grammar": "root ::= " + "(" * 100_000 + '"a"' + ")" * 100_000})]),
        "100,000 chained rules": (4, [_chat({"grammar": "\n".join(f"r{i} ::= r{i + 1}" for i in range(100_000))
                                            + '\nr100000 ::= "a"\nroot ::= r0'})]),  # fmt: skip
        "minItems > maxItems": (8, [_chat(_schema({"type": "array", "minItems": 10, "maxItems": 2}))]),
        "minLength > maxLength": (8, [_chat(_schema({"type": "string", "minLength": 10, "maxLength": 3}))]),
        'root ::= "a"{10,2}': (8, [_chat({"grammar": 'root ::= "a"{10,2}'})]),
        "ambiguous: 200 optional items": (8, [_chat({"grammar": "root ::= " + ' "a"?' * 200 + ' "b"'})]),
        "20,000 alternatives under *": (4, [_chat({"grammar": f"root ::= ({alts})*"})]),
        "a 20,000-alternative pattern": (4, [_chat(_schema({"type": "string", "pattern": f"^({alts.replace(chr(34), '')})$"}))]),
        "a 10,000-value enum": (4, [_chat(_schema({"enum": [f"v{i}" for i in range(10_000)]}))]),
        "3,000 strings of maxLength 1999": (4, [_chat(_many_tools(1, 3000))]),
        "8 x 128 tools": (8, [_chat(_many_tools(128, 4))]),
        "special-token flood (80,000)": (8, [("/v1/completions", {"model": "x", "prompt": "<|im_start|>" * 80_000, "max_tokens": 1})]),
        "special-token flood (15 MB)": (4, [("/v1/completions", {"model": "x", "prompt": "<|im_start|>" * 1_250_000, "max_tokens": 1})]),
        "/tokenize with pieces, 15 MB": (2, [("/tokenize", {"content": "<|im_start|>" * 1_250_000, "with_pieces": True})]),
        "a 60,000-token prompt": (1, [("/v1/completions", {"model": "x", "prompt": long_prompt, "max_tokens": 16})]),
        "15 MB user of nested arrays": (2, [("/v1/chat/completions", "NESTED")]),
    }  # fmt: skip


def post(url: str, path: str, body, timeout: float = 600) -> tuple[int, dict, float]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Authorization": f"Bearer {KEY}",
                                                                  "Content-Type": "application/json"})  # fmt: skip
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out, status = json.loads(r.read()), r.status
    except urllib.error.HTTPError as e:
        out, status = json.loads(e.read() or b"{}"), e.code
    except (OSError, ValueError) as e:
        out, status = {"error": str(e)}, 0
    return status, out, time.monotonic() - t0


def rss_mib(pid: int) -> float:
    """The server's resident memory with its preparation workers (its children)."""
    total = 0
    for p in [pid, *_children(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def plain_latency(url: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        status, _, dt = post(url, *PLAIN)
        assert status == 200
        out.append(dt)
    return out


def run_attack(url: str, pid: int, copies: int, reqs: list, idle: float, plain_n: int) -> dict:
    route, body = reqs[0]
    if body == "NESTED":
        body = (
            b'{"model": "x", "messages": [{"role": "user", "content": "hi"}], "user": [' + b"[]," * 5_000_000 + b"[]]}"
        )
    rss0, peak = rss_mib(pid), [rss_mib(pid)]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_mib(pid))
            time.sleep(0.05)

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    with ThreadPoolExecutor(copies + 1) as ex:
        futs = [ex.submit(post, url, route, body) for _ in range(copies)]
        time.sleep(0.3)  # the attack first, then the plain requests while it runs
        lat = plain_latency(url, plain_n)
        res = [f.result() for f in futs]
    stop.set()
    w.join()
    past = []
    for _status, out, dt in res:
        t = ((out.get("usage") or {}).get("clover") or {}).get("timings", {})
        past.append(dt - (t.get("prefill_ms", 0) + t.get("generation_ms", 0)) / 1e3)  # its own work out
    alive = post(url, "/health", b"{}", 10)[0] in (200, 405) or _health(url)
    med = statistics.median(lat)
    return {
        "copies": copies,
        "statuses": sorted({r[0] for r in res}),
        "messages": sorted({str((r[1].get("error") or {}).get("message", ""))[:120] for r in res if r[0] != 200}),
        "attack_seconds": {"max": max(r[2] for r in res), "median": statistics.median(r[2] for r in res)},
        "past_generation_s_max": max(past),
        "plain_latency_s": {"median": med, "max": max(lat), "n": len(lat), "vs_idle": med / idle},
        "rss_mib": {"before": rss0, "peak": peak[0], "added": peak[0] - rss0},
        "alive": bool(alive),
        "ok": med <= 2 * idle and peak[0] - rss0 <= 1024 and max(past) <= 5 and bool(alive),
    }


def _health(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            return r.status == 200
    except OSError:
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="GGUF (default: models/clover-tiny converted to bf16)")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "attacks")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", help="comma-separated words; attacks whose name holds one")
    ap.add_argument("--plain", type=int, default=5, help="plain requests measured per attack (and idle)")
    a = ap.parse_args(argv)
    from clover_gguf.runtime.runtime import CloverRuntime
    from clover_gguf.serve.local import LocalServer

    tmp = tempfile.TemporaryDirectory(prefix="attack-")
    model = a.model
    if model is None:
        from clover_gguf.convert.converter import convert

        model = Path(tmp.name) / "clover-tiny-bf16.gguf"
        convert(REPO / "models" / "clover-tiny", model, recipe="bf16", progress=False)
    rt = CloverRuntime(model, n_threads=1)
    long_prompt = rt.tokenize("def f(x):\n    return x + 1\n\n\n" * 6000)[:60_000]
    rt.close()
    table = attacks(long_prompt)
    if a.only:
        words = a.only.split(",")
        table = {k: v for k, v in table.items() if any(w in k for w in words)}
    args = ("-t", str(a.threads), "--api-key", KEY, "--parallel", "4", "-c", "65536")
    results = {}
    with LocalServer(model, *args, log_path=Path(tmp.name) / "server.log") as srv:
        pid = srv.proc.pid
        plain_latency(srv.url, 2)  # warm
        idle_lat = plain_latency(srv.url, a.plain)
        idle = statistics.median(idle_lat)
        idle_rss = rss_mib(pid)
        print(f"idle: plain request {idle * 1e3:.0f} ms (median of {a.plain}), {idle_rss:.0f} MiB", flush=True)
        for name, (copies, reqs) in table.items():
            r = run_attack(srv.url, pid, copies, reqs, idle, a.plain)
            results[name] = r
            print(
                f"{name}: {r['statuses']} attack max {r['attack_seconds']['max']:.1f} s, plain "
                f"{r['plain_latency_s']['median'] * 1e3:.0f} ms ({r['plain_latency_s']['vs_idle']:.2f}x idle), "
                f"+{r['rss_mib']['added']:.0f} MiB, {'ok' if r['ok'] else 'FAILS'}",
                flush=True,
            )
        stats = json.loads(urllib.request.urlopen(urllib.request.Request(
            srv.url + "/props", headers={"Authorization": f"Bearer {KEY}"})).read())["stats"]  # fmt: skip
        log = srv.log_tail(200_000)
    run = {
        "command": "python scripts/attack_server.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": str(model.name),
        "threads": a.threads,
        "load_average": os.getloadavg(),
        "idle": {"plain_latency_s": idle_lat, "rss_mib": idle_rss},
        "attacks": results,
        "server": {
            "server_errors": stats.get("server_errors"),
            "prep_workers_replaced": stats.get("prep_workers_replaced"),
            "tracebacks": log.count("Traceback"),
        },  # fmt: skip
    }
    a.out.mkdir(parents=True, exist_ok=True)
    tmpf = a.out / ".attacks.json.tmp"
    tmpf.write_text(json.dumps(run, indent=1))
    tmpf.replace(a.out / "attacks.json")
    lines = [
        "# Attacks on `clover-gguf serve` (issue 47)", "", f"Command: `{run['command']}`; model `{run['model']}`, "
        f"`-t {a.threads} --parallel 4 -c 65536`; load average {', '.join(f'{x:.2f}' for x in run['load_average'])}.",
        f"Idle: a plain request ({PLAIN[1]['max_tokens']} tokens of `/v1/completions`) takes {idle * 1e3:.0f} ms "
        f"(median of {a.plain}); the server and its preparation workers hold {idle_rss:.0f} MiB.", "",
        "| attack | copies | answers | attack time, max | plain request during it (x idle) | memory added | past its own prefill and generation, max | ok |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['copies']} | {', '.join(map(str, r['statuses']))} | {r['attack_seconds']['max']:.1f} s | "
            f"{r['plain_latency_s']['median'] * 1e3:.0f} ms ({r['plain_latency_s']['vs_idle']:.2f}x) | "
            f"{r['rss_mib']['added']:.0f} MiB | {r['past_generation_s_max']:.1f} s | {'yes' if r['ok'] else '**no**'} |"
        )
    srvs = run["server"]
    lines += ["", f"Server: {srvs['server_errors']} server errors, {srvs['tracebacks']} tracebacks in its log, "
              f"{srvs['prep_workers_replaced']} preparation workers replaced (killed past their budget)."]  # fmt: skip
    (a.out / ".attacks.md.tmp").write_text("\n".join(lines) + "\n")
    (a.out / ".attacks.md.tmp").replace(a.out / "attacks.md")
    bad = [k for k, r in results.items() if not r["ok"]]
    print(f"wrote {a.out}/attacks.json, attacks.md; {len(bad)} attack(s) past a criterion: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
