"""`clover-gguf convert`: output readable by gguf-py, exact round trip of non-quantized
tensors, quantized ones within the format's error and bit-identical to ggml, fallbacks,
fused layout, metadata, tokenizer, and every bad input refused before writing."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from convert_helpers import (  # noqa: F401
    TINY,
    VECTORS,
    fused_copy,
    ggml_like_llama_quantize,
    gguf_tensor_bytes,
    poke_tensor,
    read_st,
    require_ggml,
    rewrite_st,
    write_synth,
)
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from clover_gguf.checkpoint import load_tensors
from clover_gguf.cli import cli
from clover_gguf.constants import ARCH, GGUF_EXPERT_NAME, Keys
from clover_gguf.convert import ggml_lib, quants
from clover_gguf.convert.converter import ConvertError, convert
from clover_gguf.convert.imatrix import write_imatrix
from clover_gguf.gguf_io.reader import load_gguf_as_hf_tensors, tensor_types

VEC = VECTORS / "random-clover"
VEC_FUSED = VECTORS / "random-clover-fused"


def _conv(src, out, **kw):
    kw.setdefault("progress", False)
    return convert(src, out, **kw)


def _fields(path):
    r = GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items()}


def _no_leftovers(folder: Path):
    return [p.name for p in folder.iterdir() if p.name.endswith(".tmp")] == []


# ---- the vectors model (d = 64: k-quants fall back) ------------------------------------


@pytest.fixture(scope="module")
def vec_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("vec")
    out = {}
    for name, src in (("per_expert", VEC), ("fused", VEC_FUSED)):
        out[name] = d / f"{name}.gguf"
        res = _conv(src, out[name])
        out[name + "_res"] = res
    return out


def test_vectors_round_trip(vec_gguf):
    cfg0, src = load_tensors(VEC)
    cfg, got = load_gguf_as_hf_tensors(vec_gguf["per_expert"])
    assert cfg == cfg0
    types = tensor_types(vec_gguf["per_expert"])
    for n, a in src.items():
        b = got[n]
        assert b.shape == a.shape, n
        if "A_log" in n:  # stored as ssm_a = -exp(A_log) in F32: exact after rounding to BF16
            assert torch.equal(b.to(torch.bfloat16), a), n
        elif ".experts." in n:
            err = (b - a.float()).abs().max() / a.float().abs().max()
            assert err < 0.1, (n, err)  # q5_0 fallback
        else:
            assert torch.equal(b, a.float()), n  # BF16/F32: exact
    assert set(types.values()) == {"f32", "bf16", "q5_0"}


def test_fused_layout_gives_the_same_tensors(vec_gguf):
    a, b = GGUFReader(vec_gguf["per_expert"]), GGUFReader(vec_gguf["fused"])
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        assert ta.tensor_type == tb.tensor_type
        assert np.array_equal(np.asarray(ta.data), np.asarray(tb.data)), ta.name
    fa, fb = _fields(vec_gguf["per_expert"]), _fields(vec_gguf["fused"])
    assert fa[Keys.SOURCE_LAYOUT] == "per_expert" and fb[Keys.SOURCE_LAYOUT] == "fused"


def test_fallbacks_reported(vec_gguf):
    res = vec_gguf["per_expert_res"]
    fb = dict(res.plan.fallbacks())
    assert set(fb) == {GGUF_EXPERT_NAME[p].format(bid=b) for p in ("gate", "up", "down") for b in (0, 1)}
    assert all("q4_k" in v and "q5_0" in v for v in fb.values())
    assert "FALLBACK" in res.plan.table()


def test_metadata(vec_gguf):
    f = _fields(vec_gguf["per_expert"])
    k = Keys.fmt
    assert f[Keys.GENERAL_ARCHITECTURE] == ARCH
    assert f[k(Keys.BLOCK_COUNT)] == 2 and f[k(Keys.EMBEDDING_LENGTH)] == 64
    assert f[k(Keys.EXPERT_COUNT)] == 4 and f[k(Keys.EXPERT_USED_COUNT)] == 2
    assert f[k(Keys.DIFFUSION_BLOCK_SIZE)] == 8 and f[k(Keys.CONV_KERNEL)] == 4
    assert f[Keys.MASK_ID] == 96 and f[Keys.BOS_ID] == 94 and f[Keys.EOS_ID] == 95
    assert f[Keys.TOKENIZER_PRE] == "qwen2" and f[Keys.TOKENIZER_MODEL] == "gpt2"
    assert len(f[Keys.TOKENIZER_TOKENS]) == 97 and len(f[Keys.TOKENIZER_TOKEN_TYPE]) == 97
    assert f[Keys.TOKENIZER_PLACEHOLDER] is True
    assert len(set(f[Keys.TOKENIZER_TOKENS])) == 97
    assert f[Keys.SOURCE_CONFIG_SHA256] and f[Keys.TOOL_VERSION] and "q4_k" in f[Keys.RECIPE]
    assert f[Keys.GENERAL_SIZE_LABEL] and f[Keys.GENERAL_NAME] == "random-clover"
    r = GGUFReader(vec_gguf["per_expert"])
    conv = [t for t in r.tensors if t.name == "blk.0.ssm_conv1d.weight"][0]
    assert list(conv.shape) == [4, 64]  # ggml ne [K, d]
    exps = [t for t in r.tensors if t.name == "blk.0.ffn_down_exps.weight"][0]
    assert list(exps.shape) == [32, 64, 4]  # ggml ne [F, d, E]


def test_dry_run_writes_nothing(tmp_path):
    out = tmp_path / "x.gguf"
    res = convert(VEC, out, dry_run=True)
    assert not out.exists() and list(tmp_path.iterdir()) == []
    t = res.plan.table()
    assert "bits per weight" in t and "blk.1.ffn_down_exps.weight" in t
    assert res.plan.total_bytes > 0


def test_tensor_type_overrides_first_match_wins(tmp_path):
    res = convert(
        VEC,
        None,
        dry_run=True,
        outtype="q8_0",
        experts="q8_0",
        tensor_types=[
            r"blk\.0\.ffn_down_exps=bf16",
            r"ffn_down_exps=f16",
            "attn_q=f32",
            "ssm_alpha=bf16",
        ],
    )
    t = {e.name: quants.type_name(e.qtype) for e in res.plan.entries}
    assert t["blk.0.ffn_down_exps.weight"] == "bf16"
    assert t["blk.1.ffn_down_exps.weight"] == "f16"
    assert t["blk.0.ffn_gate_exps.weight"] == "q8_0"
    assert t["blk.0.attn_q.weight"] == "f32"
    assert t["blk.0.attn_norm.weight"] == "f32"  # 1-D stays F32
    assert t["blk.0.ffn_gate_inp.weight"] == "f32"  # router
    assert t["blk.0.ssm_beta.weight"] == "f32"  # memory gate (default)
    assert t["blk.0.ssm_conv1d.weight"] == "f32"  # the runtime needs these F32: overrides ignored
    assert t["blk.0.mem_key.weight"] == "f32"
    assert t["blk.0.ssm_alpha.weight"] == "bf16"  # a matmul weight: may be overridden
    assert t["token_embd.weight"] == "q8_0" and t["output.weight"] == "q8_0"


@pytest.mark.parametrize(
    "overrides,bad",
    [
        (["nothing_is_called_this=q8_0"], "nothing_is_called_this=q8_0"),
        (["attn_norm=q8_0"], "attn_norm=q8_0"),  # 1-D: always F32
        (["ssm_conv1d=q8_0"], "ssm_conv1d=q8_0"),  # the runtime needs F32
        (["mem_key=q8_0"], "mem_key=q8_0"),
        (["ffn_down_exps=f16", r"blk\.0\.ffn_down_exps=bf16"], r"blk\.0\.ffn_down_exps=bf16"),  # shadowed
    ],
)
def test_tensor_type_that_sets_nothing_is_refused(overrides, bad):
    with pytest.raises(ConvertError) as ei:
        convert(VEC, None, dry_run=True, tensor_types=overrides)
    assert f"--tensor-type {bad!r} matches no tensor whose type it can set" in str(ei.value)


def test_threads_must_be_positive(tmp_path):
    with pytest.raises(ConvertError, match="--threads -3: must be at least 1"):
        convert(VEC, tmp_path / "o.gguf", threads=-3)
    res = CliRunner().invoke(cli, ["convert", str(VEC), "-o", str(tmp_path / "o.gguf"), "-t", "-3"])
    assert res.exit_code == 2 and "-3 is not in the range 1<=x<=512" in res.output
    assert not list(tmp_path.iterdir())


def test_recipes(tmp_path):
    res = convert(VEC, None, dry_run=True, recipe="q4_k_m")
    reqs = {e.name: quants.type_name(e.requested) for e in res.plan.entries}
    assert reqs["blk.0.ffn_down_exps.weight"] == "q5_k" and reqs["blk.0.ffn_up_exps.weight"] == "q4_k"
    # explicit --experts wins over the recipe's
    res = convert(VEC, None, dry_run=True, recipe="q4_k_m", experts="q8_0")
    assert {quants.type_name(e.requested) for e in res.plan.entries if "up_exps" in e.name} == {"q8_0"}
    with pytest.raises(ConvertError, match="unknown recipe"):
        convert(VEC, None, dry_run=True, recipe="nope")
    with pytest.raises(ConvertError, match="REGEX=TYPE"):
        convert(VEC, None, dry_run=True, tensor_types=["nope"])
    with pytest.raises(ConvertError, match="unknown tensor type"):
        convert(VEC, None, dry_run=True, tensor_types=["x=q3_z"])


# ---- a small model with 256-multiple rows: k-quants, bit-exactness vs ggml ------------------


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth")
    pe = write_synth(d / "pe")
    return {"per_expert": pe, "fused": fused_copy(pe, d / "fu"), "sharded": write_synth(d / "sh", shard_size_mb=0.5)}


@pytest.mark.parametrize("experts", ["q4_k", "q5_k", "q6_k", "iq4_xs", "iq4_nl", "q4_0", "mxfp4"])
def test_expert_blocks_bit_identical_to_ggml(synth, tmp_path, experts):
    lib = require_ggml()
    out = tmp_path / "o.gguf"
    _conv(synth["fused"], out, experts=experts, threads=2)
    _, src = load_tensors(synth["per_expert"])
    qt = quants.parse_type(experts)
    for proj in ("gate", "up", "down"):
        stack = torch.stack([src[f"model.layers.0.mlp.experts.{e}.{proj}_proj.weight"] for e in range(4)])
        want = ggml_like_llama_quantize(lib, int(qt), stack.float().numpy(), None)
        assert gguf_tensor_bytes(out, GGUF_EXPERT_NAME[proj].format(bid=0)) == want, proj


def test_imatrix_weighted_blocks_bit_identical_to_ggml(synth, tmp_path):
    lib = require_ggml()
    rng = np.random.default_rng(0)
    E, d, F = 4, 256, 256
    names = {p: GGUF_EXPERT_NAME[p].format(bid=0) for p in ("gate", "up", "down")}
    sums = {n: (rng.random((E, d if p != "down" else F)) * 50).astype(np.float32) for p, n in names.items()}
    counts = {n: np.array([10, 0, 3, 7], np.float32) for n in names.values()}  # expert 1 unseen
    sums["blk.0.attn_q.weight"] = (rng.random((1, d)) * 5).astype(np.float32)
    counts["blk.0.attn_q.weight"] = np.array([4], np.float32)
    im_path = tmp_path / "im.gguf"
    write_imatrix(im_path, sums, counts, ["calib.txt"], 3, 64)
    out, plain = tmp_path / "o.gguf", tmp_path / "p.gguf"
    res = _conv(synth["per_expert"], out, experts="q4_k", outtype="q8_0", imatrix=im_path, tensor_types=["attn_q=q4_k"])
    _conv(synth["per_expert"], plain, experts="q4_k", outtype="q8_0", tensor_types=["attn_q=q4_k"])
    _, src = load_tensors(synth["per_expert"])
    for p, n in names.items():
        stack = torch.stack([src[f"model.layers.0.mlp.experts.{e}.{p}_proj.weight"] for e in range(4)]).float()
        w = sums[n] / counts[n][:, None].clip(min=1)
        w[1] = 1.0  # llama-quantize: count 0 -> 1
        want = ggml_like_llama_quantize(lib, int(Q.Q4_K), stack.numpy(), w.astype(np.float32))
        got = gguf_tensor_bytes(out, n)
        assert got == want, p
        assert got != gguf_tensor_bytes(plain, n)
    q = src["model.layers.0.self_attn.q_proj.weight"].float().numpy()
    want = ggml_like_llama_quantize(lib, int(Q.Q4_K), q[None], sums["blk.0.attn_q.weight"] / np.float32(4))
    assert gguf_tensor_bytes(out, "blk.0.attn_q.weight") == want
    e = {x.name: x for x in res.plan.entries}
    assert e[names["gate"]].imatrix == "yes" and e["blk.0.attn_k.weight"].imatrix == "-"  # q8_0 ignores it
    f = _fields(out)
    assert f[Keys.QUANTIZE_IMATRIX_FILE] == str(im_path) and f[Keys.QUANTIZE_IMATRIX_DATASET] == "calib.txt"


def test_imatrix_with_wrong_size_refused(synth, tmp_path):
    n = GGUF_EXPERT_NAME["gate"].format(bid=0)
    write_imatrix(tmp_path / "im.gguf", {n: np.ones((3, 256), np.float32)}, {n: np.ones(3, np.float32)}, ["x"], 1, 8)
    with pytest.raises(ConvertError, match="imatrix entry"):
        _conv(synth["per_expert"], tmp_path / "o.gguf", imatrix=tmp_path / "im.gguf")
    assert not (tmp_path / "o.gguf").exists()


def test_sharded_and_round_trip_q4_k(synth, tmp_path):
    require_ggml()
    out = tmp_path / "o.gguf"
    _conv(synth["sharded"], out, experts="q4_k", outtype="bf16")
    cfg0, src = load_tensors(synth["sharded"])
    cfg, got = load_gguf_as_hf_tensors(out, experts="fused")
    assert cfg == cfg0
    _, got_pe = load_gguf_as_hf_tensors(out)
    for n, a in src.items():
        if ".experts." in n:
            b = got_pe[n]
            rel = ((b - a.float()).pow(2).mean().sqrt() / a.float().pow(2).mean().sqrt()).item()
            assert rel < 0.12, (n, rel)
        elif "A_log" not in n:
            assert torch.equal(got_pe[n], a.float()), n
    assert "model.layers.0.mlp.experts.gate_up_proj" in got


def test_numpy_only_path(synth, tmp_path, no_ggml):
    with pytest.raises(ConvertError) as ei:
        _conv(synth["per_expert"], tmp_path / "a.gguf", experts="q4_k")
    assert "clover-gguf runtime build" in str(ei.value) and ggml_lib.LIB_ENV in str(ei.value)
    assert list(tmp_path.iterdir()) == []
    res = _conv(synth["per_expert"], tmp_path / "b.gguf", experts="q4_0", outtype="q8_0")
    assert {e.backend for e in res.plan.entries} == {"numpy"}
    assert tensor_types(tmp_path / "b.gguf")["blk.0.ffn_up_exps.weight"] == "q4_0"


def test_numpy_path_equals_ggml_path(synth, tmp_path):
    require_ggml()
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    _conv(synth["per_expert"], a, experts="mxfp4", outtype="q8_0", backend="numpy")
    _conv(synth["per_expert"], b, experts="mxfp4", outtype="q8_0", backend="ggml")
    assert a.read_bytes() == b.read_bytes()


def test_tokenizer_from_model_dir(tmp_path):
    assert (TINY / "tokenizer.json").exists(), f"{TINY}: clover-tiny tokenizer missing"
    d = write_synth(tmp_path / "m", vocab_size=8200, mask_token_id=1)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / f, d / f)
    out = tmp_path / "o.gguf"
    _conv(d, out, experts="q8_0")
    f = _fields(out)
    from clover_gguf.tokenizer import CloverTokenizer

    tok = CloverTokenizer.from_dir(d)
    v = tok.to_gguf_vocab()
    assert f[Keys.TOKENIZER_TOKENS][: len(v.tokens)] == v.tokens
    assert len(f[Keys.TOKENIZER_TOKENS]) == 8200  # padded to the embedding rows
    assert f[Keys.TOKENIZER_MERGES] == v.merges
    assert f[Keys.MASK_ID] == tok.mask_id == 1
    assert f[Keys.CHAT_TEMPLATE] == tok.chat_template
    assert f[Keys.TOKENIZER_PLACEHOLDER] is False
    # a tokenizer that disagrees with config.json is refused
    cfg = json.loads((d / "config.json").read_text())
    cfg["mask_token_id"] = 2
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConvertError, match="mask"):
        _conv(d, tmp_path / "p.gguf")


# ---- bad inputs: refused before writing anything ------------------------------------------


@pytest.fixture
def model_copy(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(VEC, d)
    for p in d.iterdir():
        p.chmod(0o644)
    d.chmod(0o755)
    return d


def _refused(src, out_dir, match, **kw):
    out = out_dir / "out.gguf"
    with pytest.raises(ConvertError, match=match):
        _conv(src, out, **kw)
    assert not out.exists() and _no_leftovers(out_dir)


def test_missing_tensor(model_copy, tmp_path):
    st = model_copy / "model.safetensors"
    h, start, raw = read_st(st)
    del h["model.layers.1.conv.scale"]
    rewrite_st(st, h, raw[start:])
    _refused(model_copy, tmp_path, r"missing tensor model\.layers\.1\.conv\.scale")


def test_extra_tensor(model_copy, tmp_path):
    st = model_copy / "model.safetensors"
    h, start, raw = read_st(st)
    extra = dict(h["model.norm.weight"])
    b, e = extra["data_offsets"]
    n = len(raw) - start
    extra["data_offsets"] = [n, n + e - b]  # its own bytes, after the others
    h["model.layers.0.extra.weight"] = extra
    rewrite_st(st, h, raw[start:] + raw[start + b : start + e])
    _refused(model_copy, tmp_path, r"unexpected tensor model\.layers\.0\.extra\.weight")


def test_wrong_shape(model_copy, tmp_path):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["moe_intermediate_size"] = 16
    (model_copy / "config.json").write_text(json.dumps(cfg))
    _refused(model_copy, tmp_path, r"has shape .* config implies")


def test_unknown_dtype(model_copy, tmp_path):
    st = model_copy / "model.safetensors"
    h, start, raw = read_st(st)
    h["model.norm.weight"]["dtype"] = "I16"
    rewrite_st(st, h, raw[start:])
    _refused(model_copy, tmp_path, r"model\.norm\.weight has unsupported dtype I16")


def test_shard_missing_from_index(tmp_path):
    d = write_synth(tmp_path / "m", shard_size_mb=0.5)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    shard = sorted(set(idx["weight_map"].values()))[1]
    (d / shard).unlink()
    out_dir = tmp_path / "o"
    out_dir.mkdir()
    _refused(d, out_dir, rf"{shard}: shard listed in .* is missing")


def test_tensor_missing_from_its_shard(tmp_path):
    d = write_synth(tmp_path / "m", shard_size_mb=0.5)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(set(idx["weight_map"].values()))
    idx["weight_map"]["model.norm.weight"] = shards[0]
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    out_dir = tmp_path / "o"
    out_dir.mkdir()
    _refused(d, out_dir, r"model\.norm\.weight is mapped to this shard")


def test_truncated_shard(model_copy, tmp_path):
    st = model_copy / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-100])
    _refused(model_copy, tmp_path, "truncated")


def test_bad_config(model_copy, tmp_path):
    cfg = json.loads((model_copy / "config.json").read_text())
    del cfg["head_dim"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    _refused(model_copy, tmp_path, "missing key 'head_dim'")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_values(model_copy, tmp_path, value):
    poke_tensor(model_copy / "model.safetensors", "model.layers.1.mlp.experts.2.up_proj.weight", value, 70)
    out = tmp_path / "out.gguf"
    with pytest.raises(ConvertError) as ei:
        _conv(model_copy, out)
    msg = str(ei.value)
    assert "model.layers.1.mlp.experts.2.up_proj.weight" in msg and "model.safetensors" in msg
    assert "row 1, column 6" in msg  # element 70 of [32, 64]
    assert not out.exists() and _no_leftovers(tmp_path)


def test_refuses_to_overwrite_input(model_copy):
    for victim in ("model.safetensors", "config.json"):
        before = (model_copy / victim).read_bytes()
        with pytest.raises(ConvertError, match="input"):
            _conv(model_copy, model_copy / victim, force=True)
        assert (model_copy / victim).read_bytes() == before


def test_existing_output_needs_force(tmp_path):
    out = tmp_path / "o.gguf"
    out.write_bytes(b"keep me")
    with pytest.raises(ConvertError, match="--force"):
        _conv(VEC, out)
    assert out.read_bytes() == b"keep me"
    _conv(VEC, out, force=True)
    assert GGUFReader(out).tensors


# ---- atomic write ----------------------------------------------------------------------


def _failing_quantizer(monkeypatch, qtype):
    """quants.quantize_rows that fails on the first call for `qtype`."""
    real = quants.quantize_rows

    def fail(x, qt, *a, **k):
        if quants.parse_type(qt) == qtype:
            raise RuntimeError("injected failure")
        return real(x, qt, *a, **k)

    monkeypatch.setattr(quants, "quantize_rows", fail)


def test_failure_midway_leaves_nothing(tmp_path, monkeypatch):
    out = tmp_path / "o.gguf"
    _failing_quantizer(monkeypatch, Q.Q5_0)  # the experts' fallback type: blk.0.ffn_gate_exps comes first
    with pytest.raises(ConvertError) as ei:
        _conv(VEC, out)
    e = ei.value
    assert e.tensor == "blk.0.ffn_gate_exps.weight" and e.source == "model.layers.0.mlp.experts.0.gate_proj.weight"
    assert e.shard == VEC / "model.safetensors" and e.output == out
    assert "injected failure while writing tensor blk.0.ffn_gate_exps.weight" in str(e)
    assert "no output written" in str(e)
    assert list(tmp_path.iterdir()) == []
    # with --force, the old file survives a failed conversion
    out.write_bytes(b"old")
    with pytest.raises(ConvertError):
        _conv(VEC, out, force=True)
    assert out.read_bytes() == b"old" and _no_leftovers(tmp_path)


def test_keyboard_interrupt_leaves_nothing(tmp_path, monkeypatch):
    calls = {"n": 0}
    real = quants.quantize_rows

    def boom(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(quants, "quantize_rows", boom)
    with pytest.raises(KeyboardInterrupt) as ei:
        _conv(VEC, tmp_path / "o.gguf", outtype="q8_0")
    assert any("no output written" in n for n in ei.value.__notes__)
    assert list(tmp_path.iterdir()) == []


def test_disk_full_midway(tmp_path, monkeypatch):
    """ENOSPC from a write in the middle of the data: one error naming the tensor and the output."""
    import errno
    import io
    import os

    real_fdopen = os.fdopen

    class Full(io.BufferedWriter):
        n = 0

        def write(self, b):
            Full.n += 1
            if Full.n > 20:
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write(b)

    monkeypatch.setattr(os, "fdopen", lambda fd, mode: Full(real_fdopen(fd, mode, buffering=0)))
    out = tmp_path / "o.gguf"
    with pytest.raises(ConvertError) as ei:
        _conv(VEC, out)
    msg = str(ei.value)
    assert "No space left on device while writing tensor" in msg and f"(output {out}); no output written" in msg
    assert list(tmp_path.iterdir()) == []


def test_file_size_limit_through_the_cli(tmp_path):
    """A real short write: RLIMIT_FSIZE below the file's size (SIGXFSZ is ignored during the
    write, so the kernel's EFBIG becomes the error): exit 1, one line, nothing left behind."""
    import resource
    import subprocess
    import sys

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))

    out = tmp_path / "o.gguf"
    r = subprocess.run(
        [sys.executable, "-m", "clover_gguf.cli", "convert", str(VEC), "-o", str(out), "-q"],
        capture_output=True,
        text=True,
        preexec_fn=limit,
        timeout=120,
    )
    assert r.returncode == 1, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "File too large" in r.stderr and str(out) in r.stderr and "no output written" in r.stderr
    assert list(tmp_path.iterdir()) == []


