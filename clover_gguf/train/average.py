"""Uniform weight averaging of model folders fine-tuned from one starting point (a "model soup",
Wortsman et al. 2022, arXiv 2203.05482): the mean of each tensor, in fp32, stored in the first
folder's dtype. Runs that start from the same weights stay in one basin, so their mean is a
model too, and it averages out part of each run's own slips.

    python scripts/average_weights.py OUT RUN_A RUN_B [RUN_C ...]
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..inputs import read_bytes
from ..outputs import write_bytes, write_json
from . import TrainError
from .export import TOKENIZER_FILES

WEIGHTS, CONFIG = "model.safetensors", "config.json"


def _load(path: Path, data: bytes) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(data)
    except SafetensorError as e:
        raise TrainError(f"{path}: not a safetensors file ({e})") from None


def _same_file(folders: list[Path], name: str) -> bytes:
    """The bytes of folders[i]/name, which must be the same in every folder."""
    first = read_bytes(folders[0] / name)
    for f in folders[1:]:
        if read_bytes(f / name) != first:
            raise TrainError(f"{f / name}: differs from {folders[0] / name}; only runs of one model can be averaged")
    return first


def average_weights(out: str | Path, folders: list[str | Path]) -> dict:
    """out/: the mean of the folders' weights, their (identical) config and tokenizer, and
    average.json naming the sources and their weights' SHA-256."""
    folders = [Path(f) for f in folders]
    if len(folders) < 2:
        raise TrainError("average: give at least two model folders")
    out = Path(out)
    if out.resolve() in {f.resolve() for f in folders}:
        raise TrainError(f"{out}: is one of the inputs; write the average to a new folder")
    config = _same_file(folders, CONFIG)
    tokenizer = {n: _same_file(folders, n) for n in TOKENIZER_FILES}
    total, first, sources = None, None, []
    for f in folders:
        data = read_bytes(f / WEIGHTS)
        sd = _load(f / WEIGHTS, data)
        sources.append({"folder": str(f), "sha256": hashlib.sha256(data).hexdigest()})
        if first is None:
            first = {k: (v.shape, v.dtype) for k, v in sd.items()}
            total = {k: v.float() for k, v in sd.items()}
            continue
        if set(sd) != set(first):
            name = sorted(set(sd) ^ set(first))[0]
            raise TrainError(f"{f / WEIGHTS}: tensor {name} is in one folder and not the other")
        for k, v in sd.items():
            if v.shape != first[k][0]:
                raise TrainError(f"{f / WEIGHTS}: tensor {k} has shape {list(v.shape)}, not {list(first[k][0])}")
            total[k] += v.float()
    from safetensors.torch import save

    mean = {k: (v / len(folders)).to(first[k][1]).contiguous() for k, v in total.items()}
    out.mkdir(parents=True, exist_ok=True)
    write_bytes(out / WEIGHTS, save(mean, metadata={"format": "pt"}))
    write_bytes(out / CONFIG, config)
    for name, data in tokenizer.items():
        write_bytes(out / name, data)
    info = {"method": "uniform mean of each tensor (fp32), stored as the inputs' dtype", "sources": sources}
    write_json(out / "average.json", info)
    return info
