#!/usr/bin/env python
"""Runtime vs PyTorch reference throughput, side by side in one run.

Models: clover-tiny (models/clover-tiny, if trained) as BF16 GGUF and as Q4_K-experts GGUF,
and a synthetic model with Clover-35B-A3B shapes and 2 layers (random weights, written with
clover_gguf.synthetic). For each: prompt tok/s (prefill), generation tok/s, steps/block, for the
llama.cpp runtime (one clover_generate call) and the PyTorch reference (generate.generate).

    python scripts/bench_runtime.py [--threads N] [--work DIR] [--skip-synth] [--skip-tiny]

Generation uses the `steps` schedule (B/4 steps per block: 4 tokens per step) so that the
amount of work per block does not depend on the model's confidence; --threshold switches to
the threshold schedule.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from clover_gguf.reference.generate import GenerationConfig, TorchBackend, generate  # noqa: E402


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def convert_once(model_dir: Path, out: Path, **kw) -> Path:
    from clover_gguf.convert.converter import convert

    if out.exists():
        return out
    t = time.perf_counter()
    convert(model_dir, out, progress=False, **kw)
    log(
        f"  converted {model_dir.name} -> {out.name} ({out.stat().st_size / 2**20:.0f} MiB, "
        f"{time.perf_counter() - t:.0f}s)"
    )
    return out


def bench_runtime(gguf: Path, prompt, cfg, threads: int, reps: int):
    from clover_gguf.runtime.runtime import CloverRuntime

    rt = CloverRuntime(gguf, n_threads=threads, n_ubatch=max(256, cfg.block_size))
    try:
        rt.generate(prompt[: cfg.block_size], GenerationConfig(**{**cfg.__dict__, "max_new_tokens": cfg.block_size}))
        best = None
        for _ in range(reps):
            res = rt.generate(prompt, cfg)
            perf = rt.last_perf or {}
            pre = perf.get("t_prompt_ms", res.prefill_ms)
            gen = perf.get("t_gen_ms", res.total_ms - pre)
            n_gen = perf.get("n_gen", sum(b.n_tokens for b in res.blocks))
            row = dict(
                prompt_tps=len(prompt) / (pre / 1e3),
                gen_tps=n_gen / (gen / 1e3),
                steps_per_block=sum(b.steps for b in res.blocks) / max(1, len(res.blocks)),
                n_gen=n_gen,
            )
            if best is None or row["gen_tps"] > best["gen_tps"]:
                best = row
        return best
    finally:
        rt.close()


def bench_reference(model_dir: Path, prompt, cfg, threads: int, dtype, reps: int):
    from clover_gguf.reference.model import CloverModel

    torch.set_num_threads(threads)
    model = CloverModel.from_pretrained(model_dir, dtype=dtype).eval()
    best = None
    with torch.inference_mode():
        for _ in range(reps):
            res = generate(TorchBackend(model, "parallel"), prompt, cfg)
            n_gen = sum(b.n_tokens for b in res.blocks)
            gen_ms = res.total_ms - res.prefill_ms
            row = dict(
                prompt_tps=len(prompt) / (res.prefill_ms / 1e3),
                gen_tps=n_gen / (gen_ms / 1e3),
                steps_per_block=sum(b.steps for b in res.blocks) / max(1, len(res.blocks)),
                n_gen=n_gen,
            )
            if best is None or row["gen_tps"] > best["gen_tps"]:
                best = row
    del model
    gc.collect()
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument(
        "--work",
        type=Path,
        default=Path(os.environ.get("CLOVER_GGUF_CACHE", Path.home() / ".cache" / "clover-gguf")) / "bench",
    )
    ap.add_argument("--tiny", type=Path, default=REPO / "models" / "clover-tiny")
    ap.add_argument("--skip-tiny", action="store_true")
    ap.add_argument("--skip-synth", action="store_true")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new", type=int, default=128, help="tokens to generate")
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--threshold", type=float, default=None)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--ref-dtypes",
        default=None,
        help="reference dtypes, e.g. F32,BF16 (default F32 for tiny, BF16 for the synthetic)",
    )
    a = ap.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)

    models = []  # (label, hf dir, [(gguf label, gguf path)])
    if not a.skip_tiny:
        if (a.tiny / "config.json").exists() and any(a.tiny.glob("*.safetensors")):
            models.append(
                (
                    "clover-tiny",
                    a.tiny,
                    [
                        (
                            "BF16",
                            convert_once(a.tiny, a.work / "clover-tiny-bf16.gguf", outtype="bf16", experts="bf16"),
                        ),
                        (
                            "Q4_K exp",
                            convert_once(a.tiny, a.work / "clover-tiny-q4k.gguf", outtype="bf16", experts="q4_k"),
                        ),
                    ],
                )
            )
        else:
            log(f"{a.tiny}: no checkpoint, clover-tiny skipped")
    if not a.skip_synth:
        from clover_gguf.config import preset
        from clover_gguf.synthetic import write_synthetic

        sd = a.work / "synth-35b-a3b-2l"
        if not (sd / "config.json").exists():
            t = time.perf_counter()
            write_synthetic(sd, preset("clover-35b-a3b"), layers=2, progress=False)
            log(f"  wrote {sd} ({time.perf_counter() - t:.0f}s)")
        models.append(
            (
                "35B-A3B shapes, 2 layers",
                sd,
                [
                    ("BF16", convert_once(sd, a.work / "synth-bf16.gguf", outtype="bf16", experts="bf16")),
                    ("Q4_K exp", convert_once(sd, a.work / "synth-q4k.gguf", outtype="bf16", experts="q4_k")),
                ],
            )
        )

    rows = []
    for label, hf, ggufs in models:
        cfgj = json.loads((hf / "config.json").read_text())
        V, mask, eos = cfgj["vocab_size"], cfgj["mask_token_id"], cfgj.get("eos_token_id")
        rng = random.Random(0)
        prompt = [rng.randrange(min(V, 4096)) for _ in range(a.prompt_len)]
        prompt = [t if t not in (mask, eos) else t + 1 for t in prompt]
        cfg = GenerationConfig(
            max_new_tokens=a.new,
            block_size=a.block,
            steps=None if a.threshold else max(1, a.block // 4),
            threshold=a.threshold,
            temperature=0.0,
            mask_token_id=mask,
            eos_token_id=None,
        )
        for gl, gp in ggufs:
            log(f"runtime: {label} {gl}")
            r = bench_runtime(gp, prompt, cfg, a.threads, a.reps)
            rows.append(dict(model=label, backend=f"llama.cpp {gl}", **r))
        # the 35B-shaped synthetic in F32 would need ~2x its BF16 size in RAM: BF16 only there
        ref_dtypes = ((torch.float32, "F32"),) if "tiny" in label else ((torch.bfloat16, "BF16"),)
        if a.ref_dtypes:
            ref_dtypes = tuple(
                (getattr(torch, {"F32": "float32", "BF16": "bfloat16"}[d.upper()]), d.upper())
                for d in a.ref_dtypes.split(",")
            )
        for dt, dl in ref_dtypes:
            log(f"reference: {label} {dl}")
            r = bench_reference(hf, prompt, cfg, a.threads, dt, max(1, a.reps - 1))
            rows.append(dict(model=label, backend=f"PyTorch ref {dl}", **r))

    sched = f"threshold {a.threshold}" if a.threshold else f"steps {max(1, a.block // 4)}/block"
    print(f"\nprompt {a.prompt_len} tokens, {a.new} new tokens, B={a.block}, {sched}, {a.threads} threads\n")
    hdr = f"{'model':28s} {'backend':22s} {'prompt tok/s':>12s} {'gen tok/s':>10s} {'steps/block':>11s}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(
            f"{r['model']:28s} {r['backend']:22s} {r['prompt_tps']:12.1f} {r['gen_tps']:10.1f} "
            f"{r['steps_per_block']:11.1f}"
        )
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
