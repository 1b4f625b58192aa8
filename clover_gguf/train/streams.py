"""The token streams a clover-tiny run trains and evaluates on: the stdlib splits (data.py),
checked against the model config, and the chat transcripts (transcripts.py), each with what
train_log.json records of it under "data"."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import CloverConfig
from ..tokenizer import CloverTokenizer
from . import TrainError, data, transcripts

SPECIAL_IDS = ("mask_token_id", "bos_token_id", "eos_token_id", "pad_token_id")


@dataclass
class Streams:
    tok: CloverTokenizer
    train_ids: np.ndarray  # the train split as it is (unigram baselines, final eval)
    stream_ids: np.ndarray  # what the run trains on (docstrings as --docstrings says)
    held_ids: np.ndarray
    info: dict  # train_log.json's "data"


def check_tokenizer(tok, c: CloverConfig) -> None:
    """The tokenizer's vocabulary size and special ids are the config's."""
    if tok.vocab_size != c.vocab_size:
        raise TrainError(f"tokenizer has {tok.vocab_size} tokens, config vocab_size is {c.vocab_size}")
    ids = dict(zip(SPECIAL_IDS, (tok.mask_id, tok.bos_id, tok.eos_id, tok.pad_id), strict=True))
    for k, v in ids.items():
        if v is not None and getattr(c, k) != v:
            raise TrainError(f"tokenizer {k} = {v}, config says {getattr(c, k)}")


def load_streams(tokenizer_dir: Path, c: CloverConfig, cache_dir, docstrings: str = "full") -> Streams:
    """The tokenizer in tokenizer_dir and the stdlib streams it encodes (cached in cache_dir)."""
    tok = CloverTokenizer.from_dir(tokenizer_dir)
    check_tokenizer(tok, c)
    train_ids = data.train_tokens(tok, cache_dir)
    stream_ids = train_ids if docstrings == "full" else data.train_tokens(tok, cache_dir, docstrings)
    held_ids = data.heldout_tokens(tok, cache_dir)
    m = data.load_heldout_manifest()
    info = {
        "train_files": len(data.train_files()),
        "heldout_files": len(m["files"]),
        "heldout_modules": m["modules"],
        "train_tokens": int(train_ids.size),
        "heldout_tokens": int(held_ids.size),
        "python_version": data.python_version(),
        "docstrings": docstrings,
        "stream_tokens": int(stream_ids.size),
    }
    return Streams(tok, train_ids, stream_ids, held_ids, info)


def chat_stream(tok, seed: int, n: int, cache_dir, ratio: float, seq_tokens: int, loss: str, info: dict, log):
    """The training transcripts' stream for trainer.train(chat=...): (ids, starts), and the
    assistant mask when only the assistant's tokens are scored (loss "assistant"). Records
    what it is in info["chat"]."""
    t0 = time.time()
    ids, starts, assistant = transcripts.transcript_tokens(tok, "train", seed, n, cache_dir)
    lengths = np.diff(np.append(starts, ids.size))
    info["chat"] = {
        "generator": transcripts.GENERATOR_VERSION,
        "seed": seed,
        "transcripts": int(starts.size),
        "tokens": int(ids.size),
        "tokens_per_transcript": {
            "mean": round(float(lengths.mean()), 1),
            **{f"p{q}": int(np.percentile(lengths, q)) for q in (10, 50, 90, 95)},
            "max": int(lengths.max()),
        },
        "ratio": ratio,
        "seq_tokens": seq_tokens,
        "loss": loss,
        "assistant_tokens": int(assistant.sum()),
    }
    log(f"chat: {info['chat']} ({time.time() - t0:.0f} s)")
    out = (torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(starts.astype(np.int64)))
    return out + ((torch.from_numpy(assistant),) if loss == "assistant" else ())
