"""Evaluation corpus -> windows of blocks -> masked copies at fixed ratios and seeds.

A *window* is a run of ``n_blocks`` consecutive full blocks of ``block_size`` tokens taken
from one document (file), at a block-aligned random offset; positions restart at 0 at the
window start, so block b of a window has b committed blocks of history. Every block of a
window is scored: for each mask ratio ρ, ``max(1, round(ρ·B))`` positions of the block are
masked (chosen by a seeded ``torch.Generator``), the model sees the clean blocks before it
as committed history, and the masked positions are scored against the true tokens.

Recall probes (long-history drift): a masked position whose true token is identifier-like,
does not occur among the block's visible tokens nor in the last ``PROBE_NEAR`` tokens of
history, and last occurred at least ``PROBE_MIN_DIST`` tokens back. Its distance is the
number of tokens back to that last occurrence.

Everything that fixes the sample -- corpus files and their bytes, tokenizer fingerprint,
window offsets, ratios, seeds -- goes into the run's ``samples`` record, so a later run can
be checked against it (``SampleSet.fingerprint``).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ...errors import CloverError

DEFAULT_RATIOS = (0.15, 0.5, 0.85, 1.0)
DEFAULT_SEED = 1234
PROBE_MIN_DIST = 64  # tokens
PROBE_NEAR = 32  # tokens of recent history that must not contain the token
PROBE_BINS = (64, 128, 256, 512, 1 << 30)
HISTORY_BINS = ((0, 0), (1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 63), (64, 127), (128, 1 << 30))
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{2,}$")


class EvalCorpusError(CloverError, RuntimeError):
    pass


@dataclass
class Document:
    name: str
    tokens: np.ndarray  # int64
    nbytes: int = 0


def _read_utf8(p: Path) -> str:
    try:
        return p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise EvalCorpusError(f"{p}: not UTF-8 text (byte {e.start})") from None


def read_texts(paths) -> list[tuple[str, str]]:
    """(name, text) per document: a text file is one document; a ``.jsonl`` file gives one
    document per line, the line's ``"text"`` field (or the line itself if it is a string)."""
    out = []
    for p in map(Path, paths):
        if not p.is_file():
            raise EvalCorpusError(f"corpus file not found: {p}")
        if p.suffix == ".jsonl":
            for i, line in enumerate(_read_utf8(p).splitlines()):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise EvalCorpusError(f"{p}:{i + 1}: not JSON ({e})") from None
                text = obj if isinstance(obj, str) else obj.get("text") if isinstance(obj, dict) else None
                if not isinstance(text, str):
                    raise EvalCorpusError(f'{p}:{i + 1}: expected a string or an object with a "text" string')
                out.append((f"{p.name}:{i + 1}", text))
        else:
            out.append((p.name if p.is_absolute() else str(p), _read_utf8(p)))
    return out


def default_corpus_files() -> tuple[list[Path], str, dict]:
    """clover-tiny's held-out stdlib files, a description, and whether they are the committed
    baseline's text (train.data.corpus_identity)."""
    from ...train.data import HELDOUT_MANIFEST, CorpusError, corpus_identity, heldout_files

    try:
        files, ident = heldout_files(), corpus_identity()
    except CorpusError as e:
        raise EvalCorpusError(str(e)) from None
    return files, f"held-out stdlib modules ({HELDOUT_MANIFEST.relative_to(HELDOUT_MANIFEST.parents[1])})", ident


def tokenize(tokenizer, texts: list[tuple[str, str]]) -> list[Document]:
    ids = tokenizer.encode_batch([t for _, t in texts])
    return [Document(n, np.asarray(i, dtype=np.int64), len(t.encode())) for (n, t), i in zip(texts, ids)]


@dataclass
class Window:
    doc: int  # index into the document list
    offset: int  # token offset in the document (block aligned)
    tokens: np.ndarray  # [n_blocks * B]


