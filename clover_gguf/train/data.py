"""clover-tiny's corpus: the Python standard library shipped with the interpreter.

Corpus = every ``*.py`` file under ``sysconfig.get_paths()['stdlib']``, except test code
(any path component ``test``, ``tests`` or ``idle_test`` -- this covers ``test/``,
``idlelib/idle_test``, ``lib2to3/tests``, ``ctypes/test``, ``unittest/test``, ...),
``site-packages`` and files larger than 1 MB. Files are ordered by their relative POSIX
path.

Held-out set: whole top-level modules/packages, about 5 % of the corpus bytes, named in
``evaldata/heldout-stdlib.json``. Training -- the tokenizer and the model -- never sees them.
The set is defined by module, not by bytes: on any Python the held-out files are the
installed stdlib's files of those modules, and the rest is the training corpus. The manifest
also records the files, byte counts and sha256 they had on the Python clover-tiny was trained
with (3.11.7); :func:`corpus_identity` says whether this interpreter's held-out text is that
same text ("same corpus as the baseline") or not ("figures not comparable").
:func:`select_heldout_units` is the deterministic rule that chose the modules
(``python scripts/train_tokenizer.py --write-manifest`` rewrites the manifest).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import io
import json
import math
import os
import re
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..errors import CloverError
from ..util import EVALDATA

HELDOUT_MANIFEST = EVALDATA / "heldout-stdlib.json"

MAX_FILE_BYTES = 1_000_000
EXCLUDED_DIR_NAMES = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})

# Held-out selection rule (see select_heldout_units).
HELDOUT_TARGET_FRACTION = 0.05
HELDOUT_TOLERANCE = 0.0025  # accept a selection within 5 % +- 0.25 %
HELDOUT_MAX_UNIT_FRACTION = 0.01  # no single unit above 1 % of the corpus (keeps it a mix)
HELDOUT_SALT = "clover-heldout-v1"
# Mostly data, not code: never held out (they stay in training).
HELDOUT_NEVER = frozenset({"encodings", "pydoc_data", "idlelib", "turtledemo", "this"})


class CorpusError(CloverError, RuntimeError):
    pass


# --- files -----------------------------------------------------------------------------


def stdlib_root() -> Path:
    """The standard library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def python_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))


def rel(path: Path, root: Path | None = None) -> str:
    """Relative POSIX path of a corpus file (its name in the manifest)."""
    p, root = Path(path), root or stdlib_root()
    try:
        return p.relative_to(root).as_posix()
    except ValueError:  # a relative or non-canonical spelling of a path under root
        return p.resolve().relative_to(root).as_posix()


def unit_of(relpath: str) -> str:
    """Top-level module/package a relative path belongs to ("email/mime/text.py" -> "email",
    "difflib.py" -> "difflib")."""
    first, _, rest = relpath.partition("/")
    return first if rest else first.removesuffix(".py")


def corpus_files(root: Path | None = None) -> list[Path]:
    """All corpus files (train + held-out), sorted by relative path."""
    root = Path(root) if root else stdlib_root()
    if not root.is_dir():
        raise CorpusError(f"stdlib directory not found: {root}")
    return list(_corpus_files(str(root)))


@functools.lru_cache(maxsize=4)
def _corpus_files(root: str) -> tuple[Path, ...]:
    out = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in EXCLUDED_DIR_NAMES]
        for n in names:
            if not n.endswith(".py"):
                continue
            p = Path(d, n)
            # links point outside the stdlib (Debian: sitecustomize.py -> /etc/python3.11/)
            if p.is_file() and not p.is_symlink() and p.stat().st_size <= MAX_FILE_BYTES:
                out.append((p.relative_to(root).as_posix(), p))
    out.sort(key=lambda t: t[0])
    return tuple(p for _, p in out)