# ---- CLI -----------------------------------------------------------------------------------


def test_cli_convert_and_inspect(tmp_path):
    r = CliRunner()
    res = r.invoke(cli, ["convert", str(VEC), "--dry-run", "--recipe", "q8_0"])
    assert res.exit_code == 0, res.output
    assert "bits per weight" in res.output and not list(tmp_path.iterdir())
    out = tmp_path / "o.gguf"
    res = r.invoke(
        cli, ["convert", str(VEC), "-o", str(out), "-q", "--experts", "q8_0", "--tensor-type", "attn_q=f16", "-t", "2"]
    )
    assert res.exit_code == 0, res.output
    assert "wrote" in res.output
    assert tensor_types(out)["blk.0.attn_q.weight"] == "f16"
    res = r.invoke(cli, ["convert", str(VEC), "-o", str(out)])
    assert res.exit_code != 0 and "--force" in res.output
    res = r.invoke(cli, ["inspect", str(out)])
    assert res.exit_code == 0, res.output
    assert "experts_gate_up" in res.output and "clover.expert_count" in res.output
    res = r.invoke(cli, ["inspect", str(VEC_FUSED), "--tensors"])
    assert res.exit_code == 0, res.output
    assert "blk.0.ffn_down_exps.weight" in res.output and "bf16" in res.output


