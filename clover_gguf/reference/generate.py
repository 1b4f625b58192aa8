"""Block-diffusion generation (spec section 4), independent of the backend that computes
logits: the PyTorch reference here, the llama.cpp runtime through the same interface."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch


class LogitsBackend(Protocol):
    """What the loop needs from a model: commit a prompt, denoise a block, commit a block."""

    def prefill(self, tokens: list[int], block_size: int) -> None: ...
    def block_logits(self, block: list[int]) -> torch.Tensor: ...  # [L, V] float32
    def commit(self, block: list[int]) -> None: ...


class TorchBackend:
    """The PyTorch reference as a LogitsBackend for one sequence."""

    def __init__(self, model, prefill_mode: str = "parallel"):
        self.model, self.mode = model, prefill_mode
        self.state, self.pos = model.init_state(1), 0

    def prefill(self, tokens, block_size):
        self.state = self.model.prefill(torch.tensor([tokens]), block_size, self.state, self.pos, self.mode)
        self.pos += len(tokens)

    def block_logits(self, block):
        return self.model.block_logits(torch.tensor([block]), self.pos, self.state)[0]

    def commit(self, block):
        _, self.state = self.model.commit(torch.tensor([block]), self.pos, self.state)
        self.pos += len(block)


@dataclass
class GenerationConfig:
    max_new_tokens: int = 64
    block_size: int = 16
    steps: int | None = None  # `steps` schedule: T steps per block
    threshold: float | None = None  # `threshold` schedule (used when steps is None); default 0.9
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0
    mask_token_id: int = 1
    eos_token_id: int | None = None

    def validate(self):
        import math

        from ..limits import BY_CONFIG

        bmax = int(BY_CONFIG["block_size"].hi)
        if not 1 <= self.block_size <= bmax:
            raise ValueError(f"block_size {self.block_size}: must be an integer in [1, {bmax}]")
        if self.steps is not None and not 1 <= self.steps <= self.block_size:
            raise ValueError(f"steps {self.steps}: must be an integer in [1, {self.block_size}] (the block size)")
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold {self.threshold}: must be a finite number in [0, 1]")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature {self.temperature}: must be a finite number >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k {self.top_k}: must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p {self.top_p}: must be a finite number in (0, 1]")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens {self.max_new_tokens}: must be >= 0")


@dataclass
class BlockStats:
    index: int
    n_tokens: int
    steps: int
    tokens_per_step: list[int] = field(default_factory=list)
    ms_per_step: list[float] = field(default_factory=list)


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


def candidates(logits: torch.Tensor, cfg: GenerationConfig, gen: torch.Generator):
    """Candidate token and its confidence for each row of logits [n, V] (see CONTRACTS.md:
    confidence = p(candidate) under softmax(logits / T), before top-k/top-p)."""
    logits = logits.float().clone()
    logits[:, cfg.mask_token_id] = -torch.inf  # the mask token is never a candidate
    if cfg.temperature == 0:
        probs = torch.softmax(logits, -1)
        conf, tok = probs.max(-1)  # max() returns the lowest index among ties
        return tok, conf
    scaled = logits / cfg.temperature
    probs = torch.softmax(scaled, -1)
    filt = scaled.clone()
    if cfg.top_k > 0 and cfg.top_k < filt.shape[-1]:
        kth = torch.topk(filt, cfg.top_k, -1).values[..., -1:]
        filt[filt < kth] = -torch.inf
    if cfg.top_p < 1.0:
        srt, idx = torch.sort(filt, -1, descending=True)
        cum = torch.softmax(srt, -1).cumsum(-1)
        drop = cum - torch.softmax(srt, -1) >= cfg.top_p  # keep the smallest prefix reaching top_p
        srt[drop] = -torch.inf
        filt = torch.full_like(filt, -torch.inf).scatter(-1, idx, srt)
    tok = torch.multinomial(torch.softmax(filt, -1), 1, generator=gen)[:, 0]
    return tok, probs.gather(-1, tok[:, None])[:, 0]


def pick(conf: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the n most confident entries, ties to the lower index."""
    order = torch.sort(-conf, stable=True).indices
    return order[:n]


def denoise_block(backend: LogitsBackend, L: int, cfg: GenerationConfig, gen: torch.Generator, index: int = 0):
    """Run one block from all-mask to clean. Returns (tokens, BlockStats)."""
    block = [cfg.mask_token_id] * L
    masked = list(range(L))
    stats = BlockStats(index=index, n_tokens=L, steps=0)
    plan = steps_schedule(L, cfg.steps) if cfg.steps is not None else None
    thr = cfg.threshold if cfg.threshold is not None else 0.9
    while masked:
        t0 = time.perf_counter()
        logits = backend.block_logits(block)
        tok, conf = candidates(logits[masked], cfg, gen)
        if plan is not None:
            chosen = pick(conf, plan[stats.steps])
        else:
            chosen = torch.nonzero(conf >= thr)[:, 0]
            if chosen.numel() == 0:
                chosen = pick(conf, 1)
        done = set(chosen.tolist())
        for j in done:
            block[masked[j]] = int(tok[j])
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
    cfg.validate()
    gen = torch.Generator().manual_seed(cfg.seed)
    t_start = time.perf_counter()
    backend.prefill(list(prompt), cfg.block_size)
    prefill_ms = (time.perf_counter() - t_start) * 1e3
    out: list[int] = []
    blocks: list[BlockStats] = []
    while len(out) < cfg.max_new_tokens:
        L = min(cfg.block_size, cfg.max_new_tokens - len(out))
        block, stats = denoise_block(backend, L, cfg, gen, index=len(blocks))
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
