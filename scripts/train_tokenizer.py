#!/usr/bin/env python
"""Train clover-tiny's BPE tokenizer on the stdlib TRAIN split, then encode the train and
held-out corpora and report token counts and unigram baselines.

    python scripts/train_tokenizer.py                      # train + stats
    python scripts/train_tokenizer.py --write-manifest     # (re)make evaldata/heldout-stdlib.json first
    python scripts/train_tokenizer.py --no-train           # stats with the saved tokenizer
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from clover_gguf.tokenizer import BPE_VOCAB_SIZE, CloverTokenizer, train_tokenizer  # noqa: E402
from clover_gguf.train import data  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "models" / "clover-tiny"))
    ap.add_argument("--vocab-size", type=int, default=BPE_VOCAB_SIZE, help="BPE size (the 4 tool tokens follow)")
    ap.add_argument(
        "--write-manifest", action="store_true", help="rewrite evaldata/heldout-stdlib.json from the installed stdlib"
    )
    ap.add_argument("--no-train", action="store_true", help="use the tokenizer already in --out")
    ap.add_argument("--no-stats", action="store_true")
    ap.add_argument("--cache-dir", default=str(REPO / ".cache" / "tokens"))
    ap.add_argument("--stats-json", default=str(REPO / "evaldata" / "tokenizer-stats.json"))
    a = ap.parse_args(argv)

    if a.write_manifest:
        m = data.write_heldout_manifest()
        print(
            f"wrote {data.HELDOUT_MANIFEST}: {len(m['modules'])} modules, {len(m['files'])} files, "
            f"{m['heldout_bytes']}/{m['corpus_bytes']} bytes = {m['fraction']:.4f}"
        )
    m = data.load_heldout_manifest()
    tr_files, ho_files = data.train_files(), data.heldout_files()
    print(
        f"corpus: Python {data.python_version()} stdlib {data.stdlib_root()}; "
        f"train {len(tr_files)} files, held-out {len(ho_files)} files "
        f"({m['fraction'] * 100:.2f}% of bytes: {', '.join(m['modules'])})"
    )

    if a.no_train:
        tok = CloverTokenizer.from_dir(a.out)
    else:
        tok = train_tokenizer(a.out, vocab_size=a.vocab_size)
    if a.no_stats:
        return 0

    t0 = time.time()
    tr = data.encode_files(tok, tr_files, a.cache_dir, "train")
    ho = data.encode_files(tok, ho_files, a.cache_dir, "heldout")
    ent = data.unigram_entropy_bits(tr, ho, vocab_size=tok.vocab_size)
    tr_bytes = sum(p.stat().st_size for p in tr_files)
    ho_bytes = sum(p.stat().st_size for p in ho_files)
    stats = {
        "python_version": data.python_version(),
        "tokenizer_sha256": tok.fingerprint(),
        "vocab_size": tok.vocab_size,
        "train": {
            "files": len(tr_files),
            "bytes": tr_bytes,
            "tokens": int(tr.size),
            "bytes_per_token": round(tr_bytes / tr.size, 4),
        },
        "heldout": {
            "files": len(ho_files),
            "bytes": ho_bytes,
            "tokens": int(ho.size),
            "bytes_per_token": round(ho_bytes / ho.size, 4),
        },
        "unigram_bits_per_token": {
            "heldout_cross_entropy_under_train_add1": round(ent["cross_entropy"], 4),
            "heldout_empirical_entropy": round(ent["heldout_entropy"], 4),
            "train_empirical_entropy": round(ent["train_entropy"], 4),
        },
        "note": "token streams have <|endoftext|> between files; cross entropy = held-out tokens "
        "under the train unigram distribution with add-one smoothing over the vocab",
    }
    print(f"encoded in {time.time() - t0:.1f}s")
    print(json.dumps(stats, indent=1))
    if a.stats_json:
        Path(a.stats_json).write_text(json.dumps(stats, indent=1) + "\n")
        print(f"wrote {a.stats_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
