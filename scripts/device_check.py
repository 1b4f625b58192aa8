#!/usr/bin/env python
"""The Python stages of scripts/device_check.sh (see there): parity, speed, summary.

python scripts/device_check.py parity  --out DIR --mode gpu|dry
python scripts/device_check.py speed   --out DIR --mode gpu|dry --layers 40 --threads 16
python scripts/device_check.py summary --out DIR --mode gpu|dry --seconds S
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def log(*a):
    print("[device-check]", *a, file=sys.stderr, flush=True)


def _kl(p_logits, q_logits) -> float:
    import torch

    lp = torch.log_softmax(torch.as_tensor(p_logits).double(), -1)
    lq = torch.log_softmax(torch.as_tensor(q_logits).double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def _pair(gguf: Path, ngl_a: int, ngl_b: int, threads: int, prompt: list[int], B: int) -> dict:
    """Backend a vs backend b on one GGUF: KL of a masked block's logits after the prompt, and
    the greedy tokens of a 4-block generation."""
    from clover_gguf.reference.generate import GenerationConfig
    from clover_gguf.runtime.runtime import CloverRuntime

    out = {}
    for key, ngl in (("a", ngl_a), ("b", ngl_b)):
        with CloverRuntime(gguf, n_threads=threads, n_gpu_layers=ngl, n_ctx=4096) as rt:
            rt.commit(prompt, B)
            logits = rt.block_logits([rt.mask_token_id] * B).numpy()
            toks = rt.generate(prompt, GenerationConfig(max_new_tokens=4 * B, block_size=B, steps=B // 4)).tokens
            out[key] = (logits, toks)
    (la, ta), (lb, tb) = out["a"], out["b"]
    same = sum(x == y for x, y in zip(ta, tb))
    return {
        "kl_mean": _kl(la, lb),
        "max_abs_logit_diff": float(abs(la - lb).max()),
        "greedy_tokens_equal": ta == tb,
        "greedy_common_prefix": next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta)),
        "greedy_same_fraction": same / max(1, len(ta)),
    }


def parity(out: Path, mode: str) -> dict:
    from clover_gguf.config import preset
    from clover_gguf.convert.converter import convert
    from clover_gguf.gguf_io.synth import write_synthetic_gguf
    from clover_gguf.tokenizer import CloverTokenizer
    from clover_gguf.util import DEFAULT_MODEL

    ngl_b = 99 if mode == "gpu" else 0
    res = {"compared": "CPU (-ngl 0) vs CUDA (-ngl 99)" if mode == "gpu" else "CPU 1 thread vs CPU 2 threads (dry run)"}
    tiny = out / "clover-tiny-bf16.gguf"
    convert(DEFAULT_MODEL, tiny, recipe="bf16", force=True, progress=False, log=lambda *a, **k: None)
    tok = CloverTokenizer.from_dir(DEFAULT_MODEL)
    prompt = tok.encode('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n')
    B = 16
    res["clover-tiny"] = _pair(tiny, 0, ngl_b, 1 if mode == "dry" else 8, prompt, B)
    log("clover-tiny", res["clover-tiny"])
    wide = out / "clover-35b-1layer-q4_k_m.gguf"
    if not wide.exists():
        write_synthetic_gguf(wide, preset("clover-35b-a3b"), layers=1, recipe="q4_k_m", progress=False)
    res["35b-1-layer"] = _pair(wide, 0, ngl_b, 2 if mode == "dry" else 8, list(range(300, 300 + 70)), 32)
    log("35b-1-layer", res["35b-1-layer"])
    (out / "parity.json").write_text(json.dumps(res, indent=1) + "\n")
    return res


def _vram_sampler(stop: threading.Event, peak: list) -> None:
    while not stop.is_set():
        try:
            r = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=5,
            )
            peak[0] = max(peak[0], int(r.stdout.split()[0]))
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return
        stop.wait(0.5)


def _bench(cli: Path, gguf: Path, args: list[str], out: Path, name: str) -> dict:
    """llama-clover-cli --bench; the figures it prints and the peak GPU memory while it ran."""
    stop, peak = threading.Event(), [0]
    th = threading.Thread(target=_vram_sampler, args=(stop, peak), daemon=True)
    th.start()
    cmd = [str(cli), "-m", str(gguf), "--prompt-ids", ",".join(str(i) for i in range(300, 364)), "--bench", *args]
    t = time.perf_counter()
    # the generated text of random weights is arbitrary bytes
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=400)
    stop.set()
    th.join()
    (out / f"{name}.log").write_text(" ".join(cmd) + "\n" + r.stdout + r.stderr)
    f = lambda pat: float(m.group(1)) if (m := re.search(pat, r.stderr)) else None  # noqa: E731
    return {
        "command": " ".join(cmd[1:]),
        "rc": r.returncode,
        "wall_s": time.perf_counter() - t,
        "prompt_tok_s": f(r"prompt:.*: ([\d.]+) tok/s"),
        "gen_tok_s": f(r"generation:.*: ([\d.]+) tok/s"),
        "ms_per_step": f(r"steps:.*, ([\d.]+) ms per step"),
        "tokens_per_step": f(r"([\d.]+) tokens per step"),
        "graph_build_ms": f(r"graph build ([\d.]+) ms"),
        "compute_ms": f(r"compute ([\d.]+) ms"),
        "host_ms": f(r"host ([\d.]+) ms"),
        "other_ms": f(r"other ([\d.]+) ms"),
        "vram_peak_mib": peak[0] or None,
    }


def placement_16gb(gguf: Path, budget_gib: float = 16.0, reserve_gib: float = 1.5) -> dict:
    """What a 16 GB card holds: every non-expert tensor and the routed experts of the last
    layers, the experts of the first k layers in CPU memory (-ot), k as small as fits."""
    from gguf import GGUFReader

    r = GGUFReader(gguf)
    total, experts = 0, {}
    for t in r.tensors:
        total += int(t.n_bytes)
        m = re.match(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$", t.name)
        if m:
            experts[int(m.group(1))] = experts.get(int(m.group(1)), 0) + int(t.n_bytes)
    budget = (budget_gib - reserve_gib) * 2**30
    k, on_gpu = 0, total
    while on_gpu > budget and k < len(experts):
        on_gpu -= experts[k]
        k += 1
    regex = r"^blk\.(" + "|".join(str(i) for i in range(k)) + r")\.ffn_(gate|up|down)_exps\.weight$"
    return {
        "file_gib": total / 2**30,
        "gpu_gib": on_gpu / 2**30,
        "cpu_expert_layers": k,
        "cpu_expert_gib": sum(experts[i] for i in range(k)) / 2**30,
        "override": f"{regex}=CPU" if k else None,
        "reserve_gib_for_buffers_and_state": reserve_gib,
        # a 32-row denoising batch is at llama.cpp's op-offload threshold: the CPU-resident
        # experts' weights are copied to the GPU for every pass
        "pcie_bytes_per_step_estimate": sum(experts[i] for i in range(k)),
    }


def speed(out: Path, mode: str, layers: int, threads: int) -> dict:
    from clover_gguf.config import preset
    from clover_gguf.eval.passes import PassesConfig, run_passes
    from clover_gguf.gguf_io.synth import write_synthetic_gguf
    from clover_gguf.runtime.build import runtime_paths

    cli = Path(os.environ.get("LLAMA_CPP_LIB_PATH", runtime_paths()["bin_dir"])) / "llama-clover-cli"
    ngl = ["-ngl", "99"] if mode == "gpu" else []
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    gguf = work / f"clover-35b-a3b-{layers}l-q4_k_m.gguf"
    res: dict = {"layers": layers, "threads": threads}
    if not gguf.exists():
        t = time.perf_counter()
        write_synthetic_gguf(gguf, preset("clover-35b-a3b"), layers=layers, recipe="q4_k_m", progress=False)
        res["synth_s"] = time.perf_counter() - t
    common = ["-t", str(threads), "--block-size", "32", "-n", "128", *ngl]
    for steps in (8, 16):
        res[f"steps{steps}"] = _bench(cli, gguf, common + ["--steps", str(steps)], out, f"bench-steps{steps}")
        log(f"steps {steps}:", res[f"steps{steps}"])
    res["threshold0.9"] = _bench(cli, gguf, common + ["--threshold", "0.9"], out, "bench-threshold")
    pl = placement_16gb(gguf)
    res["placement_16gb"] = pl
    ot = ["-ot", pl["override"]] if pl["override"] else []
    res["placement_16gb"]["bench"] = _bench(cli, gguf, common + ["--steps", "8", *ot], out, "bench-16gb")
    log("16 GB placement:", res["placement_16gb"])
    (out / "speed.json").write_text(json.dumps(res, indent=1) + "\n")
    # side by side with llama.cpp's own passes at full depth (Qwen3-MoE twin)
    cfg = PassesConfig(
        layers=(layers,),
        threads=(threads,),
        heads=("q4_k_m",),
        rounds=3 if mode == "gpu" else 1,
        n_gpu_layers=99 if mode == "gpu" else 0,
        work=work,
        out=out / "passes",
    )
    try:
        bundle = run_passes(cfg, log=log)
        res["passes"] = bundle["runs"][0]["ratios"]
    except Exception as e:  # noqa: BLE001 - the other figures stand without it
        res["passes_error"] = f"{type(e).__name__}: {e}"
    (out / "speed.json").write_text(json.dumps(res, indent=1) + "\n")
    return res


def summary(out: Path, mode: str, seconds: int) -> None:
    def load(name):
        p = out / name
        return json.loads(p.read_text()) if p.exists() else None

    stages = (
        [json.loads(x) for x in (out / "stages.jsonl").read_text().splitlines()]
        if (out / "stages.jsonl").exists()
        else []
    )
    ops = (out / "ops.txt").read_text().splitlines() if (out / "ops.txt").exists() else []
    s = {
        "mode": mode,
        "gpu": (out / "gpu.txt").read_text().strip() if (out / "gpu.txt").exists() else None,
        "seconds": seconds,
        "stages": stages,
        "ops": ops,
        "parity": load("parity.json"),
        "speed": load("speed.json"),
    }
    (out / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
    L = [f"# device check ({mode})", "", f"- GPU: {s['gpu']}", f"- wall time: {seconds} s", "", "## Stages", ""]
    L += [f"- {st['stage']}: rc {st['rc']}, {st['seconds']} s" for st in stages]
    L += ["", "## test-backend-ops", ""] + [f"- {o}" for o in ops]
    if s["parity"]:
        L += ["", f"## Parity ({s['parity']['compared']})", ""]
        for k, v in s["parity"].items():
            if isinstance(v, dict):
                L.append(
                    f"- {k}: KL {v['kl_mean']:.2e}, max |dlogit| {v['max_abs_logit_diff']:.2e}, greedy tokens "
                    f"equal: {v['greedy_tokens_equal']} (common prefix {v['greedy_common_prefix']})"
                )
    sp = s["speed"]
    if sp:
        L += [
            "",
            f"## Speed: synthetic Clover-35B-A3B, {sp['layers']} layers, q4_k_m, {sp['threads']} threads",
            "",
            "| run | gen tok/s | ms/step | tok/step | graph ms | compute ms | host ms | other ms | prompt tok/s | VRAM MiB |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        fmt = lambda x: "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g}"  # noqa: E731
        runs = [(k, sp[k]) for k in ("steps8", "steps16", "threshold0.9") if k in sp]
        if sp.get("placement_16gb"):
            runs.append(("16 GB placement, steps 8", sp["placement_16gb"]["bench"]))
        for k, b in runs:
            L.append(
                f"| {k} | {fmt(b['gen_tok_s'])} | {fmt(b['ms_per_step'])} | {fmt(b['tokens_per_step'])} | "
                f"{fmt(b['graph_build_ms'])} | {fmt(b['compute_ms'])} | {fmt(b['host_ms'])} | {fmt(b['other_ms'])} | "
                f"{fmt(b['prompt_tok_s'])} | {fmt(b['vram_peak_mib'])} |"
            )
        pl = sp.get("placement_16gb")
        if pl:
            L += [
                "",
                f"16 GB placement: {pl['cpu_expert_layers']} layers' experts in CPU memory "
                f"({pl['cpu_expert_gib']:.2f} GiB), {pl['gpu_gib']:.2f} GiB on the GPU of a {pl['file_gib']:.2f} GiB file; "
                f"PCIe per step (estimate: the CPU experts copied for each 32-row pass) "
                f"{pl['pcie_bytes_per_step_estimate'] / 2**30:.2f} GiB",
            ]
        if sp.get("passes"):
            L += [
                "",
                "Time ratios Clover / llama.cpp (Qwen3-MoE twin): "
                + ", ".join(f"{k} {v:.2f}" for k, v in sp["passes"].items()),
            ]
        if sp.get("passes_error"):
            L += ["", f"passes: {sp['passes_error']}"]
    (out / "summary.md").write_text("\n".join(L) + "\n")
    print("\n".join(L))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("stage", choices=["parity", "speed", "summary"])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--mode", choices=["gpu", "dry"], required=True)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--seconds", type=int, default=0)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.stage == "parity":
        parity(a.out, a.mode)
    elif a.stage == "speed":
        speed(a.out, a.mode, a.layers, a.threads)
    else:
        summary(a.out, a.mode, a.seconds)


if __name__ == "__main__":
    main()