def select_heldout_units(sizes: dict[str, int]) -> list[str]:
    """The deterministic rule behind the manifest.

    ``sizes``: relative path -> bytes for the whole corpus. Units (top-level modules and
    packages) that are at most 1 % of the corpus and not data-like (HELDOUT_NEVER) are taken
    in the order of sha256(salt + name); a unit is added unless it would push the total past
    5.25 %, and the walk stops at >= 4.75 %.
    """
    total = sum(sizes.values())
    units: dict[str, int] = {}
    for r, n in sizes.items():
        units[unit_of(r)] = units.get(unit_of(r), 0) + n
    cands = [u for u, n in units.items() if u not in HELDOUT_NEVER and n <= HELDOUT_MAX_UNIT_FRACTION * total]
    cands.sort(key=lambda u: hashlib.sha256(f"{HELDOUT_SALT}:{u}".encode()).hexdigest())
    lo = (HELDOUT_TARGET_FRACTION - HELDOUT_TOLERANCE) * total
    hi = (HELDOUT_TARGET_FRACTION + HELDOUT_TOLERANCE) * total
    chosen, acc = [], 0
    for u in cands:
        if acc >= lo:
            break
        if acc + units[u] <= hi:
            chosen.append(u)
            acc += units[u]
    return sorted(chosen)


def build_heldout_manifest(root: Path | None = None) -> dict:
    root = Path(root) if root else stdlib_root()
    files = corpus_files(root)
    sizes = {rel(p, root): p.stat().st_size for p in files}
    units = select_heldout_units(sizes)
    held = {r: n for r, n in sizes.items() if unit_of(r) in units}
    total = sum(sizes.values())
    held_bytes = sum(held.values())
    return {
        "description": "clover-tiny held-out stdlib modules: never used to train the tokenizer "
        "or the model. Paths are relative to sysconfig.get_paths()['stdlib'].",
        "python_version": python_version(),
        "rule": {
            "salt": HELDOUT_SALT,
            "target_fraction": HELDOUT_TARGET_FRACTION,
            "tolerance": HELDOUT_TOLERANCE,
            "max_unit_fraction": HELDOUT_MAX_UNIT_FRACTION,
            "never": sorted(HELDOUT_NEVER),
            "corpus": "*.py under stdlib, excluding dirs "
            + ", ".join(sorted(EXCLUDED_DIR_NAMES))
            + f" and files > {MAX_FILE_BYTES} bytes",
        },
        "modules": units,
        "files": [{"path": r, "bytes": n} for r, n in sorted(held.items())],
        "sha256": files_sha256([root / r for r in sorted(held)], root),
        "heldout_bytes": held_bytes,
        "corpus_bytes": total,
        "corpus_files": len(sizes),
        "fraction": round(held_bytes / total, 6),
    }


def write_heldout_manifest(path: Path = HELDOUT_MANIFEST, root: Path | None = None) -> dict:
    m = build_heldout_manifest(root)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(m, indent=1) + "\n")
    return m


def load_heldout_manifest(path: Path = HELDOUT_MANIFEST) -> dict:
    """The committed manifest: the held-out modules, and their files as the Python it was made
    with had them."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(
            f"held-out manifest not found: {path} (python scripts/train_tokenizer.py --write-manifest creates it)"
        )
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CorpusError(f"{path}: not a held-out manifest ({e})") from None
    if not isinstance(m, dict) or not isinstance(m.get("modules"), list):
        raise CorpusError(f"{path}: not a held-out manifest (no 'modules' list)")
    return m


def files_sha256(files: Sequence[Path], root: Path | None = None) -> str:
    """sha256 over the files' relative paths and contents, in order: the identity of a text corpus."""
    root = Path(root) if root else stdlib_root()
    h = hashlib.sha256()
    for p in files:
        b = Path(p).read_bytes()
        h.update(f"{rel(p, root)}\0{len(b)}\0".encode())
        h.update(b)
    return h.hexdigest()


def heldout_files(manifest: Path = HELDOUT_MANIFEST, root: Path | None = None) -> list[Path]:
    """This stdlib's files of the held-out modules, sorted by relative path."""
    root = Path(root) if root else stdlib_root()
    units = set(load_heldout_manifest(manifest)["modules"])
    files = [p for p in corpus_files(root) if unit_of(rel(p, root)) in units]
    if not files:
        raise CorpusError(f"this Python's stdlib ({root}) has no file of the held-out modules of {manifest}")
    return files


