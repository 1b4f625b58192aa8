"""Importance matrices: llama.cpp's GGUF imatrix format, normalization as llama-quantize,
and `clover-gguf imatrix` counting each expert's activations."""

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from convert_helpers import VECTORS
from gguf import GGUFReader

from clover_gguf.cli import cli
from clover_gguf.constants import GGUF_EXPERT_NAME, Keys
from clover_gguf.convert.imatrix import compute_imatrix, load_imatrix, write_imatrix
from clover_gguf.reference.model import CloverModel

VEC = VECTORS / "random-clover"


def test_file_format_and_normalization(tmp_path):
    n = "blk.0.ffn_up_exps.weight"
    sums = {n: np.arange(12, dtype=np.float32).reshape(3, 4), "blk.0.attn_q.weight": np.full((1, 4), 6, np.float32)}
    counts = {n: np.array([2, 0, 3], np.float32), "blk.0.attn_q.weight": np.array([3], np.float32)}
    p = tmp_path / "im.gguf"
    write_imatrix(p, sums, counts, ["a.txt"], 7, 128)
    r = GGUFReader(p)
    f = {k: v.contents() for k, v in r.fields.items()}
    assert f["general.type"] == "imatrix" and "general.architecture" not in f
    assert f[Keys.IMATRIX_DATASETS] == ["a.txt"]
    assert f[Keys.IMATRIX_CHUNK_COUNT] == 7 and f[Keys.IMATRIX_CHUNK_SIZE] == 128
    t = {x.name: x for x in r.tensors}
    assert list(t[n + ".in_sum2"].shape) == [4, 3] and list(t[n + ".counts"].shape) == [1, 3]  # ggml ne
    assert t[n + ".in_sum2"].tensor_type.name == "F32"
    im = load_imatrix(p)
    w = im.get(n)
    assert np.array_equal(w[0], np.arange(4, dtype=np.float32) / np.float32(2))
    assert np.array_equal(w[1], np.ones(4, np.float32))  # no activations -> 1
    assert np.array_equal(w[2], np.arange(8, 12, dtype=np.float32) / np.float32(3))
    assert np.array_equal(im.get("blk.0.attn_q.weight"), np.full((1, 4), 2, np.float32))
    assert im.datasets == ["a.txt"] and im.chunk_count == 7


def test_legacy_dat_format(tmp_path):
    import struct

    p = tmp_path / "im.dat"
    name = b"blk.0.attn_q.weight"
    vals = np.array([2, 4, 6, 8], np.float32)
    p.write_bytes(
        struct.pack("<i", 1) + struct.pack("<i", len(name)) + name + struct.pack("<ii", 2, 4) + vals.tobytes()
    )
    assert np.array_equal(load_imatrix(p).get("blk.0.attn_q.weight"), (vals / 2)[None])


def test_bad_files(tmp_path):
    p = tmp_path / "x.gguf"
    write_imatrix(p, {}, {}, ["a"], 0, 1)
    with pytest.raises(ValueError, match="no data"):
        load_imatrix(p)


def test_compute_counts_each_expert(tmp_path):
    ids = list(torch.randint(0, 94, (8 * 40,), generator=torch.Generator().manual_seed(0)).tolist())
    out = tmp_path / "im.gguf"
    im = compute_imatrix(VEC, "ids", out, n_ctx=64, token_ids=ids, progress=False)
    # 320 tokens = 5 chunks of 64; two streams (clean + noisy) -> 640 token rows per layer, but
    # the last layer runs the noisy stream only (the clean stream's last output feeds nothing)
    assert im.chunk_count == 5 and im.chunk_size == 64
    model = CloverModel.from_pretrained(VEC)
    k = model.config.num_experts_per_tok
    for bid in range(2):
        g = GGUF_EXPERT_NAME["gate"].format(bid=bid)
        u = GGUF_EXPERT_NAME["up"].format(bid=bid)
        dn = GGUF_EXPERT_NAME["down"].format(bid=bid)
        rows = 640 if bid < model.config.num_hidden_layers - 1 else 320
        assert im.counts[g].shape == (4,) and im.counts[g].sum() == rows * k
        assert np.array_equal(im.counts[g], im.counts[u]) and np.array_equal(im.sums[g], im.sums[u])
        assert im.sums[g].shape == (4, 64) and im.sums[dn].shape == (4, 32)
        assert im.counts[f"blk.{bid}.attn_q.weight"].tolist() == [640]  # projections run on both streams
        assert im.sums[f"blk.{bid}.attn_output.weight"].shape == (1, 64)
        assert im.sums[f"blk.{bid}.ffn_down_shexp.weight"].shape == (1, 32)
    # the hooks are gone afterwards
    assert "experts" not in model.layers[0].mlp.__dict__


