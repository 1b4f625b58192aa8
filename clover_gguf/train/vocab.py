"""Grow a trained clover-tiny's vocabulary (warm start of a model whose tokenizer gained tokens).

The new rows of `model.embed_tokens` and `lm_head` start at the mean of the existing rows: the
new tokens' logits sit at the average logit (far below any likely token) until training teaches
them, so the grown model generates what the old one did wherever it does not use them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..outputs import write_bytes, write_json
from ..tokenizer import add_tool_tokens

GROWN_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def grow_rows(w: torch.Tensor, n_new: int) -> torch.Tensor:
    mean = w.float().mean(0, keepdim=True).to(w.dtype)
    return torch.cat([w, mean.expand(n_new, -1)], 0).contiguous()


def add_tool_tokens_to_model(src: str | Path, out: str | Path) -> int:
    """Copy the model folder `src` to `out` with the tool tokens appended to its tokenizer and
    the embedding and output rows grown to match. Returns the new vocabulary size."""
    from safetensors.torch import load_file, save

    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = add_tool_tokens(src, out)
    cfg = json.loads((src / "config.json").read_text())
    n_old, n_new = int(cfg["vocab_size"]), tok.vocab_size
    sd = load_file(str(src / "model.safetensors"))
    for name in GROWN_TENSORS:
        if sd[name].shape[0] != n_old:
            raise ValueError(f"{src}: {name} has {sd[name].shape[0]} rows, config.json says vocab_size {n_old}")
        sd[name] = grow_rows(sd[name], n_new - n_old)
    write_bytes(out / "model.safetensors", save(sd, metadata={"format": "pt"}))
    cfg["vocab_size"] = n_new
    write_json(out / "config.json", cfg)
    for f in src.iterdir():
        if f.is_file() and not (out / f.name).exists():
            shutil.copy2(f, out / f.name)
    return n_new
