"""`clover-gguf eval speed`: how fast each GGUF runs, with the conditions that produced it.

Every target (file x backend) is measured in its own fresh subprocess (``python -m
clover_gguf.eval.bench.speed --worker SPEC.json``): the worker's first load is the *cold* load,
a second load in the same process the *warm* one; then, for the base decoding
configuration and every sweep point, ``warmup`` unrecorded runs and ``runs`` recorded runs
of a full generation (prefill of the prompt, then ``max_new_tokens`` tokens in blocks;
EOS is ignored so every run produces the same number of tokens). Cold load is repeated in
``runs`` fresh processes. Every figure is reported as median, p10, p90 over the recorded
runs (quality.metrics.spread); no best-of.

Per run: prompt tokens/s (prompt length / prefill time), generation tokens/s (generated
tokens / time after the prefill), time per denoising step, steps per block, tokens per
step, time to the first block (prefill + first block's steps). Peak RSS of the worker
process (VmHWM / ru_maxrss) and, on CUDA, peak VRAM.

Backends: ``reference-bf16`` (PyTorch reference on the checkpoint: the speedup baseline,
measured in the same run), ``reference-dequant`` (PyTorch on a GGUF's dequantized weights:
its speed is the reference's, listed only when nothing else can run a GGUF), ``runtime``
(the patched llama.cpp).
"""

from __future__ import annotations

import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from ...constants import DEFAULT_THRESHOLD
from ...outputs import write_json
from ...util import REPO_ROOT
from ..quality.metrics import spread
from . import BenchError

SWEEP_PARAMS = ("block_size", "threshold", "steps", "prompt_len", "max_new_tokens")
SWEEP_RANGES = {
    "block_size": (1, 1024),
    "threshold": (0.0, 1.0),
    "steps": (1, 1024),
    "prompt_len": (1, 1 << 20),
    "max_new_tokens": (1, 1 << 20),
}
DEFAULT_BASE = {"block_size": 16, "steps": None, "threshold": DEFAULT_THRESHOLD, "prompt_len": 64, "max_new_tokens": 64}


