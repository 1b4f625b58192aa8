"""The model folder a clover-tiny run writes (--out): model.safetensors + config.json
(trainer.save_hf), the tokenizer files, train_log.json (compacted) and loss.png, each file
replaced whole (outputs.py)."""

from __future__ import annotations

import json
from pathlib import Path

from ..inputs import read_text
from ..outputs import write_bytes, write_text
from . import TrainError
from .loss_plot import plot_loss
from .trainer import save_hf

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def compact_log(log: dict, max_points: int = 600) -> dict:
    """The log with at most about max_points step records: every k-th, the last, and every one
    that carries a tok/s figure."""
    out = dict(log)
    steps = log["steps"]
    k = max(1, -(-len(steps) // max_points))
    keep = [i for i, r in enumerate(steps) if i % k == 0 or i == len(steps) - 1 or "tok_per_s" in r]
    out["steps"] = [steps[i] for i in keep]
    out["steps_subsampled_every"] = k
    return out


def read_train_log(folder: str | Path) -> dict:
    """folder/train_log.json (--eval-only, --card-only)."""
    path = Path(folder) / "train_log.json"
    try:
        return json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise TrainError(f"{path}: not JSON ({e})") from None


def write_train_log(out: Path, log: dict) -> Path:
    """out/train_log.json: the compacted log, one line."""
    return write_text(Path(out) / "train_log.json", json.dumps(compact_log(log), separators=(",", ":")) + "\n")


def copy_tokenizer(src: Path, out: Path) -> None:
    """The tokenizer files from src into out (nothing to do when they are the same files)."""
    for name in TOKENIZER_FILES:
        if (src / name).resolve() != (out / name).resolve():
            write_bytes(out / name, (src / name).read_bytes())


def exporter(out: str | Path, tokenizer_dir: str | Path, info: dict):
    """export(model, log) for trainer.train: the model folder `out` as it stands (weights, config,
    tokenizer from tokenizer_dir, train_log.json with info as its "data", loss.png)."""
    out, src = Path(out), Path(tokenizer_dir)

    def export(model, log) -> Path:
        save_hf(model, out)
        copy_tokenizer(src, out)
        full = {**log, "data": info}
        write_train_log(out, full)
        plot_loss(full, out / "loss.png")
        return out

    return export