@dataclass
class SampleSet:
    """Windows, masks and per-position metadata of every scored position.

    Scored positions are ordered window by window; inside a window by ratio, block, slot
    (row-major over the boolean mask [R, nb, B]). ``meta`` arrays are parallel to that order."""

    block_size: int
    ratios: tuple[float, ...]
    seed: int
    docs: list[Document]
    windows: list[Window]
    masks: list[np.ndarray]  # per window, bool [R, nb, B]
    meta: dict[str, np.ndarray] = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    mask_token_id: int = 1

    def n_blocks(self, w: int) -> int:
        return len(self.windows[w].tokens) // self.block_size

    def clean(self, w: int) -> torch.Tensor:
        return torch.from_numpy(self.windows[w].tokens).view(-1, self.block_size)

    def noisy(self, w: int) -> torch.Tensor:
        """[R, nb, B] tokens with the masked positions set to the mask token."""
        c = self.clean(w)[None].expand(len(self.ratios), -1, -1).clone()
        c[torch.from_numpy(self.masks[w])] = self.mask_token_id
        return c

    def targets(self, w: int) -> torch.Tensor:
        c = self.clean(w)[None].expand(len(self.ratios), -1, -1)
        return c[torch.from_numpy(self.masks[w])]

    @property
    def n_positions(self) -> int:
        return int(sum(m.sum() for m in self.masks))

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        h.update(json.dumps([self.block_size, list(self.ratios), self.seed, self.mask_token_id]).encode())
        for w, m in zip(self.windows, self.masks):
            h.update(np.ascontiguousarray(w.tokens, dtype=np.int64).tobytes())
            h.update(np.packbits(m).tobytes())
        return h.hexdigest()

    def describe(self) -> dict:
        nb = [self.n_blocks(i) for i in range(len(self.windows))]
        return {
            **self.info,
            "block_size": self.block_size,
            "ratios": list(self.ratios),
            "seed": self.seed,
            "n_windows": len(self.windows),
            "blocks_per_window": nb,
            "scored_positions": self.n_positions,
            "fingerprint": self.fingerprint(),
            "windows": [
                {"doc": self.docs[w.doc].name, "offset": int(w.offset), "n_blocks": n} for w, n in zip(self.windows, nb)
            ],
            "masking": "per block, max(1, round(ratio*L)) positions drawn with torch.Generator("
            "seed + 1000*window + ratio_index).randperm",
            "probes": {
                "min_distance": PROBE_MIN_DIST,
                "near": PROBE_NEAR,
                "bins": list(PROBE_BINS[:-1]),
                "rule": "masked identifier-like token absent from the block's visible tokens and "
                f"the last {PROBE_NEAR} history tokens, last seen >= {PROBE_MIN_DIST} tokens back",
            },
        }