def train_files(manifest: Path = HELDOUT_MANIFEST, root: Path | None = None) -> list[Path]:
    """Corpus files minus every file of a held-out module, sorted by relative path."""
    root = Path(root) if root else stdlib_root()
    units = set(load_heldout_manifest(manifest)["modules"])
    return [p for p in corpus_files(root) if unit_of(rel(p, root)) not in units]


def corpus_identity(manifest: Path = HELDOUT_MANIFEST, root: Path | None = None) -> dict:
    """Whether this interpreter's held-out text is the committed one: {sha256, python_version,
    same_as_manifest, note}. The note is the sentence reports print."""
    root = Path(root) if root else stdlib_root()
    m = load_heldout_manifest(manifest)
    files = heldout_files(manifest, root)
    sha = files_sha256(files, root)
    same = sha == m.get("sha256")
    made = m.get("python_version", "?")
    if same:
        note = f"same held-out corpus as the committed baseline (Python {made}'s stdlib, sha256 {sha[:12]})"
    else:
        listed = {f["path"]: f["bytes"] for f in m.get("files", [])}
        here = {rel(p, root): p.stat().st_size for p in files}
        differ = sum(1 for r in listed.keys() | here.keys() if listed.get(r) != here.get(r))
        note = (
            f"different held-out corpus from the committed baseline's: Python {python_version()}'s stdlib here, "
            f"{made}'s there ({differ} of {len(listed.keys() | here.keys())} files differ in name or size; "
            f"sha256 {sha[:12]} vs {str(m.get('sha256'))[:12]}): figures are not comparable with the baseline's"
        )
    return {"sha256": sha, "python_version": python_version(), "same_as_manifest": same, "note": note}


def read_corpus(files: Sequence[Path]) -> list[str]:
    """One string per file (UTF-8; the 3.11 stdlib is all UTF-8)."""
    out = []
    for p in files:
        try:
            out.append(Path(p).read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            raise CorpusError(f"corpus file missing: {p}") from e
    return out


# --- docstrings ------------------------------------------------------------------------

_OPENER = re.compile(r"[rRuU]?(\"\"\"|\'\'\')")
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)  # what ast.get_docstring takes


def summary_docstrings(text: str) -> tuple[str, int]:
    """`text` with every docstring longer than its first paragraph cut to that paragraph
    (PEP 257's summary), and the number cut. The source lines of the paragraph are kept as
    they are and the docstring's own quotes close it. Used on the training text only: the
    stdlib's long docstrings taught the model to open a docstring after a signature and not
    close it within 64 tokens. A docstring whose summary ends in a backslash or a quote stays
    whole; text that does not parse, before or after the cuts, comes back unchanged."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return text, 0
    lines = io.StringIO(text, newline="").readlines()  # split where ast counts lines (not at \f)
    cuts = []
    for node in ast.walk(tree):
        if not isinstance(node, _DOCUMENTED) or ast.get_docstring(node, clean=False) is None:
            continue
        s = node.body[0]
        first, last = s.lineno - 1, s.end_lineno - 1
        head = lines[first].encode()
        lead, lit = head[: s.col_offset].decode(), head[s.col_offset :].decode()
        m = _OPENER.match(lit)
        if first == last or lead.strip() or not m:
            continue
        i = first + 1
        if not lit[m.end() :].strip():  # the summary starts on a later line
            while i < last and not lines[i].strip():
                i += 1
            i += 1
        while i < last and lines[i].strip():
            i += 1
        if i >= last:  # the first paragraph reaches the closing quotes: nothing to cut
            continue
        body = "".join(lines[first:i]).rstrip("\n")
        if body.endswith(("\\", m.group(1)[0])):
            continue
        tail = lines[last].encode()[s.end_col_offset :].decode()
        cuts.append((first, last, body + m.group(1) + tail))
    if not cuts:
        return text, 0
    for first, last, new in sorted(cuts, reverse=True):
        lines[first : last + 1] = [new]
    out = "".join(lines)
    try:
        ast.parse(out)
    except (SyntaxError, ValueError):
        return text, 0
    return out, len(cuts)


# --- token streams ---------------------------------------------------------------------


def _stream_key(tokenizer, files: Sequence[Path]) -> str:
    h = hashlib.sha256()
    h.update(tokenizer.fingerprint().encode())
    for p in files:
        p = Path(p)
        h.update(f"{p}\0{p.stat().st_size}\n".encode())
    return h.hexdigest()[:16]


def encode_files(
    tokenizer, files: Sequence[Path], cache_dir: Path | None = None, name: str = "corpus", transform=None
) -> np.ndarray:
    """Token stream of ``files`` as int32: each file encoded on its own (after ``transform``,
    text -> text, if given), ``<|endoftext|>`` (tokenizer.eos_id) between consecutive files.
    With ``cache_dir`` the array is cached as ``{cache_dir}/{name}-{key}.npy``, key =
    hash(tokenizer.json, paths, sizes); ``name`` must tell transforms apart."""
    path = None
    if cache_dir is not None:
        cache_dir = Path(cache_dir)
        path = cache_dir / f"{name}-{_stream_key(tokenizer, files)}.npy"
        if path.is_file():
            return np.load(path)
    texts = read_corpus(files)
    if transform is not None:
        texts = [transform(t) for t in texts]
    parts: list[np.ndarray] = []
    sep = np.array([tokenizer.eos_id], dtype=np.int32)
    for i, ids in enumerate(tokenizer.encode_batch(texts)):
        if i:
            parts.append(sep)
        parts.append(np.asarray(ids, dtype=np.int32))
    arr = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    if path is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}.npy")
        np.save(tmp, arr)
        os.replace(tmp, path)
    return arr


DOCSTRINGS = ("full", "summary")


def train_tokens(tokenizer, cache_dir: Path | None = None, docstrings: str = "full") -> np.ndarray:
    """The train split's stream; ``docstrings="summary"``: with summary_docstrings applied."""
    if docstrings == "full":
        return encode_files(tokenizer, train_files(), cache_dir, "train")
    if docstrings != "summary":
        raise ValueError(f"docstrings: {docstrings!r}, expected one of {DOCSTRINGS}")
    return encode_files(tokenizer, train_files(), cache_dir, "train-summary", lambda t: summary_docstrings(t)[0])


