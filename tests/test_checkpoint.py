"""Bad configs and checkpoints give errors that name the culprit; synth writes loadable checkpoints."""

import json
import shutil
import struct

import pytest
import torch
from click.testing import CliRunner

from clover_gguf.checkpoint import INDEX_NAME, Checkpoint, CheckpointError
from clover_gguf.cli import cli
from clover_gguf.config import CloverConfig, ConfigError, preset
from clover_gguf.reference.model import CloverModel
from clover_gguf.synthetic import write_synthetic


def _cfg_dict(vec_dir):
    return json.loads((vec_dir / "config.json").read_text())


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda d: d.pop("head_dim"), "missing key 'head_dim'"),
        (
            lambda d: d.update(num_key_value_heads=3),
            "key 'num_key_value_heads' = 3: must divide key 'num_attention_heads' (4)",
        ),
        (lambda d: d.update(hidden_size="64"), "key 'hidden_size' must be an integer"),
        (lambda d: d.update(block_size=0), "key 'block_size' = 0: must be an integer in [1, 1024]"),
        (lambda d: d.update(block_size=10**9), "key 'block_size' = 1000000000: must be an integer in [1, 1024]"),
        (lambda d: d.update(mask_token_id=500), "key 'mask_token_id' = 500: must be a token id in [0, 96]"),
        (lambda d: d.update(eos_token_id=-1), "key 'eos_token_id' = -1: must be a token id in [0, 96]"),
        (
            lambda d: d.update(num_experts_per_tok=9),
            "key 'num_experts_per_tok' = 9: must be at most key 'num_experts' (4)",
        ),
        (lambda d: d.update(model_type="llama"), "key 'model_type' is 'llama'"),
        # the size checks come before anything is sized from the value
        (lambda d: d.update(num_experts=10**9), "key 'num_experts' = 1000000000: must be an integer in [1, 1024]"),
        (
            lambda d: d.update(num_hidden_layers=10**9),
            "key 'num_hidden_layers' = 1000000000: must be an integer in [1, 512]",
        ),
        (lambda d: d.update(vocab_size=-5), "key 'vocab_size' = -5: must be an integer in [1, 16777216]"),
        (lambda d: d.update(rms_norm_eps=float("nan")), "key 'rms_norm_eps' = nan: must be a finite number in (0, 1]"),
        (lambda d: d.update(rms_norm_eps=-1e-6), "key 'rms_norm_eps' = -1e-06: must be a finite number in (0, 1]"),
        (lambda d: d.update(rms_norm_eps=0), "key 'rms_norm_eps' = 0: must be a finite number in (0, 1]"),
        (lambda d: d.update(rope_theta=float("inf")), "key 'rope_theta' = inf: must be a finite number in [1, 1e+12]"),
        (lambda d: d.update(rope_theta=float("nan")), "key 'rope_theta' = nan: must be a finite number in [1, 1e+12]"),
        (lambda d: d.update(head_dim=15), "key 'head_dim' = 15: must be even"),
        (
            lambda d: d.update(max_position_embeddings=4),
            "key 'max_position_embeddings' = 4: must be at least key 'block_size' (8)",
        ),
        (lambda d: d.update(max_position_embeddings=1.5), "key 'max_position_embeddings' = 1.5: must be an integer"),
    ],
)
def test_bad_config_names_key_and_file(tmp_path, vec_dir, edit, needle):
    d = _cfg_dict(vec_dir)
    edit(d)
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError) as e:
        CloverConfig.load(tmp_path)
    assert needle in str(e.value) and str(tmp_path / "config.json") in str(e.value)


def test_config_json_nan_is_refused(tmp_path, vec_dir):
    """JSON's NaN literal reaches json.loads as a float; the limits refuse it."""
    text = (vec_dir / "config.json").read_text()
    text = text.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": NaN')
    assert "NaN" in text
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=r"key 'rms_norm_eps' = nan: must be a finite number in \(0, 1\]"):
        CloverConfig.load(tmp_path)


