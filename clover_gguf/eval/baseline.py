"""The committed clover-tiny baseline: convert the standard set of GGUFs, run quality,
sensitivity and speed on them, write one bundle JSON + Markdown + plots.

Files (convert options):
  BF16              recipe bf16 (every 2-D weight BF16)
  Q8_0              recipe q8_0 (every 2-D weight Q8_0)
  Q4_K-experts      experts Q4_K, the rest BF16 (recipe q4_k)
  IQ4_XS-experts    experts IQ4_XS (no imatrix), the rest BF16
  Q4_0-experts      experts Q4_0, the rest BF16
  Q4_K_M            recipe q4_k_m: experts Q4_K with ffn_down_exps Q5_K, attention/shared/
                    embeddings Q8_0, output Q6_K
  Q3_K-/IQ3_S-/IQ2_M-experts  experts Q3_K / IQ3_S / IQ2_S, the rest BF16, with an imatrix;
                    added to the bundle with ``add_rows`` (``eval baseline --add``)

Stages (``stage``): files, quality, sensitivity, speed, bundle, or all (in that order).
Each stage writes its JSON under the work dir, so stages can run as separate processes and
``bundle`` gathers what exists into ``run.json`` and renders the report.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from ..outputs import write_json

BASELINE_FILES = [
    ("BF16", dict(recipe="bf16")),
    ("Q8_0", dict(recipe="q8_0")),
    ("Q4_K-experts", dict(recipe="q4_k")),
    ("IQ4_XS-experts", dict(outtype="bf16", experts="iq4_xs")),
    ("Q4_0-experts", dict(outtype="bf16", experts="q4_0")),
    ("Q4_K_M", dict(recipe="q4_k_m")),
]
STAGES = ("files", "quality", "sensitivity", "speed", "bundle")

# low-bit expert types (the plan's fit candidates): they need an imatrix (IQ2_S) or gain from
# one (Q3_K, IQ3_S); added to an existing baseline with --stage add (only their rows run)
LOWBIT_FILES = [
    ("Q3_K-experts", dict(outtype="bf16", experts="q3_k")),
    ("IQ3_S-experts", dict(outtype="bf16", experts="iq3_s")),
    ("IQ2_M-experts", dict(outtype="bf16", experts="iq2_s")),
]
FILE_SETS = {n: kw for n, kw in BASELINE_FILES + LOWBIT_FILES}


def make_files(reference, work_dir, files=BASELINE_FILES, log=print, imatrix=None) -> list[tuple[str, Path, dict]]:
    """Convert the files (an imatrix, when given, goes to every one), reusing those in the work
    folder made from the same weights and options. The returned options name the imatrix, so
    the report says how each file was made."""
    from .workfiles import converted

    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    out = []
    for name, kw in files:
        if imatrix:
            kw = {**kw, "imatrix": str(imatrix)}
        out.append((name, converted(reference, work / f"clover-tiny-{name}.gguf", log=log, **kw), kw))
    return out


def _score(reference, files, sampling, generation, work: Path, threads, runtime_threads, log) -> dict:
    """The quality section for these files: both providers when the runtime is built, the
    generation agreement through the runtime's own loop (as users run it), else the PyTorch loop
    on the dequantized weights; each model row keeps its convert options."""
    from .quality.backends import runtime_status
    from .quality.run import run_quality

    rt_ok = runtime_status()[0]
    q = run_quality(
        reference,
        [p for _, p, _ in files],
        sampling,
        replace(generation, providers=("runtime",) if rt_ok else ("reference-dequant",)),
        "both" if rt_ok else "reference",
        work,
        threads=threads,
        runtime_threads=runtime_threads,
        names=[n for n, _, _ in files],
        log=log,
    ).to_dict()
    for m, (_, _, kw) in zip(q["models"], files):
        m["convert_options"] = kw
    return q


def add_rows(
    reference,
    out_dir,
    work_dir,
    names: list[str],
    imatrix=None,
    sampling=None,
    generation=None,
    threads: int | None = None,
    runtime_threads: int | None = None,
    log=print,
) -> dict:
    """Add (or redo) the quality rows of these files in the committed bundle (out_dir/run.json)
    and render it again: the other rows, the sensitivity and the speed sections stay as they
    were. The sample must be the bundle's own (same windows, blocks, seed, prompts), so the new
    rows compare with the old ones."""
    from .quality.run import Generation, Sampling
    from .render.report import render

    out, work = Path(out_dir), Path(work_dir)
    run_file = out / "run.json"
    if not run_file.is_file():
        raise FileNotFoundError(f"{run_file}: no baseline to add rows to (run the whole baseline first)")
    unknown = [n for n in names if n not in FILE_SETS]
    if unknown or not names:
        raise ValueError(f"--add {', '.join(unknown) or '(none)'}: known files are {', '.join(FILE_SETS)}")
    bundle = json.loads(run_file.read_text())
    q_old = bundle["sections"]["quality"]
    sampling, generation = sampling or Sampling(), generation or Generation()
    old, old_gen = q_old["config"], q_old["config"]["generation"]
    want = {
        "n_windows": (old["n_windows"], sampling.n_windows),
        "n_blocks": (old["n_blocks"], sampling.n_blocks),
        "seed": (old["seed"], sampling.seed),
        "n_prompts": (old_gen["n_prompts"], generation.n_prompts or old_gen["n_prompts"]),
        "max_new_tokens": (old_gen["max_new_tokens"], generation.max_new_tokens),
    }
    bad = [f"{k} {new} (the baseline's: {was})" for k, (was, new) in want.items() if was != new]
    if bad:
        raise ValueError(f"--stage add: a different sample than the baseline's: {'; '.join(bad)}")
    files = make_files(reference, work, [(n, FILE_SETS[n]) for n in names], log=log, imatrix=imatrix)
    q = _score(
        reference,
        files,
        sampling,
        replace(generation, n_prompts=old_gen["n_prompts"]),
        work / "quality-add",
        threads,
        runtime_threads,
        log,
    )
    if q["samples"]["fingerprint"] != q_old["samples"]["fingerprint"]:
        raise ValueError("--stage add: the held-out sample differs from the baseline's (another corpus or tokenizer)")
    keep = [m for m in q_old["models"] if m["name"] not in names]
    q_old["models"] = keep + q["models"]
    q_old["config"]["ggufs"] = [g for g in old["ggufs"] if Path(g).stem.removeprefix("clover-tiny-") not in names]
    q_old["config"]["ggufs"] += [str(p) for _, p, _ in files]
    q_old.setdefault("added", []).append(
        {"names": names, "environment": q["config"]["environment"], "seconds": q.get("seconds")}
    )
    out.mkdir(parents=True, exist_ok=True)
    write_json(run_file, bundle)
    render(bundle, out, title=bundle["title"])
    return bundle


def run_baseline(
    reference,
    out_dir,
    work_dir,
    speed: bool = True,
    sensitivity: bool = True,
    sampling=None,
    generation=None,
    threads: int | None = None,
    runtime_threads: int | None = None,
    speed_kw: dict | None = None,
    sens_kw: dict | None = None,
    stage: str = "all",
    summary: str | None = None,
    log=print,
) -> dict | None:
    """sampling/generation: quality.run.Sampling/Generation of the quality stage (the sensitivity
    stage takes the same sampling, with sens_kw's "n_windows", and its "qtype")."""
    from .bench.speed import run_speed
    from .quality.backends import runtime_status
    from .quality.run import Generation, Sampling
    from .quality.sensitivity import run_sensitivity
    from .render.report import render

    t0 = time.perf_counter()
    out, work = Path(out_dir), Path(work_dir)
    stages = STAGES if stage == "all" else (stage,)
    files = make_files(reference, work, log=log) if set(stages) & {"files", "quality", "speed"} else []
    names = [n for n, _, _ in files]
    paths = [p for _, p, _ in files]
    sampling, generation = sampling or Sampling(), generation or Generation()
    rt_ok = runtime_status()[0]
    if "quality" in stages:
        q = _score(reference, files, sampling, generation, work / "quality", threads, runtime_threads, log)
        write_json(work / "quality.json", q)
    if "sensitivity" in stages and sensitivity:
        skw = dict(sens_kw or {})
        s = run_sensitivity(
            reference,
            work / "sensitivity",
            log=log,
            work_dir=work / "sens",
            sampling=replace(sampling, n_windows=skw.pop("n_windows", sampling.n_windows)),
            threads=threads,
            **skw,
        )
        write_json(work / "sensitivity.json", s)
    if "speed" in stages and speed:
        sp_paths, sp_names = paths, names
        if not rt_ok:
            # without the runtime a GGUF can only run as the PyTorch reference on dequantized
            # weights (the reference's speed): two rows are enough to show that
            keep = [i for i, n in enumerate(names) if n in ("BF16", "Q4_K-experts")]
            sp_paths, sp_names = [paths[i] for i in keep], [names[i] for i in keep]
        sp = run_speed(sp_paths, reference=reference, names=sp_names, log=log, **(speed_kw or {}))
        write_json(work / "speed.json", sp)
    if "bundle" not in stages:
        return None
    secs = {}
    for k in ("quality", "sensitivity", "speed"):
        f = work / f"{k}.json"
        if f.is_file():
            secs[k] = json.loads(f.read_text())
    if not secs:
        raise FileNotFoundError(
            f"{work}: no quality.json, sensitivity.json or speed.json to bundle (run the stages first)"
        )
    bundle = {
        "schema": "clover-gguf-eval/1",
        "kind": "bundle",
        "title": "clover-tiny quantization baseline",
        "sections": secs,
        "seconds": time.perf_counter() - t0,
    }
    if summary:
        bundle["summary"] = summary
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "run.json", bundle)
    render(bundle, out, title=bundle["title"])
    return bundle
