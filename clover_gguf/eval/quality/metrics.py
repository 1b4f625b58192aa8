"""Quality metrics of a quantized model against the reference (pure functions, torch).

Conventions (the same as llama.cpp's ``llama-perplexity --kl-divergence``):

* NLL of the true token in **bits** per token (``-log2 p(true)``), for both models;
* KL divergence reference ‖ quantized, per scored position, in **nats**:
  ``KL(P‖Q) = Σ_v P_v (log P_v − log Q_v)``; summarised by mean, median, p99, p99.9, max;
* same-top-1: fraction of positions where both models' argmax agree;
* RMS Δp: root mean square over positions of ``Q(true) − P(true)`` (a probability, reported
  in percent in the Markdown report).

Scored distributions exclude the mask token (its logit is set to −inf before the softmax,
as generation does, CONTRACTS.md), so the KL compares the two models' distributions over
real tokens.

Compact reference logits
------------------------
The reference distribution P of each scored position is stored once as its top-k logits
(values and ids), the log-sum-exp ``lse`` of the full logits, and the log-probability of
the true token. For the top-k set T the probabilities ``P_i = exp(z_i − lse)`` are exact and
the tail mass ``ε = 1 − Σ_T P_i`` is known; the tail's shape is not. With the quantized
model's full distribution Q (computed at evaluation time) we report

    KL_c = Σ_{i∈T} P_i log(P_i/Q_i) + ε log(ε / Q_tail),     Q_tail = 1 − Σ_T Q_i,

the exact KL between P and Q with the tail lumped into one outcome. Error bound:

* lower: KL_c ≤ KL (log-sum inequality: merging outcomes never increases a divergence);
* upper: the true tail term Σ_tail P_i log(P_i/Q_i) is convex in the unknown tail
  probabilities, which satisfy 0 ≤ P_i ≤ P_(k) (each is at most the k-th largest, the
  smallest of the top-k) and Σ P_i = ε. A convex function on that polytope is largest at a
  vertex: m = ⌊ε/P_(k)⌋ tail entries at P_(k), one at the remainder r = ε − m P_(k), the rest 0;
  and it is largest when those sit on the smallest tail Q_i. So

      KL ≤ KL_c + δ,   δ = [m P_(k) log P_(k) − P_(k) Σ_{j<m} log Q_(j) + r log(r / Q_(m))] − ε log(ε/Q_tail)

  with Q_(j) the tail's Q sorted ascending. ``δ`` (≥ 0) is the stated error bound, per
  position; a mean over positions is bracketed by [mean KL_c, mean KL_c + mean δ].

``kl_compact`` returns KL_c and δ; ``tests/test_eval_metrics.py`` checks
KL_c ≤ KL ≤ KL_c + δ against the full-logit KL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

LN2 = math.log(2.0)


def masked_log_softmax(logits: torch.Tensor, exclude: int | None = None) -> torch.Tensor:
    """log softmax over the last dim in float64, with token ``exclude`` (the mask) removed."""
    z = logits.double()
    if exclude is not None and 0 <= exclude < z.shape[-1]:
        z = z.clone()
        z[..., exclude] = -torch.inf
    return torch.log_softmax(z, dim=-1)


def kl_full(ref_logits: torch.Tensor, q_logits: torch.Tensor, exclude: int | None = None) -> torch.Tensor:
    """KL(P_ref ‖ Q) in nats per row, from full logits [n, V]."""
    lp = masked_log_softmax(ref_logits, exclude)
    lq = masked_log_softmax(q_logits, exclude)
    p = lp.exp()
    t = torch.where(p > 0, p * (lp - lq), torch.zeros_like(p))
    return t.sum(-1).clamp_min(0.0)


# ---- compact reference logits ------------------------------------------------------------


@dataclass
class CompactLogits:
    """Reference distribution of n scored positions: top-k ids/logits, lse, true-token logprob."""

    top_ids: torch.Tensor  # [n, k] int32, by descending logit
    top_logits: torch.Tensor  # [n, k] float32 (the logits as the model produced them)
    lse: torch.Tensor  # [n] float64 log-sum-exp of the (mask-excluded) logits
    target_logp: torch.Tensor  # [n] float64 log P(true token) (nats)
    tail_logp: torch.Tensor  # [n] float64 log of the mass outside the top-k (summed over the tail itself)

    @property
    def n(self) -> int:
        return int(self.lse.shape[0])

    @property
    def k(self) -> int:
        return int(self.top_ids.shape[1])

    def top_logp(self) -> torch.Tensor:
        return self.top_logits.double() - self.lse[:, None]

    def tail_mass(self) -> torch.Tensor:
        return self.tail_logp.exp()

    def argmax(self) -> torch.Tensor:
        return self.top_ids[:, 0].long()

    def cat(self, other: CompactLogits) -> CompactLogits:
        return CompactLogits(*(torch.cat([a, b]) for a, b in zip(self._fields(), other._fields())))

    def _fields(self):
        return (self.top_ids, self.top_logits, self.lse, self.target_logp, self.tail_logp)

    def slice(self, a: int, b: int) -> CompactLogits:
        return CompactLogits(*(x[a:b] for x in self._fields()))

    def to_numpy(self) -> dict[str, np.ndarray]:
        return {
            "top_ids": self.top_ids.numpy().astype(np.int32),
            "top_logits": self.top_logits.numpy().astype(np.float32),
            "lse": self.lse.numpy().astype(np.float64),
            "target_logp": self.target_logp.numpy().astype(np.float64),
            "tail_logp": self.tail_logp.numpy().astype(np.float64),
        }

    @classmethod
    def from_numpy(cls, d) -> CompactLogits:
        return cls(
            torch.from_numpy(np.asarray(d["top_ids"], dtype=np.int32)),
            torch.from_numpy(np.asarray(d["top_logits"], dtype=np.float32)),
            torch.from_numpy(np.asarray(d["lse"])).double(),
            torch.from_numpy(np.asarray(d["target_logp"])).double(),
            torch.from_numpy(np.asarray(d["tail_logp"])).double(),
        )


def _lse(z: torch.Tensor) -> torch.Tensor:
    """float64 log-sum-exp over the last dim of float32 z: exp in float32 after subtracting
    the row max, sum in float64 (error ~1e-8, half the cost of converting z to float64)."""
    m = z.max(-1, keepdim=True).values
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = torch.exp(z - m).sum(-1, dtype=torch.float64)
    return m[..., 0].double() + torch.log(s)


def _prep(logits: torch.Tensor, exclude: int | None) -> torch.Tensor:
    """float32 copy of logits [n, V] with the excluded token at -inf."""
    z = logits.float().clone()
    if exclude is not None and 0 <= exclude < z.shape[-1]:
        z[:, exclude] = -torch.inf
    return z


def compact(logits: torch.Tensor, targets: torch.Tensor, k: int, exclude: int | None = None) -> CompactLogits:
    """Compact form of reference logits [n, V] (see the module docstring).

    Logits are float32 (as the models produce them); log-sum-exps are summed in float64
    (error ~1e-8 nats on every log-probability; the same computation for both models, so
    identical models give KL 0 exactly) and the rest of the arithmetic is float64. The tail
    mass is summed over the tail itself, so it is accurate even when tiny. Net precision of
    KL_c and of the bracket: ~1e-7 nats absolute."""
    z = _prep(logits, exclude)
    k = min(k, z.shape[-1] - (1 if exclude is not None else 0))
    vals, ids = torch.topk(z, k, dim=-1)
    lse = _lse(z)
    tl = z.gather(-1, targets.long()[:, None])[:, 0].double() - lse
    tail = _lse(z.scatter(-1, ids, -torch.inf)) - lse
    return CompactLogits(ids.int(), vals.float(), lse, tl, tail)


TAIL_TOPK_MAX = 1024  # smallest tail Q values taken exactly for the bound; beyond, a looser valid value


def _kl_compact_prepped(ref: CompactLogits, z: torch.Tensor, lse_q: torch.Tensor):
    """KL_c, delta from float32 logits z (excluded token at -inf) and their float64 lse."""
    tiny = 1e-300
    ids = ref.top_ids.long()
    lp_top = ref.top_logp()  # [n, k] float64
    p_top = lp_top.exp()
    lq_top = z.gather(-1, ids).double() - lse_q[:, None]
    head = (p_top * (lp_top - lq_top)).sum(-1)
    eps = ref.tail_mass()
    # tail masses summed over the tail itself (not 1 - head): accurate even when tiny
    q_tail = (_lse(z.scatter(-1, ids, -torch.inf)) - lse_q).exp().clamp_min(tiny)
    lumped = torch.where(eps > 0, eps * (torch.log(eps.clamp_min(tiny)) - torch.log(q_tail)), torch.zeros_like(eps))
    kl_c = (head + lumped).clamp_min(0.0)
    # upper bound of the tail term: the vertex of {0 <= P_i <= p_k, sum P_i = eps} that puts
    # m = floor(eps / p_k) entries of p_k and the remainder r on the smallest tail Q values
    p_k = p_top[:, -1].clamp_min(tiny)
    n_tail = torch.isfinite(z).sum(-1) - ref.k
    m = torch.minimum(torch.floor(eps / p_k).long(), n_tail.clamp_min(0))
    r = (eps - m.double() * p_k).clamp_min(0.0)
    need = int(
        min(
            int(m.max().item()) + 1 if m.numel() else 1,
            max(int(n_tail.max().item()) if m.numel() else 1, 1),
            TAIL_TOPK_MAX,
        )
    )
    zt = z.scatter(-1, ids, torch.inf)
    zt[~torch.isfinite(z)] = torch.inf  # excluded token: P = 0, not a tail slot
    small = torch.topk(zt, need, dim=-1, largest=False).values.double() - lse_q[:, None]  # ascending
    small = torch.where(torch.isfinite(small), small, torch.zeros_like(small))
    # j >= need: use the need-th smallest (<= the true value, so the bound stays valid)
    csum = torch.cat([torch.zeros_like(small[:, :1]), small.cumsum(-1)], dim=-1)  # csum[j] = sum_{<j}
    m_in = m.clamp(max=need)
    sum_m = csum.gather(-1, m_in[:, None])[:, 0] + (m - m_in).double() * small[:, -1]
    full = m.double() * p_k * torch.log(p_k) - p_k * sum_m
    lq_r = small.gather(-1, m.clamp(max=need - 1)[:, None])[:, 0]
    rem = torch.where(r > 0, r * (torch.log(r.clamp_min(tiny)) - lq_r), torch.zeros_like(r))
    upper_tail = torch.where(eps > 0, full + rem, torch.zeros_like(eps))
    delta = (upper_tail - lumped).clamp_min(0.0)
    return kl_c, delta


def kl_compact(ref: CompactLogits, q_logits: torch.Tensor, exclude: int | None = None):
    """(KL_c, delta) per position, nats: KL_c <= KL(P_ref||Q) <= KL_c + delta (module docstring)."""
    z = _prep(q_logits, exclude)
    return _kl_compact_prepped(ref, z, _lse(z))


# ---- per-position metrics and summaries -------------------------------------------------


def position_metrics(
    ref: CompactLogits, q_logits: torch.Tensor, targets: torch.Tensor, exclude: int | None = None
) -> dict[str, np.ndarray]:
    """Per scored position: ref/q NLL (bits), KL_c and its bound delta (nats), same-top-1, dp."""
    z = _prep(q_logits, exclude)
    lse_q = _lse(z)
    q_tl = z.gather(-1, targets.long()[:, None])[:, 0].double() - lse_q
    kl_c, delta = _kl_compact_prepped(ref, z, lse_q)
    same = z.argmax(-1) == ref.argmax()
    return {
        "ref_nll_bits": (-ref.target_logp / LN2).numpy(),
        "q_nll_bits": (-q_tl / LN2).numpy(),
        "kl": kl_c.numpy(),
        "kl_bound": delta.numpy(),
        "same_top1": same.numpy().astype(np.float64),
        "dp": (q_tl.exp() - ref.target_logp.exp()).numpy(),
    }


def percentile(x: np.ndarray, q: float) -> float:
    """Percentile with linear interpolation (numpy's default), nan for an empty array."""
    x = np.asarray(x, dtype=np.float64)
    return float(np.percentile(x, q)) if x.size else float("nan")


def summarize(pm: dict[str, np.ndarray], idx: np.ndarray | None = None) -> dict:
    """Summary of per-position metrics (optionally restricted to the positions ``idx``)."""
    sel = (lambda a: np.asarray(a)[idx]) if idx is not None else (lambda a: np.asarray(a))
    kl, n = sel(pm["kl"]), int(sel(pm["kl"]).size)
    if n == 0:
        return {"n": 0}
    ref_nll, q_nll, same, dp, bound = (
        sel(pm[k]) for k in ("ref_nll_bits", "q_nll_bits", "same_top1", "dp", "kl_bound")
    )
    return {
        "n": n,
        "ref_nll_bits": float(ref_nll.mean()),
        "q_nll_bits": float(q_nll.mean()),
        "delta_nll_bits": float((q_nll - ref_nll).mean()),
        "kl_mean": float(kl.mean()),
        "kl_mean_se": float(kl.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0,
        "kl_median": percentile(kl, 50),
        "kl_p99": percentile(kl, 99),
        "kl_p999": percentile(kl, 99.9),
        "kl_max": float(kl.max()),
        "kl_mean_bound": float(bound.mean()),  # mean KL ∈ [kl_mean, kl_mean + kl_mean_bound]
        "kl_max_bound": float(bound.max()),
        "same_top1": float(same.mean()),
        "rms_dp": float(math.sqrt((dp**2).mean())),
    }


def summarize_identical() -> dict:
    """What summarize gives for a model against itself (documentation / tests)."""
    return {"kl_mean": 0.0, "same_top1": 1.0, "rms_dp": 0.0}


# ---- generation agreement -----------------------------------------------------------------


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(ref_tokens: list[list[int]], q_tokens: list[list[int]]) -> dict:
    """Token agreement of generations with the reference's, prompt by prompt.

    exact_match: fraction of prompts whose whole output equals the reference's;
    token_match: fraction of reference positions holding the same token;
    mean_common_prefix: mean length (tokens) of the common prefix;
    mean_common_prefix_frac: the same as a fraction of the reference output's length."""
    if len(ref_tokens) != len(q_tokens):
        raise ValueError("agreement: different numbers of generations")
    if not ref_tokens:
        return {"n": 0}
    ex, pre, frac, same, tot = 0, [], [], 0, 0
    for a, b in zip(ref_tokens, q_tokens):
        ex += int(list(a) == list(b))
        p = common_prefix(a, b)
        pre.append(p)
        frac.append(p / len(a) if len(a) else 1.0)
        same += sum(int(x == y) for x, y in zip(a, b))
        tot += max(len(a), len(b))
    return {
        "n": len(ref_tokens),
        "exact_match": ex / len(ref_tokens),
        "mean_common_prefix": float(np.mean(pre)),
        "mean_common_prefix_frac": float(np.mean(frac)),
        "token_match": same / tot if tot else 1.0,
    }


def spread(values) -> dict:
    """median, p10, p90 (and n, mean, min, max) of repeated measurements; no best-of."""
    v = np.asarray(list(values), dtype=np.float64)
    if v.size == 0:
        return {"n": 0}
    return {
        "n": int(v.size),
        "median": float(np.median(v)),
        "p10": float(np.percentile(v, 10)),
        "p90": float(np.percentile(v, 90)),
        "mean": float(v.mean()),
        "min": float(v.min()),
        "max": float(v.max()),
        "values": [float(x) for x in v],
    }
