"""Measure this machine's CPU terms of the cost model and check the model against it.

Each measurement is one forward pass of the runtime, timed alone: a commit of a B-token block,
and a denoising step with n rows masked (lm_head over n rows), as eval/bench/passes.py times them;
the median of a few repeats. `calibrate` fits c0, c_layer, BW and R (cost.CpuCalibration) by
non-negative least squares on relative error; `validate` prints predicted vs measured step,
commit and block times on other files."""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from ..convert.recipes import TypeRules
from ..convert.tensor_plan import build_plan
from ..inputs import InputError, regular_file
from ..outputs import check_replaceable, write_json
from . import cost
from .kernels import KernelTable
from .sizes import PlanError


def gguf_plan(path: Path):
    """(config, converter plan with the GGUF's own tensor types)."""
    from ..convert.tensor_plan import Plan, PlanEntry
    from ..gguf_io.reader import config_from_reader, open_gguf
    from ..synthetic import SyntheticSource

    r = open_gguf(path)
    cfg = config_from_reader(r, path)
    base = build_plan(SyntheticSource(cfg, path.parent), TypeRules.make("f32", "f32"))
    types = {t.name: t.tensor_type for t in r.tensors}
    nbytes = {t.name: int(t.n_bytes) for t in r.tensors}
    entries = []
    for e in base.entries:
        entries.append(
            PlanEntry(e.name, e.shape, types[e.name], types[e.name], "gguf", None, e.group, [], None, 0, nbytes[e.name])
        )
    return cfg, Plan(cfg, "gguf", base.rules, entries, path.parent)


def measure(path: Path, threads: int, masked=(None,), repeats: int = 3, prompt_len: int = 64) -> dict:
    """Median ms of a commit and of a step with n masked rows (None: the whole block)."""
    from ..runtime.runtime import CloverRuntime

    rt = CloverRuntime(str(path), n_threads=threads)
    try:
        B = rt.default_block_size
        rng = random.Random(0)
        ids = [rng.randrange(2, rt.n_vocab) for _ in range(prompt_len + B)]
        ids = [i if i != rt.mask_token_id else 2 for i in ids]
        prompt, block = ids[:prompt_len], ids[prompt_len:]
        rt.reset()
        rt.commit(prompt, B)
        out = {"block_size": B, "commit_ms": [], "step_ms": {}}
        for r in range(repeats + 1):  # the first round warms up
            t0 = time.perf_counter()
            rt.commit(block, B)
            t_c = (time.perf_counter() - t0) * 1e3
            if r:
                out["commit_ms"].append(t_c)
            for n in masked:
                n = B if n is None else n
                blk = list(block)
                for i in rng.sample(range(B), n):
                    blk[i] = rt.mask_token_id
                t0 = time.perf_counter()
                rt.block_candidates(blk, 0.0, r * 1000 + n)
                if r:
                    out["step_ms"].setdefault(n, []).append((time.perf_counter() - t0) * 1e3)
        out["commit_ms"] = statistics.median(out["commit_ms"])
        out["step_ms"] = {n: statistics.median(v) for n, v in out["step_ms"].items()}
        return out
    finally:
        rt.close()


def _rows(path: Path, m: dict):
    """(features [1, L, MB, M MACs dense, M MACs experts], measured ms, label) per measurement."""
    cfg, plan = gguf_plan(path)
    B = m["block_size"]
    out = []
    items = [("commit", 0, m["commit_ms"])] + [(f"step n={n}", n, t) for n, t in m["step_ms"].items()]
    for label, n, t in items:
        w = cost.forward_work(cfg, plan, B, n, commit=label == "commit")
        w.file = path.name  # for the saved points
        lv, lt = cost.lm_features(w)
        out.append(([1.0, w.n_layers, w.bytes_ / 1e6, w.macs / 1e6, w.exp_macs / 1e6, lv / 1e6, lt / 1e6], t, label, w))
    return out