def test_dry_run_on_full_35b_shapes_is_fast(tmp_path):
    """Plan for Clover-35B-A3B's 40 layers from headers only (a sparse file: no data)."""
    import time

    from clover_gguf.config import preset

    c = preset("clover-35b-a3b")
    d = tmp_path / "c35"
    d.mkdir()
    header, off = {}, 0
    for n, shape in c.expected_tensors().items():
        nb = 2 * int(np.prod(shape))
        header[n] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + nb]}
        off += nb
    hj = json.dumps(header).encode()
    hj += b" " * (-len(hj) % 8)
    with open(d / "model.safetensors", "wb") as f:
        f.write(len(hj).to_bytes(8, "little") + hj)
        f.truncate(8 + len(hj) + off)
    c.save(d / "config.json")
    t0 = time.perf_counter()
    res = convert(d, None, dry_run=True)
    dt = time.perf_counter() - t0
    assert dt < 20, dt
    p = res.plan
    assert 34e9 < p.n_params < 36e9
    exp = [e for e in p.entries if e.group.startswith("experts")]
    assert len(exp) == 120 and {quants.type_name(e.qtype) for e in exp} == {"q4_k"} and not p.fallbacks()
    assert 8 * sum(e.nbytes for e in exp) / sum(e.n_elements for e in exp) == 4.5  # Q4_K: 4.5 bpw
    assert p.src_bytes == off
    assert "40 tensors" not in p.table(verbose=False)


