"""Steady-state tokens/s of clover-tiny's training step on random tokens (the training
script's --bench): the median and range over a number of steps per batch shape, after one
warm-up step (the first step of a shape compiles and warms the caches)."""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from ..config import CloverConfig
from . import TrainError
from . import trainer as T


def parse_shapes(spec: str) -> list[tuple[int, int, int]]:
    """ "16x16x17,8x32x9" -> [(sequences, block size, blocks per sequence), ...]."""
    try:
        shapes = [tuple(map(int, s.split("x"))) for s in spec.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 3 or min(s) < 1 for s in shapes):
        raise TrainError(f"--bench {spec}: expected a comma list of NxBxNB (sequences x block size x blocks)")
    return shapes


def bench_train_steps(c: CloverConfig, tc: T.TrainConfig, spec: str, steps: int, log=print) -> list[dict]:
    """Time `steps` train steps (after a warm-up one) of each shape in spec; one log line per shape."""
    shapes = parse_shapes(spec)
    if steps < 1:
        raise TrainError(f"--bench-steps {steps}: at least 1 timed step per shape")
    torch.set_num_threads(tc.threads)
    m = T.new_model(c, tc.seed).to(tc.device)
    ms = T.MasterWeights(m) if tc.precision == "bf16" else None
    opt = T.make_optimizer(m, tc, ms)
    if tc.compile:
        T.compile_model(m)
    stream = torch.randint(2, c.vocab_size, (500_000,))
    g = torch.Generator().manual_seed(0)
    out = []
    for name, (n, B, nb) in zip(spec.split(","), shapes, strict=True):
        rates, cpu_rates = [], []
        for i in range(steps + 1):
            b = T.sample_batch(stream, n, B, nb, g, c.mask_token_id, c.pad_token_id).to(tc.device)
            w0, c0 = time.time(), time.process_time()
            st = T.train_step(m, opt, b, tc, 1e-4, ms)
            if i:  # the first step of a shape compiles / warms up
                rates.append(st["n_tokens"] / (time.time() - w0))
                cpu_rates.append(st["n_tokens"] / (time.process_time() - c0))
        log(
            f"bench {name} vocab={c.vocab_size} threads={tc.threads} precision={tc.precision} "
            f"compile={tc.compile}: median {np.median(rates):.0f} tok/s wall (range {min(rates):.0f}-"
            f"{max(rates):.0f}, {len(rates)} steps), {np.median(cpu_rates):.0f} tok per CPU-s; "
            f"load average {os.getloadavg()[0]:.2f}"
        )
        out.append({"shape": name, "tok_per_s": rates, "tok_per_cpu_s": cpu_rates})
    return out