def test_config_is_a_directory(tmp_path):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ConfigError, match="config.json: not a regular file"):
        CloverConfig.load(tmp_path)


def test_config_not_utf8(tmp_path, vec_dir):
    (tmp_path / "config.json").write_bytes(b'{"vocab_size": 97, "x": "\xff\xfe"}')
    with pytest.raises(ConfigError, match=r"config.json: not UTF-8 text \(byte \d+\)"):
        CloverConfig.load(tmp_path)


def test_config_nested_too_deeply(tmp_path):
    (tmp_path / "config.json").write_text("[" * 100000)
    with pytest.raises(ConfigError, match="not valid JSON"):
        CloverConfig.load(tmp_path)


def test_config_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        CloverConfig.load(tmp_path)


@pytest.fixture
def small_sharded(tmp_path, vec_dir):
    cfg = CloverConfig.load(vec_dir)
    return write_synthetic(tmp_path / "m", cfg, shard_size_mb=0.05, progress=False)


def _rewrite_header(path, fn):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    hdr = json.loads(raw[8 : 8 + n])
    fn(hdr)
    h = json.dumps(hdr).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n :])


def _shard_with(d, name):
    idx = json.loads((d / INDEX_NAME).read_text())["weight_map"]
    return d / idx[name]


def test_sharded_synthetic_loads_and_matches_index(small_sharded):
    ck = Checkpoint(small_sharded)
    ck.validate()
    assert len(set(ck._where.values())) > 1
    m = CloverModel.from_pretrained(small_sharded)
    assert torch.isfinite(m.block_logits(torch.tensor([[1, 2, 3]]), 0, m.init_state())).all()


def test_missing_tensor(small_sharded):
    name = "model.layers.1.self_attn.memory.A_log"
    _rewrite_header(_shard_with(small_sharded, name), lambda h: h.pop(name))
    idx = json.loads((small_sharded / INDEX_NAME).read_text())
    idx["weight_map"].pop(name)
    (small_sharded / INDEX_NAME).write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.self_attn\.memory\.A_log"):
        Checkpoint(small_sharded).validate()


def test_index_points_to_tensor_not_in_shard(small_sharded):
    name = "model.layers.0.conv.scale"
    _rewrite_header(_shard_with(small_sharded, name), lambda h: h.pop(name))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.conv\.scale is mapped to this shard"):
        Checkpoint(small_sharded)


def test_wrong_shape(small_sharded):
    name = "model.layers.0.self_attn.q_norm.weight"

    def f(h):
        a, _ = h[name]["data_offsets"]
        h[name]["shape"] = [8]
        h[name]["data_offsets"] = [a, a + 16]

    _rewrite_header(_shard_with(small_sharded, name), f)
    with pytest.raises(CheckpointError, match=r"q_norm\.weight has shape \[8\], config implies \[16\]"):
        Checkpoint(small_sharded).validate()


def test_unknown_dtype(small_sharded):
    name = "model.norm.weight"

    def f(h):
        h[name]["dtype"] = "I16"

    _rewrite_header(_shard_with(small_sharded, name), f)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight has unsupported dtype I16"):
        Checkpoint(small_sharded).validate()


def test_truncated_shard(small_sharded):
    shard = _shard_with(small_sharded, "lm_head.weight")
    raw = shard.read_bytes()
    shard.write_bytes(raw[: len(raw) - 100])
    with pytest.raises(CheckpointError, match="truncated safetensors file") as e:
        Checkpoint(small_sharded)
    assert shard.name in str(e.value)


def test_missing_shard(small_sharded):
    shard = _shard_with(small_sharded, "lm_head.weight")
    shard.unlink()
    with pytest.raises(CheckpointError, match="shard listed in model.safetensors.index.json is missing"):
        Checkpoint(small_sharded)