def parse_sweep(specs) -> dict[str, list]:
    """["block_size=8,16,32,64", "threshold=0.5,0.9"] -> {param: values}."""
    out = {}
    for s in specs or []:
        if "=" not in s:
            raise ValueError(f"--sweep {s!r}: expected PARAM=V1,V2,...")
        k, v = s.split("=", 1)
        k = k.strip().replace("-", "_")
        if k not in SWEEP_PARAMS:
            raise ValueError(f"--sweep {k!r}: one of {', '.join(SWEEP_PARAMS)}")
        conv = float if k == "threshold" else int
        lo, hi = SWEEP_RANGES[k]
        try:
            vals = [conv(x) for x in v.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--sweep {s!r}: {'numbers' if conv is float else 'integers'} expected") from None
        if not vals or any(not (lo <= x <= hi) for x in vals):  # NaN fails too
            raise ValueError(f"--sweep {s!r}: every {k} must be in [{lo}, {hi}]")
        out[k] = vals
    return out


# ---- worker (runs in the subprocess) -----------------------------------------------------


def _peak_rss_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _load(backend: str, path: str, threads: int, max_block: int | None = None, n_gpu_layers: int = 0):
    import torch

    torch.set_num_threads(threads)
    if backend == "reference-bf16":
        from ..quality.backends import load_reference

        m = load_reference(path)
        return m, m.config
    if backend == "reference-dequant":
        from ..quality.backends import load_dequantized

        m = load_dequantized(path)
        return m, m.config
    from ..quality.backends import open_runtime

    rt = open_runtime(path, threads, n_gpu_layers=n_gpu_layers, max_block=max_block)
    return rt, getattr(rt, "config", None)


def _one_run(backend: str, obj, prompt: list[int], cfg) -> dict:
    from ...reference.generate import TorchBackend, generate

    t0 = time.perf_counter()
    if backend == "runtime":
        if hasattr(obj, "generate"):
            res = obj.generate(prompt, cfg)
        else:
            from ...runtime.runtime import RuntimeBackend

            res = generate(RuntimeBackend(obj), prompt, cfg)
    else:
        res = generate(TorchBackend(obj), prompt, cfg)
    wall = (time.perf_counter() - t0) * 1e3
    blocks = res.blocks
    total_ms = getattr(res, "total_ms", None) or wall
    prefill_ms = getattr(res, "prefill_ms", 0.0)
    steps = sum(b.steps for b in blocks)
    ntok = sum(b.n_tokens for b in blocks)
    step_ms = [x for b in blocks for x in b.ms_per_step]
    return {
        "prompt_tps": len(prompt) / (prefill_ms / 1e3) if prefill_ms > 0 else None,
        "gen_tps": ntok / ((total_ms - prefill_ms) / 1e3) if total_ms > prefill_ms else None,
        "ms_per_step": sum(step_ms) / len(step_ms) if step_ms else None,
        "steps_per_block": steps / len(blocks) if blocks else None,
        "tokens_per_step": ntok / steps if steps else None,
        "ttfb_ms": prefill_ms + (sum(blocks[0].ms_per_step) if blocks else 0.0),
        "total_ms": total_ms,
        "prefill_ms": prefill_ms,
        "n_tokens": ntok,
    }


def _measure(backend, obj, conf: dict, prompt_ids, runs: int, warmup: int, mask_id: int) -> dict:
    from ...reference.generate import GenerationConfig

    P = int(conf["prompt_len"])
    prompt = list(prompt_ids[:P])
    if len(prompt) < P:
        prompt = (prompt * (P // max(len(prompt), 1) + 1))[:P]
    cfg = GenerationConfig(
        max_new_tokens=int(conf["max_new_tokens"]),
        block_size=int(conf["block_size"]),
        steps=conf.get("steps"),
        threshold=conf.get("threshold"),
        temperature=0.0,
        mask_token_id=mask_id,
        eos_token_id=None,
    )
    recs = []
    for i in range(warmup + runs):
        r = _one_run(backend, obj, prompt, cfg)
        if i >= warmup:
            recs.append(r)
    keys = ("prompt_tps", "gen_tps", "ms_per_step", "steps_per_block", "tokens_per_step", "ttfb_ms", "total_ms")
    return {k: spread([r[k] for r in recs if r[k] is not None]) for k in keys}


def worker(spec: dict) -> dict:
    backend, path, threads = spec["backend"], spec["path"], int(spec["threads"])
    mb = max([int(spec["base"]["block_size"])] + [int(v) for v in (spec.get("sweeps") or {}).get("block_size", [])])
    ngl = int(spec.get("n_gpu_layers", 0))
    t0 = time.perf_counter()
    obj, cfg = _load(backend, path, threads, mb, ngl)
    cold = time.perf_counter() - t0
    out = {"load_cold_s": cold}
    if spec.get("load_only"):
        out["peak_rss_mib"] = _peak_rss_mib()
        return out
    del obj
    gc.collect()
    t0 = time.perf_counter()
    obj, cfg = _load(backend, path, threads, mb, ngl)
    out["load_warm_s"] = time.perf_counter() - t0
    mask_id = spec.get("mask_token_id")
    if mask_id is None and cfg is not None:
        mask_id = cfg.mask_token_id
    base = spec["base"]
    out["base"] = _measure(backend, obj, base, spec["prompt_ids"], spec["runs"], spec["warmup"], mask_id)
    out["sweeps"] = {}
    for param, values in (spec.get("sweeps") or {}).items():
        pts = []
        for v in values:
            conf = dict(base)
            conf[param] = v
            if param == "steps":
                conf["threshold"] = None
            if param == "threshold":
                conf["steps"] = None
            pts.append(
                {"value": v, **_measure(backend, obj, conf, spec["prompt_ids"], spec["runs"], spec["warmup"], mask_id)}
            )
        out["sweeps"][param] = pts
    out["peak_rss_mib"] = _peak_rss_mib()
    try:
        import torch

        if torch.cuda.is_available():
            out["peak_vram_mib"] = torch.cuda.max_memory_allocated() / 1048576
    except Exception:
        pass
    return out


# ---- driver ------------------------------------------------------------------------------


def _spawn(spec: dict, timeout: float) -> dict:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
        p = f.name
    try:
        env = dict(os.environ)
        root = str(REPO_ROOT)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        r = subprocess.run(
            [sys.executable, "-m", "clover_gguf.eval.bench.speed", "--worker", p],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    finally:
        os.unlink(p)
    if r.returncode != 0:
        raise BenchError(f"speed worker failed ({spec['backend']} {spec['path']}):\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def prompt_ids_for(reference=None, n: int = 4096, vocab_size: int | None = None, avoid=()) -> tuple[list[int], str]:
    """Prompt tokens: the held-out stdlib text (tokenized) when a tokenizer is at hand, else
    deterministic pseudo-random ids."""
    if reference and (Path(reference) / "tokenizer.json").is_file():
        try:
            from ...tokenizer import CloverTokenizer
            from ...train.data import heldout_files

            tok = CloverTokenizer.from_dir(reference)
            ids = []
            for f in heldout_files():
                ids += tok.encode(f.read_text(encoding="utf-8"))
                if len(ids) >= n:
                    break
            return ids[:n], "held-out stdlib text"
        except Exception:
            pass
    import random

    rng = random.Random(0)
    V = vocab_size or 256
    ids = []
    while len(ids) < n:
        t = rng.randrange(V)
        if t not in avoid:
            ids.append(t)
    return ids, "pseudo-random token ids (seed 0)"


def choose_backends(backends, rt_ok: bool, rt_why: str) -> tuple[set[str], list[str]]:
    """The backends the GGUF rows run on ("auto": the runtime when built, else the reference on
    dequantized weights; "both"), and the note that says so when the runtime is missing."""
    notes = []
    want = set()
    for b in backends:
        if b == "auto":
            want |= {"runtime"} if rt_ok else {"reference-dequant"}
        elif b == "both":
            want |= {"runtime", "reference-dequant"}
        else:
            want.add(b)
    if "runtime" in want and not rt_ok:
        want.discard("runtime")
        want.add("reference-dequant")
        notes.append(
            f"llama.cpp runtime not available ({rt_why}); GGUF rows use the PyTorch reference on "
            "dequantized weights, whose speed is not the quantized kernels' speed"
        )
    return want, notes


def speed_targets(ggufs, reference, want: set[str], names=None) -> list[dict]:
    """One target per (file, backend): the BF16 reference first when given, then each GGUF."""
    from ..sysinfo import gguf_file_info

    targets = []
    if reference:
        targets.append({"name": "PyTorch BF16", "backend": "reference-bf16", "path": str(reference)})
    for i, g in enumerate(ggufs):
        info = gguf_file_info(g)
        nm = names[i] if names and i < len(names) else info["name"]
        for b in ("runtime", "reference-dequant"):
            if b in want:
                targets.append(
                    {
                        "name": nm,
                        "backend": b,
                        "path": str(g),
                        "sha256": info["sha256"],
                        "bytes": info["bytes"],
                        "bpw": info["bpw"],
                    }
                )
    return targets


def speed_prompt(reference, base: dict, sweeps: dict) -> tuple[list[int], str, int | None]:
    """The prompt every target decodes (long enough for every prompt_len swept), where it comes
    from, and the mask token id (None without a reference)."""
    mask_id = None
    V = None
    if reference:
        from ...checkpoint import Checkpoint

        c = Checkpoint(reference).config
        mask_id, V = c.mask_token_id, c.vocab_size
        specials = {c.mask_token_id, c.eos_token_id, c.bos_token_id, c.pad_token_id}
    else:
        specials = set()
    need = max([base["prompt_len"]] + list(sweeps.get("prompt_len", [])))
    prompt_ids, prompt_src = prompt_ids_for(reference, need, V, specials)
    return prompt_ids, prompt_src, mask_id


def measure_target(t: dict, spec: dict, cold_runs: int, timeout: float, reference, log=print) -> None:
    """Measure one target in fresh subprocesses (one full worker, then load-only ones for the
    other cold loads) and record the figures, or the error, in t."""
    from ..quality.backends import model_dir_hash

    try:
        res = _spawn(spec, timeout)
        colds = [res["load_cold_s"]]
        for _ in range(max(0, cold_runs - 1)):
            colds.append(_spawn({**spec, "load_only": True}, timeout)["load_cold_s"])
        t.update(
            {
                "load_cold_s": spread(colds),
                "load_warm_s": spread([res["load_warm_s"]]),
                "peak_rss_mib": spread([res["peak_rss_mib"]]),
                "base": res["base"],
                "sweeps": res["sweeps"],
            }
        )
        if "peak_vram_mib" in res:
            t["peak_vram_mib"] = res["peak_vram_mib"]
        if t["backend"] == "reference-bf16":
            t["sha256"] = "model dir " + model_dir_hash(reference)
        b = res["base"]
        log(
            f"  gen {b['gen_tps'].get('median', float('nan')):.1f} tok/s, prompt "
            f"{b['prompt_tps'].get('median', float('nan')):.1f} tok/s, cold load {spread(colds)['median']:.3f} s"
        )
    except Exception as e:
        t["error"] = str(e)
        log(f"  failed: {e}")


def run_speed(
    ggufs,
    reference=None,
    backends=("auto",),
    runs: int = 5,
    warmup: int = 1,
    threads: int | None = None,
    base: dict | None = None,
    sweeps: dict | None = None,
    out_dir=None,
    timeout: float = 3600,
    cold_runs: int | None = None,
    names=None,
    runtime_threads: int | None = None,
    sweep_reference: bool = True,
    n_gpu_layers: int = 0,
    log=print,
) -> dict:
    from ...util import default_threads
    from ..quality.backends import runtime_status
    from ..sysinfo import environment

    threads = threads or default_threads()
    base = {**DEFAULT_BASE, **(base or {})}
    sweeps = sweeps or {}
    rt_ok, rt_why = runtime_status()
    want, notes = choose_backends(backends, rt_ok, rt_why)
    targets = speed_targets(ggufs, reference, want, names)
    prompt_ids, prompt_src, mask_id = speed_prompt(reference, base, sweeps)
    cold_runs = runs if cold_runs is None else cold_runs
    for t in targets:
        log(f"speed: {t['name']} ({t['backend']})")
        t["threads"] = (runtime_threads or threads) if t["backend"] == "runtime" else threads
        sw = sweeps if (sweep_reference or t["backend"] != "reference-bf16") else {}
        spec = {
            "backend": t["backend"],
            "path": t["path"],
            "threads": t["threads"],
            "runs": runs,
            "warmup": warmup,
            "base": base,
            "sweeps": sw,
            "prompt_ids": prompt_ids,
            "mask_token_id": mask_id,
            "n_gpu_layers": n_gpu_layers if t["backend"] == "runtime" else 0,
        }
        measure_target(t, spec, cold_runs, timeout, reference, log)
    run = {
        "schema": "clover-gguf-eval/1",
        "kind": "speed",
        "config": {
            "runs": runs,
            "warmup": warmup,
            "cold_runs": cold_runs,
            "threads": threads,
            "runtime_threads": runtime_threads or threads,
            "decoding": {**base, "temperature": 0.0, "eos": "ignored (fixed output length)"},
            "sweeps": sweeps,
            "sweep_reference": sweep_reference,
            "prompt_source": prompt_src,
            "backends": sorted(want),
            "n_gpu_layers": n_gpu_layers,
            "environment": environment(threads),
        },
        "targets": targets,
        "notes": notes,
        "runtime": {"available": rt_ok, "detail": rt_why},
    }
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        write_json(Path(out_dir) / "speed.json", run)
    return run


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        res = worker(json.loads(Path(sys.argv[2]).read_text()))
        sys.stdout.write("\n" + json.dumps(res) + "\n")
    else:
        sys.exit("usage: python -m clover_gguf.eval.bench.speed --worker SPEC.json")
