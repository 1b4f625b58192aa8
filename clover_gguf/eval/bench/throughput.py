"""`clover-gguf eval throughput`: total generation throughput of `clover-gguf serve` with N
concurrent clients, for each N of a list (default 1, 2, 4), each against a server started with
`--parallel N` so that N waiting requests are decoded together.

One run: N client threads each send `--requests` completions one after the other (greedy, the
same fixed prompts for every N, state reuse off so that no run is faster for being second);
total tok/s = completion tokens of all requests / the run's wall time. `--runs` runs per N give
the median and p10/p90. The replies of every N must equal N = 1's (a group never changes an
answer); the server's counters show how many denoising graphs the sequence steps took (fewer
graphs than steps: the requests were decoded together).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from ...outputs import write_json
from ..quality.metrics import spread
from ..render.throughput import render_throughput
from . import BenchError

PROMPTS = [
    "def add(a, b):\n",
    "import sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n",
    "def read_lines(path):\n    with open(path) as f:\n",
    "import json\n\n\ndef load(path):\n",
    "def is_prime(n):\n",
    "class Point:\n    def __init__(self, x, y):\n",
]


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def one_run(client, model: str, n_clients: int, requests: int, max_tokens: int, clover: dict) -> dict:
    """n_clients threads x `requests` completions each; returns wall time, tokens, latencies, replies."""
    replies: dict[tuple[int, int], str] = {}
    lat: list[float] = []
    tokens = [0, 0]  # completion tokens, generated positions
    errors: list[str] = []
    lock = threading.Lock()
    go = threading.Barrier(n_clients + 1)

    def client_loop(c: int) -> None:
        go.wait()
        for i in range(requests):
            k = (c * requests + i) % len(PROMPTS)
            t0 = time.perf_counter()
            try:
                r = client.completions.create(
                    model=model,
                    prompt=PROMPTS[k],
                    max_tokens=max_tokens,
                    temperature=0,
                    extra_body={"clover": {**clover, "cache_prompt": False}},
                )
            except Exception as e:  # reported after the run, never swallowed
                with lock:
                    errors.append(f"client {c} request {i}: {type(e).__name__}: {e}")
                return
            dt = time.perf_counter() - t0
            with lock:
                lat.append(dt)
                replies[(c, i)] = r.choices[0].text
                tokens[0] += r.usage.completion_tokens
                tokens[1] += r.usage.clover["generated_tokens"]

    threads = [threading.Thread(target=client_loop, args=(c,), daemon=True) for c in range(n_clients)]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise BenchError(errors[0])
    return {
        "wall_s": wall,
        "completion_tokens": tokens[0],
        "generated_positions": tokens[1],
        "tok_per_s": tokens[0] / wall,
        "positions_per_s": tokens[1] / wall,
        "latency_s": lat,
        "replies": {PROMPTS[(c * requests + i) % len(PROMPTS)]: t for (c, i), t in sorted(replies.items())},
    }


def measure_parallel(gguf, n: int, out: Path, server_args: tuple, runs: int, requests: int, max_tokens: int,
                     clover: dict) -> dict:  # fmt: skip
    """Start `clover-gguf serve GGUF --parallel n`, warm it up, time `runs` runs; the runs, the
    server's counters before and after them and the load average around them."""
    from openai import OpenAI

    from ...serve.local import LocalServer
    from .agent import server_props

    args = ("--parallel", str(n), "--ctx-cache", "0", *server_args)
    with LocalServer(gguf, *args, log_path=out / f"server-np{n}.log") as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=600, max_retries=0)
        model = client.models.list().data[0].id
        one_run(client, model, n, 1, 8, clover)  # warm-up (graphs, allocations): not recorded
        before = server_props(srv.url, None)["stats"]
        load0 = _loadavg()
        rs = [one_run(client, model, n, requests, max_tokens, clover) for _ in range(runs)]
        load1 = _loadavg()
        after = server_props(srv.url, None)["stats"]
    return {"runs": rs, "before": before, "after": after, "load": (load0, load1)}


def parallel_result(n: int, requests: int, m: dict, same: bool) -> dict:
    """One N's row of throughput.json from measure_parallel's record."""
    rs, before, after = m["runs"], m["before"], m["after"]
    d = {k: after[k] - before[k] for k in ("groups", "denoise_graphs", "sequence_steps")}
    return {
        "parallel": n,
        "requests_per_run": n * requests,
        "tok_per_s": spread(r["tok_per_s"] for r in rs),
        "positions_per_s": spread(r["positions_per_s"] for r in rs),
        "wall_s": spread(r["wall_s"] for r in rs),
        "latency_s": spread(x for r in rs for x in r["latency_s"]),
        "completion_tokens": sum(r["completion_tokens"] for r in rs),
        "groups": d["groups"],
        "largest_group": after["largest_group"],
        "denoise_graphs": d["denoise_graphs"],
        "sequence_steps": d["sequence_steps"],
        "same_replies_as_first": same,
        "loadavg_before": m["load"][0],
        "loadavg_after": m["load"][1],
    }


def run_throughput(
    gguf,
    out_dir: str | Path,
    parallel=(1, 2, 4),
    runs: int = 5,
    requests: int = 2,
    max_tokens: int = 64,
    clover: dict | None = None,
    server_args: tuple = (),
    log=print,
) -> dict:
    """Start `clover-gguf serve GGUF --parallel N *server_args` for each N, measure, write
    throughput.json and throughput.md to out_dir."""
    from ..sysinfo import environment

    clover = dict(clover or {})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    reference: dict[str, str] | None = None
    for n in parallel:
        m = measure_parallel(gguf, n, out, server_args, runs, requests, max_tokens, clover)
        replies = {}
        for r in m["runs"]:
            replies.update(r.pop("replies"))
        if reference is None:
            reference = replies
        same = all(reference.get(p, t) == t for p, t in replies.items())
        res = parallel_result(n, requests, m, same)
        results.append(res)
        t = res["tok_per_s"]
        log(
            f"--parallel {n}: {t['median']:.1f} tok/s [p10 {t['p10']:.1f}, p90 {t['p90']:.1f}] over {runs} runs of "
            f"{n * requests} requests; {res['denoise_graphs']} graphs for {res['sequence_steps']} sequence steps; "
            f"replies {'identical to' if same else 'DIFFERENT from'} --parallel {parallel[0]}'s; "
            f"load {res['loadavg_after']}"
        )
    run = {
        "kind": "throughput",
        "config": {
            "model": str(gguf),
            "parallel": list(parallel),
            "runs": runs,
            "requests_per_client": requests,
            "max_tokens": max_tokens,
            "clover": clover,
            "server_args": list(server_args),
            "prompts": PROMPTS,
            "environment": environment(),
        },
        "results": results,
    }
    write_json(out / "throughput.json", run)
    render_throughput(run, out)
    return run
