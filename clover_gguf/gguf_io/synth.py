"""Seeded synthetic Clover checkpoints (random weights, real tensor shapes), written
shard by shard, tensor by tensor: memory stays bounded by the largest tensor."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch
from tqdm import tqdm

from ..checkpoint import INDEX_NAME, SINGLE_NAME
from ..config import CloverConfig

_ST_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def _init(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Deterministic per-tensor values with plausible scales (so logits stay finite)."""
    g = torch.Generator().manual_seed(seed ^ int(hashlib.sha256(name.encode()).hexdigest()[:12], 16))
    if name.endswith("norm.weight") or name.endswith("conv.scale") or name.endswith("calibration"):
        return 1.0 + 0.05 * torch.randn(shape, generator=g)
    if name.endswith("A_log"):
        return torch.log(torch.empty(shape).uniform_(1, 16, generator=g))
    if name.endswith("dt_bias"):
        return torch.empty(shape).uniform_(-4, -2, generator=g)
    fan_in = shape[-1] if len(shape) > 1 else 1
    std = 0.02 if "embed" in name else fan_in**-0.5
    return std * torch.randn(shape, generator=g)


def plan_shards(sizes: dict[str, int], shard_bytes: int) -> list[list[str]]:
    shards, cur, cur_size = [], [], 0
    for name, n in sizes.items():
        if cur and cur_size + n > shard_bytes:
            shards.append(cur)
            cur, cur_size = [], 0
        cur.append(name)
        cur_size += n
    if cur:
        shards.append(cur)
    return shards


def write_synthetic(
    out_dir: str | Path,
    config: CloverConfig,
    layers: int | None = None,
    shard_size_mb: float = 2000,
    fused: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    progress: bool = True,
) -> Path:
    """Write config.json + safetensors shards (+ index when more than one shard)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if layers is not None:
        config = CloverConfig.from_dict({**config.to_dict(), "num_hidden_layers": layers})
    shapes = config.expected_tensors(fused=fused)
    esize = torch.tensor([], dtype=dtype).element_size()
    sizes = {n: esize * int(torch.Size(s).numel()) for n, s in shapes.items()}
    shards = plan_shards(sizes, int(shard_size_mb * 2**20))
    names = (
        [SINGLE_NAME]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    total = sum(sizes.values())
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="synth", disable=not progress)
    weight_map = {}
    for fname, members in zip(names, shards):
        header, off = {}, 0
        for n in members:
            header[n] = {"dtype": _ST_DTYPE[dtype], "shape": list(shapes[n]), "data_offsets": [off, off + sizes[n]]}
            off += sizes[n]
            weight_map[n] = fname
        hjson = json.dumps(header, separators=(",", ":")).encode()
        hjson += b" " * (-len(hjson) % 8)
        tmp = out / (fname + ".tmp")
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(hjson)))
            f.write(hjson)
            for n in members:
                t = _init(n, shapes[n], seed).to(dtype).contiguous()
                f.write(t.view(torch.uint8).numpy().tobytes() if dtype == torch.bfloat16 else t.numpy().tobytes())
                bar.update(sizes[n])
                del t
        os.replace(tmp, out / fname)
    bar.close()
    if len(shards) > 1:
        (out / INDEX_NAME).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n"
        )
    config.save(out / "config.json")
    return out