def _nnls(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares by trying every subset of free terms (7 terms: 127 solves)."""
    import itertools

    n = A.shape[1]
    best, best_r = np.zeros(n), float(np.sum(b**2))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            x, *_ = np.linalg.lstsq(A[:, cols], b, rcond=None)
            if np.all(x >= 0):
                r = float(np.sum((A[:, cols] @ x - b) ** 2))
                if r < best_r:
                    best, best_r = np.zeros(n), r
                    best[list(cols)] = x
    return best


def fit_calibration(rows, threads: int, source: str) -> cost.CpuCalibration:
    """Non-negative least squares on relative error: ms = c0 + cL*L + MB/BW + Mmac/R + Mmac_e/R_e
    + lm_head terms (MB per ms is GB/s, M MACs per ms is GMAC/s)."""
    X = np.array([r[0] for r in rows])
    y = np.array([r[1] for r in rows])
    Xw, yw = X / y[:, None], y / y  # relative error weights every measurement alike
    c0, cl, inv_bw, inv_r, inv_re, inv_lv, inv_lt = _nnls(Xw, yw)
    return cost.CpuCalibration(
        c0_ms=float(c0),
        c_layer_ms=float(cl),
        bw_gbs=float(1.0 / inv_bw) if inv_bw > 0 else 1e9,
        gmacs=float(1.0 / inv_r) if inv_r > 0 else 1e9,
        gmacs_experts=float(1.0 / inv_re) if inv_re > 0 else 1e9,
        gmacs_lm_vec=float(1.0 / inv_lv) if inv_lv > 0 else 1e9,
        gmacs_lm_tile=float(1.0 / inv_lt) if inv_lt > 0 else 1e9,
        threads=threads,
        source=source,
        loadavg=tuple(round(x, 2) for x in os.getloadavg()),
    )


def calibrate(files, threads: int, out: Path, repeats: int = 5, log=print) -> cost.CpuCalibration:
    rows = []
    for f in files:
        f = Path(f)
        try:
            regular_file(f)
        except InputError as e:
            raise PlanError(f"--calibrate {e}") from None
        log(f"measure {f} ({threads} threads)")
        m = measure(f, threads, masked=(None, 16, 8, 4, 2, 1), repeats=repeats)
        rows += _rows(f, m)
    cal = fit_calibration(rows, threads, f"measured on {len(files)} file(s): {', '.join(Path(f).name for f in files)}")
    cal.save(out)
    # the raw points beside it, to refit without measuring again
    pts = [{"file": w.file, "what": lb, "features": x, "ms": t} for x, t, lb, w in rows]
    write_json(out.with_suffix(".points.json"), pts)
    for x, t, label, _ in rows:
        p = cal.ms(int(x[1]), x[2] * 1e6, x[3] * 1e6, x[4] * 1e6, (x[5] * 1e6, x[6] * 1e6))
        log(f"  fit: {label:<12} measured {t:9.2f} ms  model {p:9.2f} ms  ({100 * (p - t) / t:+.0f} %)")
    return cal


def validate(files, threads: int, cal: cost.CpuCalibration, repeats: int = 5, log=print) -> list[dict]:
    """Predicted vs measured: first step (all rows masked), a step with 4 masked, the commit,
    and the block at 4 and 8 tokens per step built from them."""
    table = []
    for f in files:
        f = Path(f)
        cfg, plan = gguf_plan(f)
        B = cfg.block_size
        masked = sorted({B, *range(B, 0, -4), *range(B, 0, -8)}, reverse=True)
        m = measure(f, threads, masked=tuple(masked), repeats=repeats)

        def pred(n, cfg=cfg, plan=plan, B=B, commit=False):
            return cost.cpu_ms(cost.forward_work(cfg, plan, B, n, commit=commit), cal)

        def row(what, p, t, name=f.name):
            table.append({"file": name, "what": what, "pred_ms": p, "meas_ms": t, "err": (p - t) / t})

        row(f"step n={B}", pred(B), m["step_ms"][B])
        row("step n=4", pred(4), m["step_ms"][4])
        row("commit", pred(0, commit=True), m["commit_ms"])
        for tps in (4, 8):
            ns = list(range(B, 0, -tps))
            row(
                f"block@{tps}tok/step",
                sum(pred(n) for n in ns) + pred(0, commit=True),
                sum(m["step_ms"][n] for n in ns) + m["commit_ms"],
            )
    return table


def format_table(table: list[dict]) -> str:
    lines = [f"{'file':<28} {'what':<18} {'predicted ms':>12} {'measured ms':>12} {'error':>7}"]
    for r in table:
        lines.append(
            f"{r['file']:<28} {r['what']:<18} {r['pred_ms']:12.2f} {r['meas_ms']:12.2f} {100 * r['err']:+6.1f}%"
        )
    errs = [abs(r["err"]) for r in table]
    lines.append(f"max |error| {100 * max(errs):.1f} %, mean |error| {100 * sum(errs) / len(errs):.1f} %")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the CLI's calls


def _is_device_summary(p) -> bool:
    try:
        d = json.loads(Path(p).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and ("kernels" in d or "stages" in d)


def load_calibrations(paths) -> tuple[cost.CpuCalibration, KernelTable]:
    """--calibration files: a CPU calibration (--calibrate) and/or a device check summary.json
    (its "kernels"); the cache's CPU calibration and the seeded kernel table otherwise."""
    cpu, kern = None, None
    for p in paths:
        try:
            regular_file(p)
        except InputError as e:  # missing, or a FIFO/device (reading one blocks or never ends)
            raise PlanError(f"--calibration {e}") from None
        if _is_device_summary(p):
            kern = KernelTable.load(Path(p))
        else:
            cpu = cost.CpuCalibration.load(Path(p))
    return cpu or cost.CpuCalibration.load(), kern or KernelTable()


def command(calibrate_files, validate_files, calibrations, threads, as_json: bool, log=None) -> str:
    """plan --calibrate / --validate: measure, fit and write; or print the error table."""
    from ..util import default_threads

    log = log or (lambda m: print(m, file=sys.stderr))
    mine = [Path(p) for p in calibrations if not _is_device_summary(p)]  # never write over a summary.json
    if calibrations and not mine:
        raise PlanError("--calibrate writes a CPU calibration: give it its own --calibration FILE")
    out = mine[0] if mine else cost.default_calibration_path()
    if calibrate_files:  # before measuring: never a link, FIFO, device or folder
        out.parent.mkdir(parents=True, exist_ok=True)
        for p in (out, out.with_suffix(".points.json")):
            check_replaceable(p, force=True)
    th = threads or default_threads()
    lines = []
    if calibrate_files:
        cal = calibrate(calibrate_files, th, out, log=log)
        lines.append(
            f"wrote {out}: c0 {cal.c0_ms:.3f} ms, {cal.c_layer_ms:.3f} ms/layer, {cal.bw_gbs:.2f} GB/s, "
            f"{cal.gmacs:.2f} GMAC/s dense, {cal.gmacs_experts:.2f} GMAC/s experts ({th} threads)"
        )
    if validate_files:
        tab = validate(validate_files, th, cost.CpuCalibration.load(out if mine else None))
        lines.append(json.dumps(tab, indent=1) if as_json else format_table(tab))
    return "\n".join(lines)


def write_recipe(p: dict, path) -> None:
    """--write-recipe: the fit option's types and convert line, as JSON (temp file, renamed)."""
    fit = p["fit"]
    if fit is None:
        raise PlanError("no fit recipe fits this VRAM")
    opt = next(o for o in p["options"] if o["kind"] == "fit")
    write_json(path, {"budget_bytes": fit["budget_bytes"], "types": opt["types"], "convert": opt["convert"]})
