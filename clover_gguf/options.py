"""The one table of the command-line options' ranges: every numeric option of every command
(cli.py and each package's commands.py) takes its click type from here, so a value out of
range is refused in one line by click before any work, and the library functions check the
same bounds.

Each bound says why; the server's request fields have their own table (serve/fields.py) with
the same top_k and seed bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import click

from .limits import BY_CONFIG, MAX_VOCAB

# ggml.h: the CPU thread pool's parameters hold a cpumask of GGML_MAX_N_THREADS entries, and
# ggml-cpu.c reads a graph's thread count from the 16 low bits of threadpool->n_graph
# (GGML_THREADPOOL_N_THREADS_MASK): with `serve -t 99999` OpenMP's workers number past what
# that field holds (99999 & 0xffff = 34463), workers with ith >= the masked count split work
# they do not own: the likely cause of the SIGSEGV on the first request (read from the source,
# not re-run: 99999 threads on a shared machine). Nothing above 512 is a sane thread count.
GGML_MAX_N_THREADS = 512
INT32_MAX = 2**31 - 1
SEED_MAX = 2**32 - 1  # clover_gen_params.seed is uint32; the reference masks the same bits
MAX_BLOCK = int(BY_CONFIG["block_size"].hi)
MAX_CONTEXT = int(BY_CONFIG["max_position_embeddings"].hi)


@dataclass(frozen=True)
class Range:
    lo: float
    hi: float
    why: str
    integer: bool = True
    lo_open: bool = False

    def describe(self) -> str:
        lo, hi = (int(self.lo), int(self.hi)) if self.integer else (f"{self.lo:g}", f"{self.hi:g}")
        return f"{'an integer' if self.integer else 'a finite number'} in {'(' if self.lo_open else '['}{lo}, {hi}]"

    def ok(self, v) -> bool:
        if isinstance(v, bool) or not isinstance(v, int | float) or (self.integer and not isinstance(v, int)):
            return False
        if isinstance(v, float) and not math.isfinite(v):
            return False
        return (v > self.lo if self.lo_open else v >= self.lo) and v <= self.hi

    def check(self, v, name: str) -> None:
        """ValueError naming the option, for the library functions behind the commands."""
        if not self.ok(v):
            raise ValueError(f"{name} {v}: must be {self.describe()}")


RANGES: dict[str, Range] = {
    "threads": Range(1, GGML_MAX_N_THREADS, "ggml's GGML_MAX_N_THREADS (above)"),
    "n_gpu_layers": Range(-1, 1024, "-1 or more than the layers: all; limits.py allows 512 layers + the output"),
    "ctx_size": Range(0, MAX_CONTEXT, "0: the GGUF's context_length; limits.py's context_length bound"),
    "context": Range(1, MAX_CONTEXT, "limits.py's context_length bound"),
    "port": Range(1, 65535, "a TCP port (0 would pick a random one the log cannot name)"),
    "top_k": Range(0, INT32_MAX, "clover_gen_params.top_k is int32 (0: off); it wrapped at 2^32 before"),
    "seed": Range(0, SEED_MAX, "clover_gen_params.seed is uint32"),
    "max_new_tokens": Range(1, 1 << 24, "far past any context a 2-core test model uses; int32 in the C API"),
    "block_size": Range(1, MAX_BLOCK, "limits.py's diffusion.block_size"),
    "steps": Range(1, MAX_BLOCK, "at most the block size (checked again against it)"),
    "parallel": Range(1, 64, "sequences of one context; clover.h batches up to n_seq_max"),
    "ctx_cache": Range(0, 4096, "snapshots in memory; each is one sequence's state"),
    "n_predict": Range(1, MAX_CONTEXT, "at most the context (capped to it)"),
    "queue_timeout": Range(0, 86400, "seconds (0: no limit); a day at most", integer=False),
    "temperature": Range(0, 100, "softmax(logits / T): beyond 100 every token is equally likely", integer=False),
    "top_p": Range(0, 1, "a probability mass", integer=False, lo_open=True),
    "threshold": Range(0, 1, "a confidence", integer=False),
    "layers": Range(1, int(BY_CONFIG["num_hidden_layers"].hi), "limits.py's num_hidden_layers"),
    "shard_size_mb": Range(0, 1e7, "MiB; 10 TB at most", integer=False, lo_open=True),
    "bandwidth": Range(1, 1e5, "GB/s; 100 TB/s at most", integer=False),
    "n_ctx_chunk": Range(1, 1 << 20, "tokens per imatrix chunk"),
    "count": Range(1, 1 << 20, "a count of windows, blocks, chunks, prompts, runs or requests"),
    "warmup": Range(0, 1000, "unrecorded runs"),
    "rounds": Range(1, 1000, "recorded rounds"),
    "prompt_len": Range(1, 1 << 20, "prompt tokens of a speed run"),
    "jobs": Range(1, 1024, "compile jobs"),
    "vocab": Range(1, MAX_VOCAB, "limits.py's vocab_size"),
}


def option_type(name: str) -> click.ParamType:
    """The click type of an option of the table: IntRange, or a finite float range."""
    r = RANGES[name]
    if r.integer:
        return click.IntRange(int(r.lo), int(r.hi))
    return Finite(r.lo, r.hi, r.lo_open)


class Finite(click.ParamType):
    """A finite float in [lo, hi] (click's FloatRange lets NaN through)."""

    name = "float"

    def __init__(self, lo: float, hi: float, lo_open: bool = False):
        self.lo, self.hi, self.lo_open = lo, hi, lo_open

    def convert(self, value, param, ctx):
        try:
            v = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        ok = math.isfinite(v) and (v > self.lo if self.lo_open else v >= self.lo) and v <= self.hi
        if not ok:
            self.fail(
                f"{value} is not a finite number in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]", param, ctx
            )
        return v


def int_list(name: str):
    """A click callback: comma-separated integers, each in the table's range for ``name``."""
    r = RANGES[name]

    def parse(ctx, param, value):
        if value is None:
            return None
        try:
            out = tuple(int(x) for x in str(value).split(",") if x.strip())
        except ValueError:
            raise click.BadParameter(f"{value!r}: integers separated by commas") from None
        if not out or any(not r.ok(v) for v in out):
            raise click.BadParameter(f"{value!r}: each must be {r.describe()}")
        return out

    return parse


class InputPath(click.Path):
    """click.Path(exists=True) for an input: a regular file, or a folder where ``dir_okay``;
    a FIFO, device or socket is refused here (reading one blocks or never ends)."""

    def __init__(self, file_okay: bool = True, dir_okay: bool = True):
        super().__init__(exists=True, file_okay=file_okay, dir_okay=dir_okay)

    def convert(self, value, param, ctx):
        import os
        import stat

        from .inputs import file_kind

        rv = super().convert(value, param, ctx)
        mode = os.stat(rv).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            self.fail(f"{value}: is {file_kind(mode)}, not a regular file", param, ctx)
        return rv
