"""The one generation config: the block size, schedule and sampling of block-diffusion
generation, read by both backends (reference/generate.py's loop and the llama.cpp runtime)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GenerationConfig:
    max_new_tokens: int = 64
    block_size: int = 16
    steps: int | None = None  # `steps` schedule: T steps per block
    threshold: float | None = None  # `threshold` schedule (used when steps is None); default DEFAULT_THRESHOLD
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0
    mask_token_id: int = 1
    eos_token_id: int | None = None
    # runtime only (clover.h): a GBNF grammar (rule `root`) the output must match, decoded left
    # to right (docs/CONTRACTS.md), from the first of `grammar_triggers` (token ids) on if given
    # (llama.cpp's lazy grammar); the most probable tokens to report per position; the first
    # block's tokens, the runtime's mask token where a position is generated (infill)
    grammar: str | None = None
    grammar_triggers: list[int] | None = None
    n_probs: int = 0
    first_block: list[int] | None = None

    def validate(self):
        import math

        from ..limits import BY_CONFIG
        from ..options import INT32_MAX, SEED_MAX

        bmax = int(BY_CONFIG["block_size"].hi)
        if not 1 <= self.block_size <= bmax:
            raise ValueError(f"block_size {self.block_size}: must be an integer in [1, {bmax}]")
        if self.steps is not None and not 1 <= self.steps <= self.block_size:
            raise ValueError(f"steps {self.steps}: must be an integer in [1, {self.block_size}] (the block size)")
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold {self.threshold}: must be a finite number in [0, 1]")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature {self.temperature}: must be a finite number >= 0")
        if not 0 <= self.top_k <= INT32_MAX:  # clover_gen_params.top_k is int32: it wrapped before
            raise ValueError(f"top_k {self.top_k}: must be an integer in [0, {INT32_MAX}] (0: off)")
        if not 0 <= self.seed <= SEED_MAX:  # clover_gen_params.seed is uint32
            raise ValueError(f"seed {self.seed}: must be an integer in [0, {SEED_MAX}]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p {self.top_p}: must be a finite number in (0, 1]")
        if not 0 <= self.max_new_tokens <= INT32_MAX:
            raise ValueError(f"max_new_tokens {self.max_new_tokens}: must be an integer in [0, {INT32_MAX}]")
        if not 0 <= self.n_probs <= 64:
            raise ValueError(f"n_probs {self.n_probs}: must be an integer in [0, 64]")