def test_expert_sums_match_direct_computation(tmp_path):
    """Per-expert sums and counts of layer 0 equal sum(v^2) (gate/up) and sum(h^2) (down) over
    the rows the router sends to each expert, computed here from the MoE input alone."""
    ids = list(range(1, 65))
    im = compute_imatrix(VEC, "ids", tmp_path / "im.gguf", n_ctx=64, token_ids=ids, progress=False, seed=3)
    model = CloverModel.from_pretrained(VEC)
    c = model.config
    seen = []
    h = model.layers[0].mlp.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    clean = torch.tensor(ids).view(1, -1, c.block_size)
    g = torch.Generator().manual_seed(3)
    nb = clean.shape[1]
    t = torch.rand(1, nb, 1, generator=g).clamp(min=1e-3)
    noisy = torch.where(torch.rand(1, nb, c.block_size, generator=g) < t, c.mask_token_id, clean)
    with torch.no_grad():
        model.forward_train(clean, noisy, torch.arange(64).view(1, nb, -1), None)
    h.remove()
    v = seen[0].reshape(-1, c.hidden_size).double()
    mlp = model.layers[0].mlp
    top, _ = mlp.route(v.float())
    gate_up = mlp.experts.gate_up_proj.detach().double()
    Fe = c.moe_intermediate_size
    names = {p: GGUF_EXPERT_NAME[p].format(bid=0) for p in ("gate", "up", "down")}
    used = 0
    for e in range(c.num_experts):
        rows = v[(top == e).any(-1)]
        assert im.counts[names["gate"]][e] == rows.shape[0]
        if not rows.shape[0]:
            continue
        used += 1
        assert np.allclose(im.sums[names["gate"]][e], (rows**2).sum(0).numpy(), rtol=1e-5)
        hid = torch.nn.functional.silu(rows @ gate_up[e, :Fe].T) * (rows @ gate_up[e, Fe:].T)
        assert np.allclose(im.sums[names["down"]][e], (hid**2).sum(0).numpy(), rtol=1e-4)
    assert used >= 2


def test_compute_matches_direct_capture(tmp_path):
    """Layer 0 attention input sums equal sum(u^2) computed by hand."""
    ids = list(range(1, 65))
    im = compute_imatrix(VEC, "ids", tmp_path / "im.gguf", n_ctx=64, token_ids=ids, progress=False, seed=3)
    model = CloverModel.from_pretrained(VEC)
    c = model.config
    clean = torch.tensor(ids).view(1, -1, c.block_size)
    g = torch.Generator().manual_seed(3)
    nb = clean.shape[1]
    t = torch.rand(1, nb, 1, generator=g).clamp(min=1e-3)
    m = torch.rand(1, nb, c.block_size, generator=g) < t
    noisy = torch.where(m, torch.full_like(clean, c.mask_token_id), clean)
    x = model.model.embed_tokens(torch.cat([clean, noisy]))
    u, *_ = model.layers[0].project(x, None)
    want = (u.detach().double() ** 2).reshape(-1, c.hidden_size).sum(0).numpy()
    got = im.sums["blk.0.attn_q.weight"][0]
    assert np.allclose(got, want, rtol=1e-5)


def test_cli_imatrix_then_convert(tmp_path):
    txt = tmp_path / "calib.txt"
    txt.write_text("def f(x):\n    return x + 1\n" * 40)
    out = tmp_path / "im.gguf"
    r = CliRunner()
    res = r.invoke(cli, ["imatrix", str(VEC), "-f", str(txt), "-o", str(out), "--ctx", "64", "--chunks", "3"])
    assert res.exit_code == 0, res.output
    assert "3 chunks" in res.output
    res = r.invoke(
        cli, ["convert", str(VEC), "-o", str(tmp_path / "m.gguf"), "-q", "--experts", "q4_0", "--imatrix", str(out)]
    )
    assert res.exit_code == 0, res.output
