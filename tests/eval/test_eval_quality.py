"""eval corpus/backends/quality end to end on the spec's random Clover (no tokenizer: token
documents), with GGUFs converted in the test (BF16 and Q4_0 need no libggml)."""

import json

import numpy as np
import pytest
import torch
from eval_helpers import RC
from eval_helpers import docs as _docs

from clover_gguf.eval.quality import corpus as C
from clover_gguf.eval.quality.backends import TorchProvider, load_reference
from clover_gguf.eval.quality.run import Sampling


def test_masks_are_deterministic_and_sized_by_ratio():
    docs = _docs()
    a = C.build_samples(docs, 8, n_windows=2, n_blocks=6, ratios=(0.15, 0.5, 1.0), seed=7, mask_token_id=96)
    b = C.build_samples(docs, 8, n_windows=2, n_blocks=6, ratios=(0.15, 0.5, 1.0), seed=7, mask_token_id=96)
    c = C.build_samples(docs, 8, n_windows=2, n_blocks=6, ratios=(0.15, 0.5, 1.0), seed=8, mask_token_id=96)
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()
    for m in a.masks:
        assert (m[0].sum(-1) == 1).all()  # round(0.15 * 8) = 1
        assert (m[1].sum(-1) == 4).all()
        assert m[2].all()  # ratio 1: every position
    nz = a.noisy(0)
    assert (nz[torch.from_numpy(a.masks[0])] == 96).all()
    assert len(a.meta["target"]) == a.n_positions


def test_recall_probe_rule():
    B = 8
    toks = np.arange(100, 100 + 12 * B)  # all distinct
    toks[5] = 7  # identifier first seen at position 5
    toks[11 * B + 3] = 7  # repeated in block 11, 86 tokens later
    s = C.build_samples([C.Document("x", toks)], B, n_windows=1, n_blocks=12, ratios=(1.0,), seed=0)
    d = s.meta["probe_dist"]
    hit = np.nonzero(d >= 0)[0]
    assert len(hit) == 1 and d[hit[0]] == 11 * B + 3 - 5 and s.meta["target"][hit[0]] == 7
    assert C.probe_bin(86) == "64-127" and C.history_bin(11) == "8-15"


def test_torch_provider_matches_sequential_commits():
    """One two-stream forward = commit the clean blocks one by one and denoise each block."""
    m = load_reference(RC)
    B, nb = 8, 3
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, 90, (nb, B), generator=g)
    noisy = clean[None].repeat(2, 1, 1)
    sel = torch.rand(2, nb, B, generator=g) < 0.5
    noisy[sel] = m.config.mask_token_id
    got = TorchProvider(m, "ref").window_logits(clean, noisy, sel)
    state, rows = m.init_state(1), {}
    for b in range(nb):
        for r in range(2):
            rows[(r, b)] = m.block_logits(noisy[r, b][None], b * B, state)[0][sel[r, b]]
        _, state = m.commit(clean[b][None], b * B, state)
    want = torch.cat([rows[(r, b)] for r in range(2) for b in range(nb)])
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_quality_identical_weights_and_quantized(quality_run):
    d, run, run2, logs = quality_run
    bf16, q4 = (m["providers"]["reference-dequant"] for m in run["models"])
    assert bf16["overall"]["kl_mean"] < 1e-9 and bf16["overall"]["same_top1"] == 1.0
    assert bf16["generation"]["steps=4"]["exact_match"] == 1.0
    assert q4["overall"]["kl_mean"] > 1e-4 and q4["overall"]["same_top1"] < 1.0
    assert q4["overall"]["kl_max"] >= q4["overall"]["kl_p999"] >= q4["overall"]["kl_p99"] >= q4["overall"]["kl_median"]
    assert set(q4["by_ratio"]) == {"0.5", "1"}
    # calibration: the exact KL on kept full-logit positions lies inside the compact bracket
    cal = q4["calibration"]
    assert cal["n"] > 0 and cal["bracket_holds"]
    assert cal["kl_mean_compact"] <= cal["kl_mean_full"] + 1e-7 <= cal["kl_mean_compact"] + cal["kl_mean_bound"] + 2e-7
    assert sum(v["n"] for v in q4["by_history"].values()) == q4["overall"]["n"]
    assert run["models"][1]["bytes"] < run["models"][0]["bytes"]
    # the saved reference logits are reused by a later run on the same samples
    assert any("reusing reference logits" in x for x in logs)
    assert run2["models"][0]["providers"]["reference-dequant"]["overall"]["kl_mean"] < 1e-9
    assert json.loads((d / "first-quality.json").read_text())["kind"] == "quality"


