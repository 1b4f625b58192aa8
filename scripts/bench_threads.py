#!/usr/bin/env python
"""ggml's CPU thread pool when a core is busy: a denoising step at 1 and 2 threads, on a quiet
machine and with another process spinning on one core, under OpenMP wait policies.

    python scripts/bench_threads.py [--models tiny,35b-2l] [--reps 15] [--out out/bench-threads]

ggml's CPU backend (built with OpenMP) meets at an `omp barrier` after every op. libgomp spins
there before it sleeps (GOMP_SPINCOUNT, OMP_WAIT_POLICY); a spinning waiter keeps its core busy,
so a worker descheduled by the other process is not moved to it. Each policy runs in its own
process (libgomp reads them when it loads). Prints a table and writes threads.json/threads.md.
`--no-openmp-lib DIR` adds ggml's own threadpool (a GGML_OPENMP=OFF build) as a row.
Run it on a quiet machine (nothing else building, training or testing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

POLICIES = {
    "default": {},
    "GOMP_SPINCOUNT=100000": {"GOMP_SPINCOUNT": "100000"},
    "GOMP_SPINCOUNT=10000": {"GOMP_SPINCOUNT": "10000"},
    "GOMP_SPINCOUNT=1000": {"GOMP_SPINCOUNT": "1000"},
    "OMP_WAIT_POLICY=passive": {"OMP_WAIT_POLICY": "passive"},
}


def worker(gguf: str, threads: int, reps: int) -> None:
    """In a fresh process: median ms of a denoising step (32 masked rows, candidates on the
    device path) after a 64-token prompt."""
    from clover_gguf.reference.sampling import step_key
    from clover_gguf.runtime.runtime import CloverRuntime

    rt = CloverRuntime(gguf, n_threads=threads, n_ubatch=512)
    B = 32
    rt.commit(list(range(300, 364)), B)
    blk = [rt.mask_token_id] * B
    for _ in range(2):
        rt.block_candidates(blk, 0.0, 1)
    ts = []
    for r in range(reps):
        t = time.perf_counter()
        rt.block_candidates(blk, 0.0, step_key(0, 0, r))
        ts.append((time.perf_counter() - t) * 1e3)
    print(
        json.dumps(
            {
                "median_ms": statistics.median(ts),
                "p10": sorted(ts)[len(ts) // 10],
                "p90": sorted(ts)[-1 - len(ts) // 10],
            }
        )
    )


def models(names: list[str], work: Path) -> dict[str, Path]:
    from clover_gguf.config import preset
    from clover_gguf.convert.converter import convert
    from clover_gguf.synthetic import write_synthetic_gguf
    from clover_gguf.util import DEFAULT_MODEL

    work.mkdir(parents=True, exist_ok=True)
    out = {}
    for n in names:
        p = work / f"{n}.gguf"
        if not p.exists():
            if n == "tiny":
                convert(DEFAULT_MODEL, p, recipe="q4_k", progress=False)
            else:
                write_synthetic_gguf(
                    p, preset("clover-35b-a3b"), layers=2, outtype="q8_0", experts="q4_k", progress=False
                )
        out[n] = p
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,35b-2l")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--work", type=Path, default=REPO / "out" / "bench-threads-work")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "bench-threads")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma list of the rows above")
    ap.add_argument(
        "--no-openmp-lib",
        type=Path,
        help="lib folder of a GGML_OPENMP=OFF build (clover-gguf runtime build --root R --no-install "
        "--cmake-arg=-DGGML_OPENMP=OFF): adds ggml's own threadpool as a row",
    )
    ap.add_argument("--worker", nargs=3, metavar=("GGUF", "THREADS", "REPS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker[0], int(a.worker[1]), int(a.worker[2]))
        return
    from clover_gguf.eval.sysinfo import environment

    ggufs = models(a.models.split(","), a.work)
    policies = {p: POLICIES[p] for p in a.policies.split(",")}
    if a.no_openmp_lib:
        policies["ggml threadpool (no OpenMP)"] = {"LLAMA_CPP_LIB_PATH": str(a.no_openmp_lib)}
    rows = []
    for busy in (False, True):
        spinner = subprocess.Popen(["taskset", "-c", "0", "sh", "-c", "while :; do :; done"]) if busy else None
        try:
            for name, gguf in ggufs.items():
                for pol, env in policies.items():
                    res = {}
                    for th in (1, 2):
                        r = subprocess.run(
                            [sys.executable, __file__, "--worker", str(gguf), str(th), str(a.reps)],
                            env={**os.environ, **env},
                            capture_output=True,
                            text=True,
                            timeout=900,
                        )
                        res[th] = (
                            json.loads(r.stdout.strip().splitlines()[-1])
                            if r.returncode == 0
                            else {"error": r.stderr[-500:]}
                        )
                    row = {"model": name, "busy_core": busy, "policy": pol, "1": res[1], "2": res[2]}
                    rows.append(row)
                    print(
                        f"{name:8s} {'busy' if busy else 'quiet':5s} {pol:25s} 1 thread {res[1].get('median_ms', float('nan')):8.2f} ms"
                        f"   2 threads {res[2].get('median_ms', float('nan')):8.2f} ms",
                        flush=True,
                    )
        finally:
            if spinner:
                spinner.kill()
                spinner.wait()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "threads.json").write_text(json.dumps({"environment": environment(2), "rows": rows}, indent=1) + "\n")
    md = [
        "| model | other process on core 0 | OpenMP policy | 1 thread ms/step [p10–p90] | 2 threads ms/step [p10–p90] | 2 vs 1 |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        f = lambda x: f"{x['median_ms']:.2f} [{x['p10']:.2f}–{x['p90']:.2f}]" if "median_ms" in x else "error"  # noqa: E731
        ratio = (
            r["2"]["median_ms"] / r["1"]["median_ms"]
            if "median_ms" in r["1"] and "median_ms" in r["2"]
            else float("nan")
        )
        md.append(
            f"| {r['model']} | {'spinning' if r['busy_core'] else 'idle'} | {r['policy']} | {f(r['1'])} | {f(r['2'])} | {ratio:.2f} |"
        )
    (a.out / "threads.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
