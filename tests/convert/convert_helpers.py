"""Shared helpers for the converter tests (no tests here)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch
from testdata import REPO, TINY, VECTORS  # noqa: F401

from clover_gguf.config import preset
from clover_gguf.convert import ggml_lib


def require_ggml():
    """libggml-base for the bit-exactness tests. Never skips: CI builds the runtime first."""
    lib = ggml_lib.load(required=False)
    assert lib is not None, (
        "libggml-base not found, so ggml bit-exactness cannot be tested. "
        + ggml_lib.BUILD_HINT
        + f" Looked in: {ggml_lib.candidate_paths() or 'nothing found'}"
    )
    return lib


def small_config(**over):
    """A small config whose rows are multiples of 256 (k-quants without fallback)."""
    d = dict(
        vocab_size=320,
        hidden_size=256,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        mask_token_id=1,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    d.update(over)
    return preset("clover-tiny", **d)


def write_synth(out_dir, fused=False, seed=0, shard_size_mb=2000, **over):
    from clover_gguf.synthetic import write_synthetic

    return write_synthetic(
        out_dir, small_config(**over), fused=fused, seed=seed, shard_size_mb=shard_size_mb, progress=False
    )


def fused_copy(src: Path, dst: Path) -> Path:
    """The same weights as the per-expert model ``src`` with experts fused (spec section 5)."""
    import shutil

    from safetensors.torch import save_file

    from clover_gguf.checkpoint import load_tensors
    from clover_gguf.reference.model import sanitize

    cfg, t = load_tensors(src)
    out = {n: v.contiguous() for n, v in sanitize(cfg, t).items()}
    dst.mkdir(parents=True)
    save_file(out, str(dst / "model.safetensors"))
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


def read_st(path: Path) -> tuple[dict, int, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), 8 + n, raw


def rewrite_st(path: Path, header: dict, data: bytes) -> None:
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * (-len(hj) % 8)
    path.write_bytes(struct.pack("<Q", len(hj)) + hj + data)


def poke_tensor(path: Path, name: str, value: float, index: int = 0) -> None:
    """Overwrite one BF16 element of a tensor in a safetensors file."""
    header, start, raw = read_st(path)
    off = start + header[name]["data_offsets"][0] + 2 * index
    b = torch.tensor([value], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    raw = raw[:off] + b + raw[off + 2 :]
    path.write_bytes(raw)


def ggml_like_llama_quantize(lib, qtype: int, stack: np.ndarray, imatrix: np.ndarray | None) -> bytes:
    """What llama-quantize's llama_tensor_quantize_impl does for a [E, rows, cols] stack:
    one ggml_quantize_chunk per run of rows, the expert's imatrix row for its rows. Covers every
    expert type cheaply; test_llama_quantize.py checks against the real binary."""
    E, rows, cols = stack.shape
    x = np.ascontiguousarray(stack.reshape(E * rows, cols), dtype=np.float32)
    rs = lib.row_size(qtype, cols)
    out = np.zeros((E * rows, rs), np.uint8)
    for e in range(E):
        im = None if imatrix is None else np.ascontiguousarray(imatrix[e], dtype=np.float32)
        lib.quantize_chunk(qtype, x, out, e * rows, rows, im)
    return out.tobytes()


def gguf_tensor_bytes(path, name) -> bytes:
    from gguf import GGUFReader

    r = GGUFReader(path)
    for t in r.tensors:
        if t.name == name:
            return np.asarray(t.data).tobytes()
    raise KeyError(name)
