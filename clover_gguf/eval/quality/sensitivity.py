"""`clover-gguf eval sensitivity`: which tensor group the quantization error comes from.

Every 2-D weight at a lossless base type (BF16, the 1-D tensors F32), then one group of
constants.TENSOR_GROUPS at a time quantized to ``qtype`` through convert's ``tensor_types``
override (``[(group regex, qtype)]``); each file is scored like ``eval quality`` (same
samples, same cached reference logits) and reported with the bytes the group takes before
and after.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from ...constants import TENSOR_GROUPS
from ...outputs import write_json
from .run import Generation, Sampling, run_quality

DEFAULT_GROUPS = ("experts_gate_up", "experts_down", "attention", "memory", "shared_expert", "embeddings", "output")
DEFAULT_QTYPE = "q4_k"


def group_bytes(gguf_info: dict, path, group: str) -> tuple[int, int]:
    """(bytes, n tensors) of a group's tensors in a GGUF."""
    from ...gguf_io.reader import open_gguf

    r = open_gguf(path)
    pat = re.compile(TENSOR_GROUPS[group])
    n, b = 0, 0
    for t in r.tensors:
        if pat.search(t.name):
            n += 1
            b += int(t.n_bytes)
    return b, n


def group_files(reference, work: Path, groups, qtype: str, base: str, imatrix, log=print) -> tuple[Path, list[Path]]:
    """The base GGUF (every weight at `base`) and one GGUF per group with that group at qtype,
    converted into work (or found there from an earlier run)."""
    from ..workfiles import converted

    for g in groups:
        if g not in TENSOR_GROUPS:
            raise ValueError(f"unknown tensor group {g!r}; known: {', '.join(TENSOR_GROUPS)}")
    files = []
    base_file = converted(reference, work / f"sens-base-{base}.gguf", log=log, outtype=base, experts=base)
    for g in groups:
        f = converted(
            reference,
            work / f"sens-{g}-{qtype}.gguf",
            log=log,
            outtype=base,
            experts=base,
            tensor_types=[(TENSOR_GROUPS[g], qtype)],
            imatrix=imatrix,
        )
        files.append(f)
    return base_file, files


def group_row(g: str, f: Path, m: dict, base_file: Path) -> dict:
    """One group's row: its bytes before and after, and what quantizing it costs (m: the
    quality run's model entry for its file)."""
    bq, n = group_bytes(m, f, g)
    bb, _ = group_bytes(m, base_file, g)
    r = m["providers"]["reference-dequant"]
    types = m["types"].get(g, {})
    saved = (bb - bq) / 1048576
    return {
        "group": g,
        "file": str(f),
        "n_tensors": n,
        "types": types,
        "group_bytes_base": bb,
        "group_bytes_q": bq,
        "file_bytes": m["bytes"],
        "overall": r["overall"],
        "by_ratio": r["by_ratio"],
        "by_history": r["by_history"],
        "kl_per_mib_saved": r["overall"]["kl_mean"] / saved if saved > 0 else None,
    }


def remove_work(files: list[Path], work: Path) -> None:
    """The converted files and their .source.json, and work itself when that leaves it empty."""
    for f in files:
        f.unlink(missing_ok=True)
        f.with_name(f.name + ".source.json").unlink(missing_ok=True)
    try:
        work.rmdir()
    except OSError:
        pass


def run_sensitivity(
    reference,
    out_dir,
    groups=DEFAULT_GROUPS,
    qtype: str = DEFAULT_QTYPE,
    base: str = "bf16",
    work_dir=None,
    keep: bool = False,
    log=print,
    sampling: Sampling | None = None,
    threads: int | None = None,
    imatrix=None,
) -> dict:
    """Convert one file per group, score them (run.Sampling, no generation), return the
    sensitivity run (also written to ``out_dir/sensitivity.json``). ``imatrix``: a GGUF
    imatrix weighting the group's quantization (the IQ2 types need one)."""
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(work_dir) if work_dir else out_dir / "gguf"
    work.mkdir(parents=True, exist_ok=True)
    base_file, files = group_files(reference, work, groups, qtype, base, imatrix, log)
    q = run_quality(
        reference,
        files,
        sampling,
        Generation(enabled=False),
        "reference",
        out_dir,
        threads=threads,
        names=list(groups),
        log=log,
    ).to_dict()
    (out_dir / "quality.json").unlink(missing_ok=True)  # the sensitivity run holds it
    rows = [group_row(g, f, m, base_file) for g, f, m in zip(groups, files, q["models"])]
    if not keep:
        remove_work(files + [base_file], work)
    run = {
        "schema": q["schema"],
        "kind": "sensitivity",
        "config": {
            **q["config"],
            "qtype": qtype,
            "base": base,
            "imatrix": str(imatrix) if imatrix else None,
            "groups": list(groups),
            "provider": "reference-dequant",
            "group_regex": {g: TENSOR_GROUPS[g] for g in groups},
        },
        "samples": q["samples"],
        "reference": q["reference"],
        "groups": rows,
        "notes": q["notes"],
        "seconds": time.perf_counter() - t0,
    }
    write_json(out_dir / "sensitivity.json", run)
    return run