def test_ggml_own_gguf_parser_accepts_the_file(vec_gguf):
    """libggml's gguf_init_from_file reads what we wrote: tensor count, types, offsets."""
    import ctypes

    lib = require_ggml()
    L = ctypes.CDLL(str(lib.path))

    class Params(ctypes.Structure):
        _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]

    L.gguf_init_from_file.argtypes = [ctypes.c_char_p, Params]
    L.gguf_init_from_file.restype = ctypes.c_void_p
    for f, rt in (
        ("gguf_get_n_tensors", ctypes.c_int64),
        ("gguf_get_n_kv", ctypes.c_int64),
        ("gguf_get_data_offset", ctypes.c_size_t),
    ):
        getattr(L, f).argtypes = [ctypes.c_void_p]
        getattr(L, f).restype = rt
    L.gguf_find_tensor.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    L.gguf_find_tensor.restype = ctypes.c_int64
    L.gguf_get_tensor_type.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    L.gguf_get_tensor_type.restype = ctypes.c_int
    L.gguf_get_tensor_offset.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    L.gguf_get_tensor_offset.restype = ctypes.c_size_t
    L.gguf_free.argtypes = [ctypes.c_void_p]
    path = vec_gguf["per_expert"]
    ctx = L.gguf_init_from_file(str(path).encode(), Params(True, None))
    assert ctx, "ggml could not parse the file"
    try:
        r = GGUFReader(path)
        assert L.gguf_get_n_tensors(ctx) == len(r.tensors)
        assert L.gguf_get_n_kv(ctx) == len([k for k in r.fields if not k.startswith("GGUF.")])
        base = L.gguf_get_data_offset(ctx)
        for t in r.tensors:
            i = L.gguf_find_tensor(ctx, t.name.encode())
            assert i >= 0, t.name
            assert L.gguf_get_tensor_type(ctx, i) == int(t.tensor_type), t.name
            assert base + L.gguf_get_tensor_offset(ctx, i) == t.data_offset, t.name
    finally:
        L.gguf_free(ctx)
