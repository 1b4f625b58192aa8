"""Seeded synthetic Clover models (random weights, real tensor shapes): safetensors
checkpoints written shard by shard, tensor by tensor (memory stays bounded by the largest
tensor), their headers alone (SyntheticSource, for the planner's sizes), and GGUFs of random
quantized blocks written through the converter's plan and writer (write_synthetic_gguf)."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .checkpoint import INDEX_NAME, SINGLE_NAME
from .config import CloverConfig
from .constants import HF_EXPERT_FUSED_DOWN, HF_EXPERT_FUSED_GATE_UP, HF_EXPERT_PER
from .outputs import check_replaceable, output_file, write_json

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


def _weights(name: str, shape: tuple[int, ...], seed: int, config: CloverConfig) -> torch.Tensor:
    """_init, except that fused experts stack the per-expert tensors' values, so that a fused
    and a per-expert checkpoint of one seed hold the same model."""
    for bid in range(config.num_hidden_layers):
        if name == HF_EXPERT_FUSED_GATE_UP.format(bid=bid):
            projs = ("gate", "up")
        elif name == HF_EXPERT_FUSED_DOWN.format(bid=bid):
            projs = ("down",)
        else:
            continue
        out = torch.empty(shape)
        rows = shape[1] // len(projs)
        for x in range(shape[0]):
            for j, p in enumerate(projs):
                per = HF_EXPERT_PER.format(bid=bid, xid=x, proj=p)
                out[x, j * rows : (j + 1) * rows] = _init(per, (rows, shape[2]), seed)
        return out
    return _init(name, shape, seed)


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
    for fname in [*names, INDEX_NAME, "config.json"]:  # before the work
        check_replaceable(out / fname, force=True)
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
        with output_file(out / fname, force=True) as f:
            f.write(struct.pack("<Q", len(hjson)))
            f.write(hjson)
            for n in members:
                t = _weights(n, shapes[n], seed, config).to(dtype).contiguous()
                f.write(t.view(torch.uint8).numpy().tobytes() if dtype == torch.bfloat16 else t.numpy().tobytes())
                bar.update(sizes[n])
                del t
    bar.close()
    if len(shards) > 1:
        write_json(out / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
    config.save(out / "config.json")
    return out


# --------------------------------------------------------------------------- GGUF directly

POOL_ROWS = 64  # distinct quantized rows per (tensor kind); tensors repeat them in random order


class SyntheticSource:
    """What the converter's plan reads from a checkpoint, for a config alone (fused experts,
    BF16): the names and shapes the config implies."""

    def __init__(self, config: CloverConfig, folder: Path):
        self.config, self.dir, self.layout = config, folder, "fused"
        self._shapes = config.expected_tensors(fused=True)

    def names(self) -> list[str]:
        return list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def dtype(self, name: str) -> str:
        return "BF16"


def _float_rows(entry, seed: int) -> torch.Tensor:
    """A small tensor's values (norms, memory gates, conv), as synthetic checkpoints have them."""
    hf = entry.pieces[0].hf
    t = _init(hf, entry.shape if entry.transform != "conv" else (entry.shape[0], 1, entry.shape[1]), seed)
    if entry.transform == "a_log":
        t = -torch.exp(t.double())
    return t.float().reshape(-1, entry.shape[-1])


def _random_rows(entry, seed: int, threads: int) -> np.ndarray:
    """POOL_ROWS valid quantized rows of the entry's type, from normal values at the scale a
    trained weight of that fan-in has."""
    from .convert import quants

    g = torch.Generator().manual_seed(seed ^ int(hashlib.sha256(entry.name.encode()).hexdigest()[:12], 16))
    n = entry.shape[-1]
    std = 0.02 if entry.group == "embeddings" else n**-0.5
    x = (std * torch.randn(POOL_ROWS, n, generator=g)).numpy()
    return quants.quantize_rows(x, entry.qtype, threads=threads)


def write_synthetic_gguf(
    out_path: str | Path,
    config: CloverConfig,
    layers: int | None = None,
    recipe: str | None = "q4_k_m",
    seed: int = 0,
    outtype: str | None = None,
    experts: str | None = None,
    threads: int | None = None,
    progress: bool = True,
) -> Path:
    """A GGUF with the config's shapes and the recipe's types, written directly: each quantized
    tensor repeats POOL_ROWS valid random rows in a seeded order (no BF16 intermediate, no
    quantization of the whole model), small float tensors get a synthetic checkpoint's values.
    The file loads and runs in the runtime like a converted one (a random model)."""

    from .convert import quants
    from .convert.metadata import metadata, placeholder_vocab
    from .convert.recipes import TypeRules
    from .convert.tensor_plan import build_plan
    from .convert.writer import temporary_output, write_gguf
    from .util import default_threads

    out = Path(out_path)
    check_replaceable(out, force=True, tag="convert")  # before the work
    if layers is not None:
        config = CloverConfig.from_dict({**config.to_dict(), "num_hidden_layers": layers})
    threads = threads or default_threads()
    source = SyntheticSource(config, out.parent)
    plan = build_plan(source, TypeRules.make(outtype, experts, None, recipe))
    kv = metadata(plan, placeholder_vocab(config), True, name=f"synthetic-{out.stem}")

    class _Data:
        def run(self, f, align: int) -> None:
            rng = np.random.default_rng(seed)
            bar = tqdm(total=plan.total_bytes, unit="B", unit_scale=True, desc="synth", disable=not progress)
            for e in plan.entries:
                if e.qtype not in quants.FLOAT_TYPES:
                    pool = _random_rows(e, seed, threads)
                    n_rows = e.n_elements // e.n_per_row
                    for r0 in range(0, n_rows, 1 << 14):
                        idx = rng.integers(0, POOL_ROWS, min(1 << 14, n_rows - r0))
                        f.write(pool[idx].tobytes())
                else:
                    f.write(quants.quantize_rows(_float_rows(e, seed).numpy(), e.qtype, threads=threads).tobytes())
                f.write(b"\0" * (-f.tell() % align))
                bar.update(e.nbytes)
            bar.close()

    with temporary_output(out, force=True) as f:
        write_gguf(f, plan, kv, _Data())
    return out
