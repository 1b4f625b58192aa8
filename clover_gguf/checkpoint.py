"""Lazy reader for Clover safetensors checkpoints: single file or sharded (index.json),
experts per-expert or fused. Tensors are read one at a time from the memory-mapped
shard, so memory stays bounded by the largest tensor asked for."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from .config import CloverConfig, ConfigError
from .constants import HF_EXPERT_FUSED_DOWN, HF_EXPERT_FUSED_GATE_UP, HF_EXPERT_PER
from .errors import CloverError
from .inputs import DuplicateKeyError, InputError, no_duplicate_keys, open_input, read_bytes

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# safetensors dtype -> (torch dtype, bytes per element)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "BF16": (torch.bfloat16, 2),
    "F16": (torch.float16, 2),
    "F32": (torch.float32, 4),
    "F64": (torch.float64, 8),
}
KNOWN_DTYPES = set(DTYPES)


class CheckpointError(CloverError, ValueError):
    """A checkpoint that does not match its config: names the file and tensor at fault."""


# bytes per element of every safetensors dtype (for the byte-range check of any entry)
ELEMENT_SIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip
MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_entries(path: Path, header: dict, data_size: int) -> None:
    """Every entry: dtype known, shape a list of counts, data_offsets [begin, end] with
    end - begin == prod(shape) * element size; the byte ranges lie in the data section and
    do not overlap (one tensor's bytes can never be read as another's)."""
    ranges = []
    for name, e in header.items():
        where = f"{path}: tensor {name}"
        if not isinstance(e, dict):
            raise CheckpointError(f"{where}: header entry is not an object")
        dt, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if dt not in ELEMENT_SIZE:
            raise CheckpointError(f"{where}: unknown dtype {dt!r}")
        if not isinstance(shape, list) or not all(_is_count(x) for x in shape):
            raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if not isinstance(offs, list) or len(offs) != 2 or not all(_is_count(x) for x in offs):
            raise CheckpointError(f"{where}: data_offsets {offs!r} is not [begin, end] with non-negative integers")
        b, end = offs
        if b > end:
            raise CheckpointError(f"{where}: data_offsets {offs} are reversed")
        need = math.prod(shape) * ELEMENT_SIZE[dt]
        if end - b != need:
            raise CheckpointError(
                f"{where}: data_offsets {offs} hold {end - b} bytes, shape {shape} of {dt} needs {need}"
            )
        ranges.append((b, end, name))
    ranges.sort()
    pos, prev = 0, None
    for b, end, name in ranges:
        if end > data_size:
            raise CheckpointError(
                f"{path}: truncated safetensors file: tensor {name} needs data up to byte {end}, "
                f"the data section has {data_size}"
            )
        if b < pos:
            raise CheckpointError(f"{path}: tensors {prev} and {name} overlap (data_offsets)")
        if end > b:  # empty tensors overlap nothing
            pos, prev = end, name


def _read_header(path: Path) -> dict:
    """Parse and check a safetensors header without mapping the data (see _check_entries)."""
    try:
        with open_input(path) as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise CheckpointError(f"{path}: truncated safetensors file (header says {n} bytes)")
            if n > MAX_HEADER:
                raise CheckpointError(f"{path}: header of {n} bytes, more than the {MAX_HEADER} safetensors allows")
            header = json.loads(f.read(n).decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except (OSError, ValueError, RecursionError) as e:  # JSON and UTF-8 errors are ValueErrors
        if isinstance(e, CheckpointError):
            raise
        if isinstance(e, InputError):  # a FIFO or device: never opened for reading
            raise CheckpointError(str(e)) from None
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a readable safetensors file (the header is not a JSON object)")
    header.pop("__metadata__", None)
    _check_entries(path, header, size - 8 - n)
    return header


class Checkpoint:
    def __init__(self, model_dir: str | Path, config: CloverConfig | None = None):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: not a model directory")
        self.config = config or CloverConfig.load(self.dir)
        index = self.dir / INDEX_NAME
        self._where: dict[str, Path] = {}
        if index.exists():
            self._where = self._read_index(index)
        elif (self.dir / SINGLE_NAME).exists():
            self._where = None  # filled from the header below
        else:
            raise CheckpointError(f"{self.dir}: no {SINGLE_NAME} or {INDEX_NAME}")
        self._headers: dict[Path, dict] = {}
        if self._where is None:
            p = self.dir / SINGLE_NAME
            self._where = {n: p for n in self._header(p)}
        else:
            for shard in sorted(set(self._where.values())):
                if not shard.exists():
                    missing = sorted(n for n, s in self._where.items() if s == shard)
                    raise CheckpointError(
                        f"{shard}: shard listed in {INDEX_NAME} is missing "
                        f"(holds {len(missing)} tensors, e.g. {missing[0]})"
                    )
                hdr = self._header(shard)
                for n, s in self._where.items():
                    if s == shard and n not in hdr:
                        raise CheckpointError(
                            f"{shard}: tensor {n} is mapped to this shard by {INDEX_NAME} but not in it"
                        )
        self._handles: dict[Path, object] = {}
        self.layout = "fused" if HF_EXPERT_FUSED_DOWN.format(bid=0) in self._where else "per_expert"

    def _read_index(self, index: Path) -> dict[str, Path]:
        """tensor -> shard path from model.safetensors.index.json; shards are plain file names."""
        try:
            wm = json.loads(read_bytes(index).decode("utf-8"), object_pairs_hook=no_duplicate_keys)["weight_map"]
        except InputError as e:
            raise CheckpointError(str(e)) from None
        except DuplicateKeyError as e:
            raise CheckpointError(f"{index}: bad index file ({e})") from None
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise CheckpointError(f"{index}: bad index file ({e!r})") from None
        if not isinstance(wm, dict):
            raise CheckpointError(f"{index}: bad index file ('weight_map' is not an object)")
        where = {}
        for name, shard in wm.items():
            if not isinstance(shard, str) or not shard or shard in (".", "..") or "/" in shard or "\\" in shard:
                raise CheckpointError(f"{index}: tensor {name} maps to {shard!r}, not a shard file name")
            where[name] = self.dir / shard
        return where

    def _header(self, path: Path) -> dict:
        if path not in self._headers:
            self._headers[path] = _read_header(path)
        return self._headers[path]

    # ---- metadata ----------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._where)

    def shard_of(self, name: str) -> Path:
        if name not in self._where:
            raise CheckpointError(f"{self.dir}: tensor {name} not found in the checkpoint")
        return self._where[name]

    def _info(self, name: str) -> dict:
        shard = self.shard_of(name)
        return self._header(shard)[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._info(name)["shape"])

    def dtype(self, name: str) -> str:
        return self._info(name)["dtype"]

    def nbytes(self, name: str) -> int:
        a, b = self._info(name)["data_offsets"]
        return b - a

    def validate(self) -> None:
        """Missing/extra tensors, wrong shapes, unknown dtypes: raise naming the culprit."""
        expected = self.config.expected_tensors(fused=self.layout == "fused")
        for name, shape in expected.items():
            if name not in self._where:
                raise CheckpointError(f"{self.dir}: missing tensor {name} (expected shape {list(shape)})")
            got = self.shape(name)
            if got != shape:
                raise CheckpointError(
                    f"{self.shard_of(name)}: tensor {name} has shape {list(got)}, config implies {list(shape)}"
                )
            dt = self.dtype(name)
            if dt not in KNOWN_DTYPES:
                raise CheckpointError(
                    f"{self.shard_of(name)}: tensor {name} has unsupported dtype {dt} "
                    f"(supported: {', '.join(sorted(KNOWN_DTYPES))})"
                )
        extra = [n for n in self._where if n not in expected]
        if extra:
            raise CheckpointError(
                f"{self.shard_of(extra[0])}: unexpected tensor {extra[0]} "
                f"({len(extra)} extra tensors) for a {self.layout} checkpoint"
            )

    # ---- data ----------------------------------------------------------------------------
    def get(self, name: str) -> torch.Tensor:
        shard = self.shard_of(name)
        if shard not in self._handles:
            try:
                self._handles[shard] = safe_open(str(shard), framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"{shard}: cannot open ({e})") from None
        try:
            return self._handles[shard].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{shard}: cannot read tensor {name} ({e})") from None

    def expert_stack(self, layer: int, proj: str) -> torch.Tensor:
        """[E, rows, cols] for proj in gate/up/down, whatever the layout."""
        c = self.config
        if self.layout == "fused":
            if proj == "down":
                return self.get(HF_EXPERT_FUSED_DOWN.format(bid=layer))
            gu = self.get(HF_EXPERT_FUSED_GATE_UP.format(bid=layer))
            F = c.moe_intermediate_size
            return (gu[:, :F] if proj == "gate" else gu[:, F:]).contiguous()
        return torch.stack([self.get(HF_EXPERT_PER.format(bid=layer, xid=x, proj=proj)) for x in range(c.num_experts)])

    def iter_hf_tensors(self):
        """(name, tensor) in the spec's order, one tensor at a time."""
        for name in self.config.expected_tensors(fused=self.layout == "fused"):
            yield name, self.get(name)

    def close(self):
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()


def load_tensors(model_dir: str | Path, validate: bool = True) -> tuple[CloverConfig, dict[str, torch.Tensor]]:
    """Whole checkpoint as a dict (for the small models the reference runs)."""
    ck = Checkpoint(model_dir)
    if validate:
        ck.validate()
    return ck.config, dict(ck.iter_hf_tensors())


__all__ = ["Checkpoint", "CheckpointError", "ConfigError", "load_tensors"]
