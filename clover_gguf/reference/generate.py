"""Block-diffusion generation (spec section 4), independent of the backend that computes
logits: the PyTorch reference here, the llama.cpp runtime through the same interface."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch

from ..constants import DEFAULT_THRESHOLD
from ..errors import CloverError
from ..generation.config import GenerationConfig
from .sampling import LogitBias, candidates, row_key, step_key


class LogitsBackend(Protocol):
    """What the loop needs from a model: commit a prompt, denoise a block, commit a block."""

    def prefill(self, tokens: list[int], block_size: int) -> None: ...
    def block_logits(self, block: list[int]) -> torch.Tensor: ...  # [L, V] float32
    def commit(self, block: list[int]) -> None: ...


class NonFiniteError(CloverError, ValueError):
    """A denoising step's logits are not finite (NaN or Inf): generation stops instead of turning
    them into tokens. The message says where, and the first layer or tensor whose output went
    non-finite when a debug pass found it (reference/nonfinite.py, runtime/nonfinite.py)."""


class TorchBackend:
    """The PyTorch reference as a LogitsBackend for one sequence."""

    def __init__(self, model, prefill_mode: str = "parallel"):
        self.model, self.mode = model, prefill_mode
        self.n_vocab = model.config.vocab_size
        self.state, self.pos = model.init_state(1), 0
        self.commits: list[tuple[list[int], int]] = []  # what the state holds, for diagnose()

    def prefill(self, tokens, block_size):
        self.state = self.model.prefill(torch.tensor([tokens]), block_size, self.state, self.pos, self.mode)
        self.pos += len(tokens)
        self.commits.append((list(tokens), block_size))

    def block_logits(self, block):
        return self.model.block_logits(torch.tensor([block]), self.pos, self.state)[0]

    def commit(self, block):
        _, self.state = self.model.commit(torch.tensor([block]), self.pos, self.state)
        self.pos += len(block)
        self.commits.append((list(block), len(block)))

    def diagnose(self, block) -> str:
        """The first module whose output is not finite, replaying this sequence with hooks."""
        from .nonfinite import first_nonfinite_module

        found, checked = first_nonfinite_module(self.model, self.commits, list(block))
        if found:
            return f"; the first non-finite output is {found}"
        return f"; a debug pass over the committed tokens and this step found all {checked} module outputs finite"


@dataclass
class BlockStats:
    index: int
    n_tokens: int
    steps: int
    tokens_per_step: list[int] = field(default_factory=list)
    ms_per_step: list[float] = field(default_factory=list)
    # each position's probability at the step that unmasked it, and (n_probs) its row's most
    # probable (token, probability) pairs then (runtime only)
    probs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass
class GenerationResult:
    tokens: list[int]
    blocks: list[BlockStats]
    prompt_tokens: int
    prefill_ms: float
    total_ms: float

    def to_dict(self) -> dict:
        return asdict(self)


def steps_schedule(n_masked: int, steps: int) -> list[int]:
    """LLaDA: n masked tokens over T steps as evenly as possible, the remainder early.
    T is clamped to n so that every step unmasks at least one token."""
    T = max(1, min(steps, n_masked))
    base, rem = divmod(n_masked, T)
    return [base + (1 if s < rem else 0) for s in range(T)]


def pick(conf: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the n most confident entries, ties to the lower index."""
    order = torch.sort(-conf, stable=True).indices
    return order[:n]


def _check_finite(backend, logits, masked, block, index, step, pos0) -> None:
    """Non-finite logits never become tokens (clover.h's CLOVER_ERR_NONFINITE, here)."""
    rows = logits[masked]
    ok = torch.isfinite(rows).all(dim=-1)
    if bool(ok.all()):
        return
    bad = masked[int(torch.nonzero(~ok)[0, 0])]
    diag = backend.diagnose(block) if hasattr(backend, "diagnose") else ""
    raise NonFiniteError(
        f"non-finite logits in a denoising step (block {index}, step {step}, position {pos0 + bad}){diag}"
    )


def denoise_block(
    backend: LogitsBackend,
    L: int,
    cfg: GenerationConfig,
    index: int = 0,
    pos0: int = 0,
    bias: LogitBias | None = None,
):
    """Run one block (the index-th generated block, at position pos0) from all-mask to clean,
    the masked rows through `bias` (logit bias and penalties; it accepts each step's unmasked
    tokens in position order after the step). Returns (tokens, BlockStats)."""
    block = [cfg.mask_token_id] * L
    masked = list(range(L))
    stats = BlockStats(index=index, n_tokens=L, steps=0)
    plan = steps_schedule(L, cfg.steps) if cfg.steps is not None else None
    thr = cfg.threshold if cfg.threshold is not None else DEFAULT_THRESHOLD
    while masked:
        t0 = time.perf_counter()
        logits = backend.block_logits(block)
        _check_finite(backend, logits, masked, block, index, stats.steps, pos0)
        skey = step_key(cfg.seed, index, stats.steps)
        rows = logits[masked] if bias is None else bias.apply(logits[masked])
        tok, conf = candidates(
            rows,
            [row_key(skey, pos0 + i) for i in masked],
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            mask_token_id=cfg.mask_token_id,
        )
        if plan is not None:
            chosen = pick(conf, plan[stats.steps])
        else:
            chosen = torch.nonzero(conf >= thr)[:, 0]
            if chosen.numel() == 0:
                chosen = pick(conf, 1)
        done = set(chosen.tolist())
        for j in done:
            block[masked[j]] = int(tok[j])
        for p in sorted(masked[j] for j in done) if bias is not None else ():
            bias.accept(block[p])  # after the step: tokens unmasked together do not penalise each other
        masked = [p for j, p in enumerate(masked) if j not in done]
        stats.steps += 1
        stats.tokens_per_step.append(int(chosen.numel()))
        stats.ms_per_step.append((time.perf_counter() - t0) * 1e3)
    return block, stats


def generate(
    backend: LogitsBackend,
    prompt: list[int],
    cfg: GenerationConfig,
    on_block: Callable[[list[int], BlockStats], bool | None] | None = None,
) -> GenerationResult:
    """Prefill, then blocks of cfg.block_size until max_new_tokens or a block holding EOS.
    `on_block(tokens, stats)` is called after each block; returning False stops."""
    cfg.validate(getattr(backend, "n_vocab", None))
    if cfg.grammar is not None or cfg.n_probs or cfg.first_block is not None:
        raise ValueError("grammar, n_probs and first_block need the llama.cpp runtime (a .gguf model)")
    t_start = time.perf_counter()
    backend.prefill(list(prompt), cfg.block_size)
    prefill_ms = (time.perf_counter() - t_start) * 1e3
    out: list[int] = []
    blocks: list[BlockStats] = []
    bias = LogitBias.of(cfg)
    while len(out) < cfg.max_new_tokens:
        L = min(cfg.block_size, cfg.max_new_tokens - len(out))
        block, stats = denoise_block(backend, L, cfg, index=len(blocks), pos0=len(prompt) + len(out), bias=bias)
        out.extend(block)
        blocks.append(stats)
        stop = cfg.eos_token_id is not None and cfg.eos_token_id in block
        if on_block is not None and on_block(block, stats) is False:
            stop = True
        if stop or len(out) >= cfg.max_new_tokens:
            break
        backend.commit(block)
    if cfg.eos_token_id is not None and cfg.eos_token_id in out:
        out = out[: out.index(cfg.eos_token_id)]
    return GenerationResult(out, blocks, len(prompt), prefill_ms, (time.perf_counter() - t_start) * 1e3)
