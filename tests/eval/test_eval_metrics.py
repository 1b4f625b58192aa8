"""eval.quality.metrics against hand-computed cases, and the compact reference logits' error bound."""

import math

import numpy as np
import pytest
import torch

from clover_gguf.eval.quality import metrics as M


def test_identical_models_give_zero_kl_and_full_agreement():
    torch.manual_seed(0)
    z = torch.randn(50, 40) * 4
    t = torch.randint(0, 40, (50,))
    pm = M.position_metrics(M.compact(z, t, 40), z, t)
    s = M.summarize(pm)
    assert s["kl_mean"] == pytest.approx(0, abs=1e-12) and s["kl_max"] == pytest.approx(0, abs=1e-12)
    assert s["same_top1"] == 1.0
    assert s["rms_dp"] == pytest.approx(0, abs=1e-12)
    assert s["ref_nll_bits"] == pytest.approx(s["q_nll_bits"], abs=1e-9)
    assert s["kl_mean_bound"] == pytest.approx(0, abs=1e-12)


def test_known_perturbation_gives_known_kl_nll_dp():
    # P = softmax([0, 0]) = (1/2, 1/2); Q = softmax([ln 3, 0]) = (3/4, 1/4)
    # KL(P||Q) = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3)
    ref = torch.tensor([[0.0, 0.0]])
    q = torch.tensor([[math.log(3.0), 0.0]])
    assert M.kl_full(ref, q).item() == pytest.approx(0.5 * math.log(4 / 3), rel=1e-7)  # ln 3 rounded to f32
    t = torch.tensor([0])
    pm = M.position_metrics(M.compact(ref, t, 2), q, t)
    assert pm["kl"][0] == pytest.approx(0.5 * math.log(4 / 3), rel=1e-7)
    assert pm["ref_nll_bits"][0] == pytest.approx(1.0)  # -log2(1/2)
    assert pm["q_nll_bits"][0] == pytest.approx(-math.log2(0.75), rel=1e-7)
    assert pm["dp"][0] == pytest.approx(0.25, rel=1e-7)
    assert pm["same_top1"][0] == 1.0  # P ties -> lowest id 0; Q's argmax is 0


def test_kl_is_shift_invariant_and_ignores_the_mask_token():
    torch.manual_seed(1)
    z = torch.randn(8, 30)
    assert M.kl_full(z, z + 7.5).max().item() == pytest.approx(0, abs=1e-12)
    q = z.clone()
    q[:, 5] += 10.0  # only the mask token's logit moves
    assert M.kl_full(z, q, exclude=5).max().item() == pytest.approx(0, abs=1e-12)
    assert M.kl_full(z, q).min().item() > 0.1


def test_same_top1_rms_dp_and_percentiles_by_hand():
    ref = torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 2.0], [2.0, 0.0, 0.0]])
    q = torch.tensor([[2.0, 0.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 2.0], [0.0, 2.0, 0.0]])
    t = torch.tensor([0, 1, 2, 0])
    pm = M.position_metrics(M.compact(ref, t, 3), q, t)
    s = M.summarize(pm)
    assert s["same_top1"] == 0.5
    # rows 1 and 3: p(true) moves from e^2/(e^2+2) to 1/(e^2+2)
    d = (1 - math.exp(2)) / (math.exp(2) + 2)
    assert s["rms_dp"] == pytest.approx(math.sqrt(2 * d * d / 4))
    x = np.arange(1001, dtype=float)
    assert M.percentile(x, 99) == pytest.approx(990.0) and M.percentile(x, 99.9) == pytest.approx(999.0)


@pytest.mark.parametrize("k", [1, 4, 16, 64, 200])
@pytest.mark.parametrize("temp", [1.0, 4.0])
def test_compact_kl_brackets_the_full_kl(k, temp):
    """KL_c <= KL(full) <= KL_c + delta, for sharp and flat references, with the mask excluded."""
    g = torch.Generator().manual_seed(k)
    V = 200
    ref = torch.randn(64, V, generator=g) * temp
    q = ref + 0.3 * torch.randn(64, V, generator=g)
    t = torch.randint(0, V, (64,), generator=g)
    c = M.compact(ref, t, k, exclude=3)
    kl_c, delta = M.kl_compact(c, q, exclude=3)
    kl = M.kl_full(ref, q, exclude=3)
    assert torch.all(kl_c <= kl + 1e-7)
    assert torch.all(kl <= kl_c + delta + 1e-7)
    if k >= V - 1:
        assert delta.max().item() == pytest.approx(0, abs=1e-12)
        assert torch.allclose(kl_c, kl, atol=1e-7)


def test_compact_bound_shrinks_with_k_and_stays_within_the_closed_form():
    """delta decreases as k grows, vanishes at k = V, and never exceeds the simple closed form
    eps * (log P_(k) - log min_tail Q) - eps * log(eps / Q_tail)."""
    g = torch.Generator().manual_seed(0)
    V = 1024
    ref = torch.randn(32, V, generator=g) * 3
    q = ref + 0.05 * torch.randn(32, V, generator=g)
    t = torch.randint(0, V, (32,), generator=g)
    kl = M.kl_full(ref, q)
    prev = math.inf
    for k in (16, 64, 256, V):
        c = M.compact(ref, t, k)
        kl_c, delta = M.kl_compact(c, q)
        assert torch.all(kl_c <= kl + 1e-7) and torch.all(kl <= kl_c + delta + 1e-7)
        assert delta.mean().item() <= prev + 1e-12
        prev = delta.mean().item()
        if k < V:
            lq = torch.log_softmax(q.double(), -1)
            eps = c.tail_mass()
            p_k = c.top_logp()[:, -1].exp()
            q_min = lq.scatter(-1, c.top_ids, torch.inf).min(-1).values
            q_tail = 1 - lq.gather(-1, c.top_ids).exp().sum(-1)
            closed = eps * (torch.log(p_k) - q_min) - eps * torch.log(eps / q_tail)
            assert torch.all(delta <= closed + 1e-7)
    assert prev == pytest.approx(0, abs=1e-12)


def test_compact_roundtrip_numpy():
    g = torch.Generator().manual_seed(2)
    ref = torch.randn(10, 50, generator=g)
    t = torch.randint(0, 50, (10,), generator=g)
    c = M.compact(ref, t, 8)
    c2 = M.CompactLogits.from_numpy(c.to_numpy())
    q = ref + 0.1
    assert torch.allclose(M.kl_compact(c, q)[0], M.kl_compact(c2, q)[0], atol=1e-7)
    assert torch.equal(c.top_ids, c2.top_ids)
    # the true token's log-prob is kept exactly even when it is outside the top-k
    assert torch.allclose(c2.target_logp, torch.log_softmax(ref.double(), -1).gather(-1, t[:, None])[:, 0])


def test_agreement_and_spread_by_hand():
    a = M.agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]])
    assert a["exact_match"] == 0.5
    assert a["mean_common_prefix"] == pytest.approx(2.0)  # (2 + 2) / 2
    assert a["token_match"] == pytest.approx(5 / 6)
    s = M.spread([5, 1, 3, 2, 4])
    assert s["median"] == 3 and s["p10"] == pytest.approx(1.4) and s["p90"] == pytest.approx(4.6)