def _choose_windows(docs: list[Document], B: int, n_windows: int, n_blocks: int, rng: np.random.Generator):
    W = n_blocks * B
    lens = np.array([len(d.tokens) // B * B for d in docs])
    ok = np.nonzero(lens >= 2 * B)[0]
    if ok.size == 0:
        raise EvalCorpusError(
            f"the corpus ({len(docs)} documents, {int(sum(len(d.tokens) for d in docs))} tokens) has no document "
            f"of two blocks of {B} tokens"
        )
    out, used = [], set()
    weight = np.maximum(lens[ok] - W, 0) // B + 1
    for _ in range(n_windows):
        p = weight / weight.sum()
        i = int(ok[rng.choice(len(ok), p=p)])
        n_off = max(0, lens[i] - W) // B + 1
        off = int(rng.integers(n_off)) * B
        if (i, off) in used and len(used) < weight.sum():
            continue  # drawn twice: skip (deterministic)
        used.add((i, off))
        out.append(Window(i, off, docs[i].tokens[off : off + min(W, lens[i] - off)].copy()))
    return out


def build_samples(
    docs: list[Document],
    block_size: int,
    n_windows: int = 6,
    n_blocks: int = 64,
    ratios=DEFAULT_RATIOS,
    seed: int = DEFAULT_SEED,
    mask_token_id: int = 1,
    is_identifier=None,
    info: dict | None = None,
) -> SampleSet:
    """Windows and masks (see the module docstring). ``is_identifier(token_id) -> bool``
    marks probe candidates (default: every token)."""
    B = int(block_size)
    ratios = tuple(float(r) for r in ratios)
    if not ratios or any(not 0 < r <= 1 for r in ratios):
        raise EvalCorpusError(f"mask ratios must be in (0, 1]: {ratios}")
    rng = np.random.default_rng(seed)
    windows = _choose_windows(docs, B, n_windows, n_blocks, rng)
    masks, meta = [], {k: [] for k in ("window", "ratio", "block", "slot", "target", "probe_dist")}
    for wi, w in enumerate(windows):
        nb = len(w.tokens) // B
        m = np.zeros((len(ratios), nb, B), dtype=bool)
        for ri, r in enumerate(ratios):
            g = torch.Generator().manual_seed(seed + 1000 * wi + ri)
            n = max(1, int(round(r * B)))
            for b in range(nb):
                m[ri, b, torch.randperm(B, generator=g)[:n].numpy()] = True
        masks.append(m)
        last_seen: dict[int, int] = {}
        toks = w.tokens
        # probe distances per (block, slot) need the history before the block: walk blocks
        prev_last = []
        for b in range(nb):
            prev_last.append(dict(last_seen))
            for j in range(B):
                last_seen[int(toks[b * B + j])] = b * B + j
        for ri in range(len(ratios)):
            for b, j in zip(*np.nonzero(m[ri])):
                t = int(toks[b * B + j])
                pos = b * B + j
                dist = -1
                hist = prev_last[b]
                if t in hist and (is_identifier is None or is_identifier(t)):
                    d = pos - hist[t]
                    visible = toks[b * B : (b + 1) * B][~m[ri, b]]
                    if d >= PROBE_MIN_DIST and hist[t] < b * B - PROBE_NEAR and t not in set(visible.tolist()):
                        dist = d
                meta["window"].append(wi)
                meta["ratio"].append(ri)
                meta["block"].append(b)
                meta["slot"].append(j)
                meta["target"].append(t)
                meta["probe_dist"].append(dist)
    meta_np = {k: np.asarray(v, dtype=np.int64) for k, v in meta.items()}
    return SampleSet(B, ratios, seed, docs, windows, masks, meta_np, dict(info or {}), mask_token_id)


def identifier_predicate(tokenizer):
    """token id -> True when the token's text (leading space / Ġ stripped) is identifier-like."""
    cache: dict[int, bool] = {}

    def f(t: int) -> bool:
        if t not in cache:
            s = tokenizer.decode([t]).strip()
            cache[t] = bool(_IDENT.match(s))
        return cache[t]

    return f


def history_bin(b: int) -> str:
    for lo, hi in HISTORY_BINS:
        if lo <= b <= hi:
            return f"{lo}" if lo == hi else (f"{lo}-{hi}" if hi < (1 << 30) else f"{lo}+")
    return "?"


def probe_bin(d: int) -> str | None:
    if d < 0:
        return None
    for lo, hi in zip(PROBE_BINS[:-1], PROBE_BINS[1:]):
        if lo <= d < hi:
            return f"{lo}-{hi - 1}" if hi < (1 << 30) else f"{lo}+"
    return None


def load_corpus(paths=None, tokenizer=None) -> tuple[list[Document], dict]:
    """Documents from user files (text / JSONL) or, by default, the held-out stdlib files."""
    if tokenizer is None:
        raise EvalCorpusError("a tokenizer is needed to read a text corpus (the model dir has no tokenizer.json?)")
    ident = None
    if paths:
        files, desc = [Path(p) for p in paths], "user corpus"
    else:
        files, desc, ident = default_corpus_files()
    texts = read_texts(files)
    docs = tokenize(tokenizer, texts)
    info = {
        "corpus": desc,
        "files": [str(f) for f in files] if paths else len(files),
        "documents": len(docs),
        "bytes": int(sum(d.nbytes for d in docs)),
        "tokens": int(sum(len(d.tokens) for d in docs)),
        "tokenizer_sha256": tokenizer.fingerprint() if hasattr(tokenizer, "fingerprint") else None,
    }
    if ident is not None:
        info["corpus_sha256"], info["python_version"] = ident["sha256"], ident["python_version"]
        info["same_corpus_as_baseline"], info["corpus_note"] = ident["same_as_manifest"], ident["note"]
    return docs, info