def test_extra_tensor(tmp_path, vec_dir):
    d = tmp_path / "x"
    shutil.copytree(vec_dir, d)
    st = d / "model.safetensors"
    _rewrite_header(
        st, lambda h: h.update({"model.layers.0.bogus": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}})
    )
    with pytest.raises(CheckpointError, match=r"tensors model\.layers\.0\.bogus and .* overlap"):
        Checkpoint(d)
    end = st.stat().st_size - 8 - struct.unpack("<Q", st.read_bytes()[:8])[0]
    _rewrite_header(
        st,
        lambda h: h.update({"model.layers.0.bogus": {"dtype": "BF16", "shape": [1], "data_offsets": [end, end + 2]}}),
    )
    st.write_bytes(st.read_bytes() + b"\0\0")
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.0\.bogus"):
        Checkpoint(d).validate()


def test_synth_fused_equals_per_expert(tmp_path, vec_dir):
    cfg = CloverConfig.load(vec_dir)
    a = write_synthetic(tmp_path / "a", cfg, progress=False, seed=3)
    b = write_synthetic(tmp_path / "b", cfg, progress=False, seed=3, fused=True)
    assert Checkpoint(a).layout == "per_expert" and Checkpoint(b).layout == "fused"
    for layer in range(cfg.num_hidden_layers):
        for proj in ("gate", "up", "down"):
            assert torch.equal(Checkpoint(a).expert_stack(layer, proj), Checkpoint(b).expert_stack(layer, proj))
    ma, mb = CloverModel.from_pretrained(a), CloverModel.from_pretrained(b)
    assert not torch.equal(ma.lm_head.weight, ma.model.embed_tokens.weight)
    B = cfg.block_size
    tokens = torch.randint(0, cfg.vocab_size, (1, 2 * B), generator=torch.Generator().manual_seed(0))
    la = ma.block_logits(tokens[:, B:], B, ma.prefill(tokens[:, :B], B))
    lb = mb.block_logits(tokens[:, B:], B, mb.prefill(tokens[:, :B], B))
    assert la.abs().max() > 0 and torch.equal(la, lb)


def test_synth_cli_35b_shapes_header_only(tmp_path):
    """The 35B preset's per-expert shapes (8 of its 256 experts, a small vocab, 1 layer), via the CLI."""
    cfg = preset(
        "clover-35b-a3b",
        num_hidden_layers=1,
        vocab_size=512,
        num_experts=8,
        mask_token_id=511,
        bos_token_id=508,
        eos_token_id=509,
        pad_token_id=509,
    )
    cfg.save(tmp_path / "config.json")
    r = CliRunner().invoke(
        cli,
        ["synth", str(tmp_path / "out"), "--config", str(tmp_path / "config.json"), "--shard-size-mb", "8", "--fused"],
    )
    assert r.exit_code == 0, r.output
    ck = Checkpoint(tmp_path / "out")
    ck.validate()
    assert ck.shape("model.layers.0.mlp.experts.gate_up_proj") == (8, 1024, 2048)
    assert len(set(ck._where.values())) >= 3