def heldout_tokens(tokenizer, cache_dir: Path | None = None) -> np.ndarray:
    return encode_files(tokenizer, heldout_files(), cache_dir, "heldout")


# --- baselines -------------------------------------------------------------------------


def unigram_log2p(ids, vocab_size: int) -> np.ndarray:
    """log2 of the add-one unigram of `ids` over the vocabulary, [V]:
    p(w) = (c(w) + 1) / (N + V)."""
    c = np.bincount(np.asarray(ids, dtype=np.int64).ravel(), minlength=vocab_size).astype(np.float64)
    return np.log2((c + 1.0) / (c.sum() + vocab_size))


def unigram_entropy_bits(train_ids, heldout_ids, vocab_size: int | None = None) -> dict:
    """Unigram baselines in bits/token.

    ``cross_entropy``: held-out tokens scored under the train-set unigram distribution with
    add-one smoothing over the vocabulary, p(w) = (c_train(w) + 1) / (N_train + V) -- the
    loss a model that ignores context would get on held-out text; ``heldout_entropy``: the
    empirical entropy of the held-out tokens themselves (a lower bound for unigram models);
    ``train_entropy``: the same for the train tokens. V = vocab_size, or max id + 1.
    """
    tr = np.asarray(train_ids, dtype=np.int64).ravel()
    ho = np.asarray(heldout_ids, dtype=np.int64).ravel()
    V = vocab_size or int(max(tr.max(initial=-1), ho.max(initial=-1)) + 1)
    ct = np.bincount(tr, minlength=V).astype(np.float64)
    ch = np.bincount(ho, minlength=V).astype(np.float64)
    cross = float(-(ch * unigram_log2p(tr, V)).sum() / max(ch.sum(), 1))

    def ent(c):
        p = c[c > 0] / c.sum()
        return float(-(p * np.log2(p)).sum())

    return {
        "cross_entropy": cross,
        "heldout_entropy": ent(ch),
        "train_entropy": ent(ct),
        "vocab_size": V,
        "n_train": int(tr.size),
        "n_heldout": int(ho.size),
        "nats_cross_entropy": cross * math.log(2),
    }
