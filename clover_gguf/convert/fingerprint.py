"""A fingerprint of a checkpoint's weights, so that `eval` can refuse a GGUF that is not a
conversion of its --reference (issue 26, defect 8).

sha256 over the source bytes of every tensor, as the converter reads them: per GGUF tensor in
the output order, its pieces' rows in the source dtype (before any transform). The per-expert
and fused layouts of the same weights, and any sharding, give the same value; other weights,
another dtype or another shape give another. The converter hashes while it streams (no second
read: pipeline.SourceScan) and records the value as ``clover_gguf.source_weights_sha256``;
`weights_sha256(ck)` computes it over a checkpoint (eval's reference)."""

from __future__ import annotations

import hashlib
import os
import secrets

from ..checkpoint import Checkpoint
from .pipeline import CHUNK_ELEMENTS, ShardReader, source_bytes
from .tensor_plan import source_entries

HEX_LEN = 64  # a sha256 in hex


def weights_sha256(ck: Checkpoint) -> str:
    h = hashlib.sha256()
    with ShardReader(ck) as reader:
        for _name, _shape, pieces, _transform in source_entries(ck):
            for p in pieces:
                _, _, shape, _ = reader.info(p.hf)
                step = max(1, CHUNK_ELEMENTS // (shape[-1] if shape else 1))
                for r in range(p.r0, p.r1, step):
                    h.update(source_bytes(reader.rows(p.hf, r, min(p.r1, r + step))))
    return h.hexdigest()


def placeholder() -> str:
    """A unique stand-in of the fingerprint's length, written in the header and replaced when
    the data has been streamed (the header comes first; the value is known at the end)."""
    return secrets.token_hex(HEX_LEN // 2)


def patch(f, stand_in: str, digest: str) -> None:
    """Replace ``stand_in`` by ``digest`` in the metadata of the open, not yet published file."""
    f.flush()
    fd = f.fileno()
    head = os.pread(fd, min(os.fstat(fd).st_size, 64 << 20), 0)
    i = head.find(stand_in.encode())
    if i < 0 or len(digest) != len(stand_in):
        raise RuntimeError("the weights fingerprint's place in the header was not found")
    os.pwrite(fd, digest.encode(), i)