def test_runtime_provider_matches_reference_on_f32_weights(tmp_path):
    """The llama.cpp provider (block_logits / commit block by block) against the PyTorch
    two-stream provider, on an all-F32 GGUF so that only the kernels differ."""
    from clover_gguf.eval.quality.backends import RuntimeProvider, load_dequantized, open_runtime, runtime_status

    ok, why = runtime_status()
    assert ok, f"llama.cpp runtime not built ({why}): run `clover-gguf runtime build`"
    from clover_gguf.convert.converter import convert

    f = tmp_path / "rc-f32.gguf"
    convert(
        RC,
        f,
        outtype="f32",
        experts="bf16",
        tensor_types=[("ffn_.*_exps", "f32")],
        progress=False,
    )
    rt, m = open_runtime(f, 2), load_dequantized(f)
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, 90, (4, 8), generator=g)
    noisy = clean[None].repeat(2, 1, 1)
    sel = torch.rand(2, 4, 8, generator=g) < 0.5
    noisy[sel] = m.config.mask_token_id
    a = RuntimeProvider(rt).window_logits(clean, noisy, sel)
    b = TorchProvider(m, "ref").window_logits(clean, noisy, sel)
    assert a.shape == b.shape and torch.allclose(a, b, atol=1e-4)


def test_sensitivity_one_group(tmp_path):
    from clover_gguf.eval.quality.sensitivity import run_sensitivity

    s = run_sensitivity(
        RC,
        tmp_path / "s",
        groups=("experts_down",),
        qtype="q4_0",
        sampling=Sampling(docs=_docs(), n_windows=1, n_blocks=3, ratios=(1.0,), top_k=16),
        log=lambda *a: None,
    )
    g = s["groups"][0]
    assert g["group"] == "experts_down" and g["n_tensors"] == 2 and g["types"] == {"Q4_0": 2}
    assert g["group_bytes_q"] < g["group_bytes_base"]
    assert g["overall"]["kl_mean"] > 0 and (tmp_path / "s" / "sensitivity.json").is_file()
    assert not list((tmp_path / "s").glob("**/*.gguf"))  # per-group files removed unless keep


def test_speed_worker_in_process():
    """The speed worker's measurements (run in-process here; the CLI runs it in a fresh
    subprocess per target so that the first load is a cold one)."""
    from clover_gguf.eval.bench.speed import parse_sweep, worker

    assert parse_sweep(["block_size=4,8", "threshold=0.5"]) == {"block_size": [4, 8], "threshold": [0.5]}
    with pytest.raises(ValueError):
        parse_sweep(["blocksize=4"])
    spec = {
        "backend": "reference-bf16",
        "path": str(RC),
        "threads": 1,
        "runs": 2,
        "warmup": 0,
        "base": {"block_size": 8, "steps": 2, "threshold": None, "prompt_len": 10, "max_new_tokens": 16},
        "sweeps": {"block_size": [4]},
        "prompt_ids": list(range(3, 40)),
        "mask_token_id": 96,
    }
    r = worker(spec)
    b = r["base"]
    assert r["load_cold_s"] > 0 and r["load_warm_s"] > 0 and r["peak_rss_mib"] > 10
    assert b["steps_per_block"]["median"] == 2 and b["tokens_per_step"]["median"] == 4  # 8 tokens in 2 steps
    assert b["gen_tps"]["n"] == 2 and b["gen_tps"]["p10"] <= b["gen_tps"]["median"] <= b["gen_tps"]["p90"]
    assert r["sweeps"]["block_size"][0]["value"] == 4 and r["sweeps"]["block_size"][0]["tokens_per_step"]["median"] == 2


def test_auto_top_k_follows_the_tail_mass():
    from clover_gguf.eval.quality.run import choose_k

    g = torch.Generator().manual_seed(0)
    t = torch.zeros(16, dtype=torch.long)
    peaked = torch.randn(16, 4096, generator=g)
    peaked[:, :10] += 30.0  # nearly all mass on 10 tokens
    assert choose_k(peaked, t, None) == 256
    flat = torch.randn(16, 4096, generator=g) * 0.1
    assert choose_k(flat, t, None) == 4096  # never reaches the target: the whole (small) vocabulary
    flat = torch.randn(4, 10000, generator=g) * 0.1
    assert choose_k(flat, t[:4], None) == 8192  # larger vocabulary: the largest of the ladder
