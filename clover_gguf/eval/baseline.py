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

Stages (``stage``): files, quality, sensitivity, speed, bundle, or all (in that order).
Each stage writes its JSON under the work dir, so stages can run as separate processes and
``bundle`` gathers what exists into ``run.json`` and renders the report.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

BASELINE_FILES = [
    ("BF16", dict(recipe="bf16")),
    ("Q8_0", dict(recipe="q8_0")),
    ("Q4_K-experts", dict(recipe="q4_k")),
    ("IQ4_XS-experts", dict(outtype="bf16", experts="iq4_xs")),
    ("Q4_0-experts", dict(outtype="bf16", experts="q4_0")),
    ("Q4_K_M", dict(recipe="q4_k_m")),
]
STAGES = ("files", "quality", "sensitivity", "speed", "bundle")


def make_files(reference, work_dir, files=BASELINE_FILES, log=print) -> list[tuple[str, Path, dict]]:
    from ..convert.converter import convert

    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    out = []
    for name, kw in files:
        p = work / f"clover-tiny-{name}.gguf"
        if not p.exists():
            log(f"convert {name}: {kw}")
            convert(reference, p, progress=False, log=lambda *a, **k: None, **kw)
        out.append((name, p, kw))
    return out


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
    """sampling/generation: quality.Sampling/Generation of the quality stage (the sensitivity
    stage takes the same sampling, with sens_kw's "n_windows", and its "qtype")."""
    from .backends import runtime_status
    from .quality import Generation, Sampling, run_quality
    from .report import render
    from .sensitivity import run_sensitivity
    from .speed import run_speed

    t0 = time.perf_counter()
    out, work = Path(out_dir), Path(work_dir)
    stages = STAGES if stage == "all" else (stage,)
    files = make_files(reference, work, log=log) if set(stages) & {"files", "quality", "speed"} else []
    names = [n for n, _, _ in files]
    paths = [p for _, p, _ in files]
    sampling, generation = sampling or Sampling(), generation or Generation()
    rt_ok = runtime_status()[0]
    if "quality" in stages:
        # both providers when the runtime is built; the generation agreement through the
        # runtime's own loop (as users run it), else the PyTorch loop on the dequantized weights
        q = run_quality(
            reference,
            paths,
            sampling,
            replace(generation, providers=("runtime",) if rt_ok else ("reference-dequant",)),
            "both" if rt_ok else "reference",
            work / "quality",
            threads=threads,
            runtime_threads=runtime_threads,
            names=names,
            log=log,
        ).to_dict()
        for m, (_, _, kw) in zip(q["models"], files):
            m["convert_options"] = kw
        (work / "quality.json").write_text(json.dumps(q, indent=1) + "\n")
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
        (work / "sensitivity.json").write_text(json.dumps(s, indent=1) + "\n")
    if "speed" in stages and speed:
        sp_paths, sp_names = paths, names
        if not rt_ok:
            # without the runtime a GGUF can only run as the PyTorch reference on dequantized
            # weights (the reference's speed): two rows are enough to show that
            keep = [i for i, n in enumerate(names) if n in ("BF16", "Q4_K-experts")]
            sp_paths, sp_names = [paths[i] for i in keep], [names[i] for i in keep]
        sp = run_speed(sp_paths, reference=reference, names=sp_names, log=log, **(speed_kw or {}))
        (work / "speed.json").write_text(json.dumps(sp, indent=1) + "\n")
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
    (out / "run.json").write_text(json.dumps(bundle, indent=1) + "\n")
    render(bundle, out, title=bundle["title"])
    return bundle
