"""Candidate token and confidence of each masked row (docs/CONTRACTS.md, "Sampling").

Sampling uses the Gumbel-max trick with noise from a counter-based generator, the same bits in
the PyTorch reference, the llama.cpp runtime's host path and its ggml op (ggml_gumbel_argmax,
CPU and CUDA): a seed gives the same tokens on every backend. The noise of vocabulary column c
in a row is a pure function of

    step_key = mix(mix(seed) ^ (block_index << 32 | step))
    row_key  = mix(step_key ^ position)                    (the row's absolute position)
    u        = (top 24 bits of mix(row_key ^ c * GOLDEN) + 0.5) / 2**24
    g        = -log(-log(u))

with mix = splitmix64. The candidate is argmax_c of logit_c / T + g_c (argmax_c logit_c when
T = 0), over the kept columns (the mask token is never kept; top-k, then top-p, shrink the set),
ties to the lower column. The confidence is the candidate's probability under softmax(logits / T)
(T = 1 when greedy) over every column but the mask token, before top-k/top-p.
"""

from __future__ import annotations

from collections import Counter, deque

import numpy as np
import torch

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def mix64(x: int) -> int:
    """splitmix64 of a Python int (mod 2**64)."""
    x = (x + GOLDEN) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def step_key(seed: int, block_index: int, step: int) -> int:
    return mix64(mix64(seed & MASK64) ^ (((block_index & 0xFFFFFFFF) << 32) | (step & 0xFFFFFFFF)))


def row_key(skey: int, pos: int) -> int:
    return mix64(skey ^ (pos & 0xFFFFFFFF))


def gumbel_noise(key: int, cols: np.ndarray) -> np.ndarray:
    """g(key, c) for the columns `cols` (float64), bit for bit the C version."""
    with np.errstate(over="ignore"):
        z = np.uint64(key) ^ (cols.astype(np.uint64) * np.uint64(GOLDEN))
        z = z + np.uint64(GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    u = ((z >> np.uint64(40)).astype(np.float64) + 0.5) * (1.0 / 16777216.0)
    return -np.log(-np.log(u))


def _kept(a: np.ndarray, t: float, mask_token_id: int, top_k: int, top_p: float) -> np.ndarray:
    """Columns kept by top-k and top-p, as the runtime's host path ranks them: by probability
    (float32 of exp((a - max) / T)) descending, ties to the lower column."""
    cols = np.delete(np.arange(a.shape[0]), mask_token_id)
    e = np.exp((a[cols].astype(np.float64) - a[cols].max()) / t).astype(np.float32)
    order = np.lexsort((cols, -e))
    n_keep = len(order)
    if 0 < top_k < n_keep:
        n_keep = top_k
    if 0.0 < top_p < 1.0:
        kept = e[order[:n_keep]].astype(np.float64)
        target = top_p * kept.sum()
        cum, k = 0.0, 0
        while k < n_keep and cum < target:
            cum += kept[k]
            k += 1
        n_keep = max(1, k)
    return cols[order[:n_keep]]


def candidates(
    logits: torch.Tensor, keys: list[int], *, temperature: float, top_k: int, top_p: float, mask_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(candidate [n], confidence [n]) for logits [n, V] and the rows' noise keys."""
    logits = logits.float().clone()
    logits[:, mask_token_id] = -torch.inf
    if temperature == 0:
        conf, tok = torch.softmax(logits, -1).max(-1)  # max() gives the lowest index among ties
        return tok, conf
    t = float(np.float32(temperature))  # the runtime holds T as a float
    probs = torch.softmax(logits.double() / t, -1)
    a = logits.numpy()
    toks = []
    for r, key in enumerate(keys):
        if top_k > 0 or 0.0 < top_p < 1.0:
            cols = np.sort(_kept(a[r], t, mask_token_id, top_k, top_p))
        else:
            cols = np.delete(np.arange(a.shape[1]), mask_token_id)
        score = a[r, cols].astype(np.float64) / t + gumbel_noise(key, cols)
        toks.append(int(cols[int(np.argmax(score))]))
    tok = torch.tensor(toks, dtype=torch.long)
    return tok, probs.gather(-1, tok[:, None])[:, 0].float()


class LogitBias:
    """logit_bias, then the presence and frequency penalties, on a step's masked rows (docs/CONTRACTS.md,
    "Logit bias and penalties"): llama.cpp's logit_bias and penalties samplers (repeat penalty off),
    in float32 as they compute. `accept(token)` counts a token unmasked at an earlier step; the
    window keeps the last `last_n` accepted."""

    def __init__(self, logit_bias: dict[int, float], presence: float, frequency: float, last_n: int):
        self.bias = [(int(t), np.float32(b)) for t, b in sorted(logit_bias.items())]
        self.presence, self.frequency = np.float32(presence), np.float32(frequency)
        self.last_n = last_n if (presence or frequency) else 0
        self.window: deque[int] = deque()
        self.count: Counter[int] = Counter()

    @classmethod
    def of(cls, cfg) -> LogitBias | None:
        """The cfg's (a GenerationConfig), or None when it biases nothing."""
        if not cfg.biases():
            return None
        return cls(cfg.active_logit_bias(), cfg.presence_penalty, cfg.frequency_penalty, cfg.penalty_last_n())

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Rows [n, V] float32 -> the biased and penalised rows (a new tensor)."""
        a = logits.float().numpy().copy()
        for t, b in self.bias:
            a[:, t] += b
        for t, c in self.count.items():
            a[:, t] -= np.float32(c) * self.frequency + np.float32(c > 0) * self.presence
        return torch.from_numpy(a)

    def accept(self, token: int) -> None:
        if self.last_n == 0:
            return
        self.count[token] += 1
        if len(self.window) >= self.last_n:
            old = self.window.popleft()
            self.count[old] -= 1
            if self.count[old] == 0:
                del self.count[old]
        self.window.append(token)
