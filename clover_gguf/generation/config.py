"""The one generation config: the block size, schedule and sampling of block-diffusion
generation, read by both backends (reference/generate.py's loop and the llama.cpp runtime)."""

from __future__ import annotations

from dataclasses import dataclass

# the penalties' window: the last tokens unmasked that count (docs/CONTRACTS.md, "Logit bias and
# penalties"); a reply's max_new_tokens up to this many, so that the whole reply counts
PENALTY_LAST_N_MAX = 65536


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
    # both backends: OpenAI's penalties (each in [-2, 2]) and logit_bias ({token id: bias in
    # [-100, 100]}), llama.cpp's samplers on every generated position (docs/CONTRACTS.md); 0 / None: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None

    def biases(self) -> bool:
        """A logit bias or a penalty is on (else every path is as without them)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or bool(self.active_logit_bias())

    def active_logit_bias(self) -> dict[int, float]:
        """logit_bias without its zero entries, by token id."""
        return {int(t): float(b) for t, b in sorted((self.logit_bias or {}).items()) if b != 0}

    def penalty_last_n(self) -> int:
        """The penalties' window: the whole reply (its max_new_tokens, or first_block's length if
        longer) up to PENALTY_LAST_N_MAX tokens."""
        n = max(self.max_new_tokens, len(self.first_block or ()))
        return min(n, PENALTY_LAST_N_MAX)

    def validate(self, n_vocab: int | None = None):
        """ValueError naming the first field out of range; logit_bias's token ids are checked
        against n_vocab when given (the model's vocabulary size)."""
        import math
        from numbers import Integral, Real

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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, Real) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} {v!r}: must be a finite number in [-2, 2] (0: off)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(
                    f"logit_bias: must be a mapping of token ids to biases, not {type(self.logit_bias).__name__}"
                )
            hi = (n_vocab if n_vocab is not None else INT32_MAX + 1) - 1
            vocab = " (the model's vocabulary)" if n_vocab is not None else ""
            for t, b in self.logit_bias.items():
                if isinstance(t, bool) or not isinstance(t, Integral) or not 0 <= t <= hi:
                    raise ValueError(f"logit_bias: token id {t!r}: must be an integer in [0, {hi}]{vocab}")
                if isinstance(b, bool) or not isinstance(b, Real) or not -100.0 <= b <= 100.0:
                    raise ValueError(f"logit_bias[{t}] {b!r}: must be a finite number in [-100, 100]")
