"""Converted files kept in an eval work folder between runs. A file is reused only when it was
made from the same reference weights with the same options: retrained weights or a new imatrix
must not be scored through a stale quantization."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from ..outputs import write_json


def _fingerprint(path: Path) -> list:
    """(name, size, mtime_ns) of a file, or of every file in a model folder (weights, config,
    tokenizer: all go into the GGUF)."""
    path = Path(path)
    files = sorted(f for f in path.iterdir() if f.is_file()) if path.is_dir() else [path]
    return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


@functools.cache
def _converter_hash() -> str:
    """The converter's own source: a fix to it must not leave files made by the old one."""
    h = hashlib.sha256()
    for f in sorted((Path(__file__).resolve().parents[1] / "convert").glob("*.py")):
        h.update(f.read_bytes())
    return h.hexdigest()


def source_stamp(reference, options: dict) -> dict:
    opts = {k: str(v) for k, v in sorted(options.items())}
    stamp = {"reference": _fingerprint(reference), "options": opts, "converter": _converter_hash()}
    if options.get("imatrix"):
        stamp["imatrix"] = _fingerprint(options["imatrix"])
    return stamp


def converted(reference, path, log=print, **options) -> Path:
    """`path` converted from `reference` with `options` (convert's keywords), reusing the file
    there when its stamp (path + '.source.json') names the same weights and options."""
    from ..convert.converter import convert

    path = Path(path)
    stamp_path = path.with_name(path.name + ".source.json")
    stamp = source_stamp(reference, options)
    if path.exists() and stamp_path.exists():
        try:
            if json.loads(stamp_path.read_text()) == stamp:
                return path
        except ValueError:
            pass
    log(f"convert {path.name}: {options}")
    stamp_path.unlink(missing_ok=True)
    convert(reference, path, force=True, progress=False, **options)
    write_json(stamp_path, stamp)
    return path