def test_cli_run_json_on_vectors(vec_dir, vectors):
    c = vectors["greedy_steps"]
    r = CliRunner().invoke(
        cli,
        [
            "run",
            str(vec_dir),
            "--prompt-ids",
            ",".join(map(str, c["prompt"])),
            "-n",
            "24",
            "--block-size",
            "8",
            "--steps",
            "4",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.output[r.output.index("{") :])
    assert out["token_ids"] == c["tokens"]
    assert [b["steps"] for b in out["blocks"]] == [4, 4, 4]


# ---- malformed safetensors headers and index files: one line naming the file and tensor ----

_Q = "model.layers.0.self_attn.q_proj.weight"
_K = "model.layers.0.self_attn.k_proj.weight"


def _set(name, **kw):
    return lambda h: h[name].update(kw)


@pytest.mark.parametrize(
    "edit,needle",
    [
        (_set(_Q, data_offsets=[-2, 8190]), f"tensor {_Q}: data_offsets [-2, 8190] is not [begin, end]"),
        (_set(_Q, data_offsets=[100, 50]), f"tensor {_Q}: data_offsets [100, 50] are reversed"),
        (_set(_Q, data_offsets=[0]), f"tensor {_Q}: data_offsets [0] is not [begin, end]"),
        (_set(_Q, data_offsets=[0, 2.5]), f"tensor {_Q}: data_offsets [0, 2.5] is not [begin, end]"),
        (lambda h: h[_Q].pop("data_offsets"), f"tensor {_Q}: data_offsets None is not [begin, end]"),
        (_set(_Q, shape=[64, 32]), f"tensor {_Q}: data_offsets"),  # bytes disagree with the shape
        (_set(_Q, dtype="F32"), "hold 8192 bytes, shape [64, 64] of F32 needs 16384"),
        (_set(_Q, dtype="Q4"), f"tensor {_Q}: unknown dtype 'Q4'"),
        (_set(_Q, shape=[64, -64]), "is not a list of non-negative integers"),
        (_set(_Q, shape="64x64"), "is not a list of non-negative integers"),
        (lambda h: h.update({_Q: 7}), f"tensor {_Q}: header entry is not an object"),
        (
            lambda h: h[_K].update(data_offsets=[h[_Q]["data_offsets"][0] + 2, h[_Q]["data_offsets"][0] + 4098]),
            "overlap",
        ),
        (_set(_Q, data_offsets=[10**15, 10**15 + 8192]), "truncated safetensors file"),
    ],
)
def test_malformed_header_entries(tmp_path, vec_dir, edit, needle):
    d = tmp_path / "x"
    shutil.copytree(vec_dir, d)
    _rewrite_header(d / "model.safetensors", edit)
    with pytest.raises(CheckpointError) as e:
        Checkpoint(d)
    assert needle in str(e.value) and str(d / "model.safetensors") in str(e.value)


@pytest.mark.parametrize(
    "header,needle",
    [
        (b"[1, 2, 3]", "the header is not a JSON object"),
        (b'{"a": {}, "a": {}}', "duplicate key 'a'"),
        (b'{"x": "\xff"}', "not a readable safetensors file"),
        (b"[" * 50000, "not a readable safetensors file"),
    ],
)
def test_header_not_an_object(tmp_path, vec_dir, header, needle):
    d = tmp_path / "x"
    shutil.copytree(vec_dir, d)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CheckpointError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        Checkpoint(d)


def test_header_length_is_checked_before_reading(tmp_path, vec_dir):
    d = tmp_path / "x"
    shutil.copytree(vec_dir, d)
    st = d / "model.safetensors"
    with open(st, "r+b") as f:
        f.write(struct.pack("<Q", 1 << 62))
    with pytest.raises(CheckpointError, match="truncated safetensors file"):
        Checkpoint(d)
    with open(st, "r+b") as f:  # a sparse file large enough for a 200 MB header
        f.write(struct.pack("<Q", 200 << 20))
        f.truncate(300 << 20)
    with pytest.raises(CheckpointError, match="more than the 104857600 safetensors allows"):
        Checkpoint(d)


@pytest.mark.parametrize(
    "weight_map,needle",
    [
        ({"model.norm.weight": 3}, "tensor model.norm.weight maps to 3, not a shard file name"),
        ({"model.norm.weight": "../../etc/passwd"}, "maps to '../../etc/passwd', not a shard file name"),
        ([1, 2], "'weight_map' is not an object"),
    ],
)
def test_bad_index_values(small_sharded, weight_map, needle):
    (small_sharded / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError) as e:
        Checkpoint(small_sharded)
    assert needle in str(e.value) and INDEX_NAME in str(e.value)


def test_cli_bad_checkpoint_is_one_line(tmp_path, vec_dir):
    """A malformed header through the CLI: exit 1, one line, no traceback."""
    d = tmp_path / "x"
    shutil.copytree(vec_dir, d)
    _rewrite_header(d / "model.safetensors", lambda h: h.update({_Q: 7}))
    res = CliRunner().invoke(cli, ["convert", str(d), "-o", str(tmp_path / "o.gguf")])
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert res.output.strip().count("\n") == 0 and "header entry is not an object" in res.output
    assert not (tmp_path / "o.gguf").exists()
