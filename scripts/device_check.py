#!/usr/bin/env python
"""The Python stages of scripts/device_check.sh (see there): parity, kernels, memory, speed,
split, summary.

python scripts/device_check.py parity  --out DIR --mode gpu|dry
python scripts/device_check.py kernels --out DIR --mode gpu|dry --bin BUILD/bin --ggml-h PATH/ggml.h
python scripts/device_check.py memory  --out DIR --mode gpu|dry --layers 40
python scripts/device_check.py speed   --out DIR --mode gpu|dry --layers 40 --threads 16
python scripts/device_check.py split   --out DIR --mode gpu|dry --layers 40 --threads 16
python scripts/device_check.py summary --out DIR --mode gpu|dry --seconds S
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def log(*a):
    print("[device-check]", *a, file=sys.stderr, flush=True)


def _kl(p_logits, q_logits) -> float:
    import torch

    lp = torch.log_softmax(torch.as_tensor(p_logits).double(), -1)
    lq = torch.log_softmax(torch.as_tensor(q_logits).double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def _pair(gguf: Path, ngl_a: int, ngl_b: int, threads: int, prompt: list[int], B: int) -> dict:
    """Backend a vs backend b on one GGUF: KL of a masked block's logits after the prompt, and
    the greedy tokens of a 4-block generation."""
    from clover_gguf.reference.generate import GenerationConfig
    from clover_gguf.runtime.runtime import CloverRuntime

    out = {}
    for key, ngl in (("a", ngl_a), ("b", ngl_b)):
        with CloverRuntime(gguf, n_threads=threads, n_gpu_layers=ngl, n_ctx=4096) as rt:
            rt.commit(prompt, B)
            logits = rt.block_logits([rt.mask_token_id] * B).numpy()
            toks = rt.generate(prompt, GenerationConfig(max_new_tokens=4 * B, block_size=B, steps=B // 4)).tokens
            out[key] = (logits, toks)
    (la, ta), (lb, tb) = out["a"], out["b"]
    same = sum(x == y for x, y in zip(ta, tb))
    return {
        "kl_mean": _kl(la, lb),
        "max_abs_logit_diff": float(abs(la - lb).max()),
        "greedy_tokens_equal": ta == tb,
        "greedy_common_prefix": next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta)),
        "greedy_same_fraction": same / max(1, len(ta)),
    }


def parity(out: Path, mode: str) -> dict:
    from clover_gguf.config import preset
    from clover_gguf.convert.converter import convert
    from clover_gguf.synthetic import write_synthetic_gguf
    from clover_gguf.tokenizer import CloverTokenizer
    from clover_gguf.util import DEFAULT_MODEL

    ngl_b = 99 if mode == "gpu" else 0
    res = {"compared": "CPU (-ngl 0) vs CUDA (-ngl 99)" if mode == "gpu" else "CPU 1 thread vs CPU 2 threads (dry run)"}
    tiny = out / "clover-tiny-bf16.gguf"
    convert(DEFAULT_MODEL, tiny, recipe="bf16", force=True, progress=False)
    tok = CloverTokenizer.from_dir(DEFAULT_MODEL)
    prompt = tok.encode('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n')
    B = 16
    res["clover-tiny"] = _pair(tiny, 0, ngl_b, 1 if mode == "dry" else 8, prompt, B)
    log("clover-tiny", res["clover-tiny"])
    wide = out / "clover-35b-1layer-q4_k_m.gguf"
    if not wide.exists():
        write_synthetic_gguf(wide, preset("clover-35b-a3b"), layers=1, recipe="q4_k_m", progress=False)
    res["35b-1-layer"] = _pair(wide, 0, ngl_b, 2 if mode == "dry" else 8, list(range(300, 300 + 70)), 32)
    log("35b-1-layer", res["35b-1-layer"])
    (out / "parity.json").write_text(json.dumps(res, indent=1) + "\n")
    return res


# ----------------------------------------------------------------------------- kernels
# The plan's GPU terms (clover_gguf/plan/kernels.py) measured on this GPU: test-backend-ops perf
# on dense MUL_MATs of every type Clover's recipes use at 1-64 rows (a --test-file of generic
# ops, so the shapes and types are ours); upstream's MUL_MAT_ID perf cases (Qwen3-30B-A3B's: 128
# experts, top-8, 768 x 2048, random routing) at 32-128 rows, as G weights/s by rows per touched
# expert (the plan's MoE term); and host-to-device copies, pinned and pageable. The result is
# summary.json's "kernels", which `clover-gguf plan --calibration summary.json` reads: each of
# these terms then stands at its measurement instead of its public sources' range.

KERNEL_TYPES = ("f16", "bf16", "q8_0", "q6_K", "q5_K", "q4_K", "iq4_xs", "q3_K", "iq3_s", "iq2_s")
KERNEL_ROWS = (1, 8, 16, 32, 64)
MOE_CASE = {"experts": 128, "top_k": 8, "m": 768, "k": 2048}  # upstream's qwen3-30b-a3b perf cases
MOE_ROWS = (32, 64, 128)  # MMQ (more than 8 rows), as the perf list has them
COPY_MIB = (1, 16, 64)  # the rate and the per-call cost from 1 and 16 MiB (Clover's copies: runs of experts)


def _ggml_op_index(ggml_h: Path, name: str) -> int:
    body = ggml_h.read_text().split("enum ggml_op {", 1)[1].split("GGML_OP_COUNT,", 1)[0]
    return re.findall(r"\b(GGML_OP_[A-Z0-9_]+)\b", body).index(name)


def _kernel_file(path: Path, ggml_h: Path, m: int, k: int, types=KERNEL_TYPES, rows=KERNEL_ROWS) -> dict:
    """A test-backend-ops --test-file of MUL_MAT(W[k, m] of each type, X[k, n] f32) ops; returns
    name -> (type, rows, weights, bytes)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    op = _ggml_op_index(ggml_h, "GGML_OP_MUL_MAT")
    lines, cases = [], {}
    for t in types:
        qt = GGMLQuantizationType[t.upper()]
        blk, ts = GGML_QUANT_SIZES[qt]
        row = k // blk * ts
        for n in rows:
            name = f"clover_{t}_n{n}"
            src0 = f"{int(qt)} {k} {m} 1 1 {ts} {row} {row * m} {row * m}"
            src1 = f"0 {k} {n} 1 1 4 {4 * k} {4 * k * n} {4 * k * n}"
            lines.append(f"{op} 0 {m} {n} 1 1 0 2 {src0} {src1} {name}")
            cases[name] = (t.lower(), n, m * k, row * m)
    path.write_text("\n".join(lines) + "\n")
    return cases


def _perf_times(text: str) -> dict[str, float]:
    """test-backend-ops perf console lines -> {params: us per run}."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"\s*([A-Z_]+)\((.*)\):\s+\d+ runs -\s+([\d.]+) us/run", line)
        if m:
            out[f"{m.group(1)}({m.group(2)})"] = float(m.group(3))
    return out


def _gpu_props(mode: str) -> dict:
    """name, SMs, boost GHz, vendor bandwidth: CUDA's own figures, the plan's GPU table for the
    bandwidth (the driver does not report it)."""
    from clover_gguf.plan.gpus import GPUS

    name, sms, ghz = "CPU (dry run)", 1, 1.0
    if mode == "gpu":
        import ctypes

        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True).stdout.splitlines()[0].strip()  # fmt: skip
        rt = ctypes.CDLL("libcudart.so")
        v = ctypes.c_int(0)
        rt.cudaDeviceGetAttribute(ctypes.byref(v), 16, 0)  # cudaDevAttrMultiProcessorCount
        sms = v.value
        rt.cudaDeviceGetAttribute(ctypes.byref(v), 13, 0)  # cudaDevAttrClockRate, kHz
        ghz = v.value / 1e6
    norm = re.sub("[^a-z0-9]", "", name.lower())
    hits = [g for g in GPUS.values() if g.key.replace("-", "") in norm] or [
        g for g in GPUS.values() if g.key.split("-")[0] in norm
    ]
    key = max(hits, key=lambda g: len(g.key)) if hits else None
    return {"gpu": name, "sms": sms, "ghz": ghz, "bandwidth_gbs": key.bandwidth_gbs if key else None,
            "table_entry": key.key if key else None}  # fmt: skip


def _copy_rates(reps: int = 5) -> dict:
    """Host-to-device cudaMemcpy of COPY_MIB from pinned (cudaMallocHost) and pageable (malloc)
    memory, median of `reps`; as GB/s + ms a call (the plan's form: kernels.KernelTable.copy)."""
    import ctypes

    rt = ctypes.CDLL("libcudart.so")
    size = max(COPY_MIB) << 20
    dev, pin = ctypes.c_void_p(), ctypes.c_void_p()
    rt.cudaMalloc(ctypes.byref(dev), ctypes.c_size_t(size))
    rt.cudaMallocHost(ctypes.byref(pin), ctypes.c_size_t(size))
    pageable = ctypes.create_string_buffer(size)
    out = {}
    try:
        for kind, src in (("pinned", pin.value), ("pageable", ctypes.addressof(pageable))):
            ms = {}
            for mib in COPY_MIB:
                n = mib << 20
                times = []
                for _ in range(reps + 1):
                    rt.cudaDeviceSynchronize()
                    t = time.perf_counter()
                    rt.cudaMemcpy(dev, ctypes.c_void_p(src), ctypes.c_size_t(n), 1)  # cudaMemcpyHostToDevice
                    rt.cudaDeviceSynchronize()
                    times.append((time.perf_counter() - t) * 1e3)
                ms[mib] = statistics.median(times[1:])
            out[kind] = copy_fit(ms)
    finally:
        rt.cudaFree(dev)
        rt.cudaFreeHost(pin)
    return out


def copy_fit(ms: dict[int, float], a: int = 1, b: int = 16) -> dict:
    """{MiB: ms} -> GB/s and ms a call from the a and b MiB copies (PR #976's sizes, as the seeds)."""
    gb_per_ms = ((b - a) * 2**20 / 1e9) / (ms[b] - ms[a])
    return {"gbs": gb_per_ms * 1e3, "call_ms": max(0.0, ms[a] - a * 2**20 / 1e9 / gb_per_ms),
            "ms": {str(k): v for k, v in ms.items()}}  # fmt: skip


def moe_rows_per_expert(n: int, experts: int = MOE_CASE["experts"], top_k: int = MOE_CASE["top_k"]) -> float:
    """Mean rows a touched expert gets when n rows each pick top_k distinct experts at random (as
    test-backend-ops draws the ids: a shuffled permutation a row)."""
    return n * top_k / (experts * (1 - (1 - top_k / experts) ** n))


def kernels_result(dense_text: str, moe_text: str, cases: dict, props: dict, copy: dict | None, m: int, k: int) -> dict:
    """The kernels stage's result from test-backend-ops' perf output (dense: the --test-file
    cases; moe: upstream's MUL_MAT_ID cases), the GPU's properties and the copy figures."""
    bw = props["bandwidth_gbs"]
    dense: dict[str, dict[int, float]] = {}
    mmq: dict[str, dict[str, float]] = {}
    bwf: dict[str, float] = {}
    for key, us in _perf_times(dense_text).items():
        name = re.search(r"name=(clover_\w+?_n\d+)", key)
        if not name or name.group(1) not in cases:
            continue
        t, n, weights, nbytes = cases[name.group(1)]
        dense.setdefault(t, {})[n] = us
        if bw and ((t in ("f16", "bf16") and n == 32) or (t not in ("f16", "bf16") and n == 1)):
            bwf[t] = nbytes / (us * 1e3) / bw  # bandwidth-bound regimes: a fraction of the vendor figure
        if t not in ("f16", "bf16") and n >= 16:
            mmq.setdefault(t, {})[str(n)] = weights / (us * 1e3)  # G weights/s
    moe: dict[str, dict[str, float]] = {}
    pat = (r"MUL_MAT_ID\(type_a=(\w+),type_b=f32,n_mats={experts},n_used={top_k},b=0,m={m},n=(\d+),k={k},amax="
           .format(**MOE_CASE))  # fmt: skip
    for key, us in _perf_times(moe_text).items():
        mt = re.match(pat, key)
        if mt and int(mt.group(2)) > 8 and mt.group(1).lower() not in ("f16", "f32"):
            n = int(mt.group(2))
            rho = moe_rows_per_expert(n)
            touched = MOE_CASE["experts"] * (1 - (1 - MOE_CASE["top_k"] / MOE_CASE["experts"]) ** n)
            moe.setdefault(mt.group(1).lower(), {})[f"{rho:.3f}"] = touched * MOE_CASE["m"] * MOE_CASE["k"] / (us * 1e3)
    return {
        **props,
        "mmq": mmq,  # type -> rows -> G weights/s (dense, m x k)
        "moe": moe,  # type -> rows per touched expert -> G touched weights/s (MUL_MAT_ID)
        "moe_case": MOE_CASE,
        "float_bw": bwf.get("bf16"),
        "mmvq_bw": {t: f for t, f in bwf.items() if t not in ("f16", "bf16")},
        "copy": copy,  # {"pinned"|"pageable": {"gbs", "call_ms", "ms"}} (GPU runs only)
        "dense_us": dense,
        "shape": {"m": m, "k": k},
    }


def kernels(out: Path, mode: str, bin_dir: Path, ggml_h: Path) -> dict:
    exe = bin_dir / "test-backend-ops"
    backend = "CUDA0" if mode == "gpu" else "CPU"
    m, k = (14336, 4096) if mode == "gpu" else (256, 256)
    types, rows = (KERNEL_TYPES, KERNEL_ROWS) if mode == "gpu" else (("bf16", "q4_K", "iq2_s"), (1, 32))
    cases = _kernel_file(out / "kernel-cases.txt", ggml_h, m, k, types, rows)
    r = subprocess.run([str(exe), "perf", "-b", backend, "--test-file", str(out / "kernel-cases.txt")],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    (out / "kernels-dense.log").write_text(r.stdout + r.stderr)
    dense_text, moe_text, copy = r.stdout, "", None
    if mode == "gpu":
        ns = "|".join(str(n) for n in MOE_ROWS)
        flt = "n_mats={experts},n_used={top_k},b=0,m={m},n=({ns}),k={k},amax".format(ns=ns, **MOE_CASE)
        r = subprocess.run([str(exe), "perf", "-b", backend, "-o", "MUL_MAT_ID", "-p", flt],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
        (out / "kernels-moe.log").write_text(r.stdout + r.stderr)
        moe_text = r.stdout
        copy = _copy_rates()
    res = kernels_result(dense_text, moe_text, cases, _gpu_props(mode), copy, m, k)
    (out / "kernels.json").write_text(json.dumps(res, indent=1) + "\n")
    log("kernels:", {t: v.get("32") for t, v in res["mmq"].items()}, "float_bw", res["float_bw"], "moe", res["moe"],
        "copy", {c: (v["gbs"], v["call_ms"]) for c, v in (copy or {}).items()})  # fmt: skip
    return res


# ----------------------------------------------------------------------------- memory, split


def _synth(out: Path, layers: int) -> Path:
    from clover_gguf.config import preset
    from clover_gguf.synthetic import write_synthetic_gguf

    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    gguf = work / f"clover-35b-a3b-{layers}l-q4_k_m.gguf"
    if not gguf.exists():
        write_synthetic_gguf(gguf, preset("clover-35b-a3b"), layers=layers, recipe="q4_k_m", progress=False)
    return gguf


def _smi_used_mib() -> int | None:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=10)  # fmt: skip
        return int(r.stdout.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def memory(out: Path, mode: str, layers: int) -> dict:
    """What llama.cpp puts on the GPU for the full-depth q4_k_m synthetic at -ngl 99 against the
    plan's VRAM account (clover_gguf/plan/vram.py): the CUDA context (memory used before any
    process of ours vs free after ggml created its context), and the model, memory (state) and
    compute buffers llama.cpp reports."""
    from clover_gguf.plan import vram as V
    from clover_gguf.plan.placement import gguf_bytes, gpu_devices
    from clover_gguf.runtime.runtime import CloverRuntime

    gguf = _synth(out, layers)
    used0 = _smi_used_mib() if mode == "gpu" else None
    devs = gpu_devices()
    res: dict = {"gguf": gguf.name, "devices_after_context": [d.__dict__ for d in devs]}
    if devs and used0 is not None:
        res["cuda_context_mib"] = (devs[0].total - devs[0].free) / 2**20 - used0
    with CloverRuntime(gguf, n_threads=4, n_gpu_layers=99 if mode == "gpu" else 0, n_ctx=4096) as rt:
        res["buffers_mib"] = rt.placement.get("buffers")
        res["n_ubatch"] = rt.n_ubatch
        res["devices_after_load"] = [d.__dict__ for d in gpu_devices()]
    experts, other, cfg = gguf_bytes(gguf, 99)
    acct = V.account(cfg, 1)
    res["account_mib"] = {
        "weights": (sum(sum(t) for t in experts.values()) + other) / 2**20,
        **{k: v / 2**20 for k, v in acct.to_dict().items()},
    }
    (out / "memory.json").write_text(json.dumps(res, indent=1) + "\n")
    log("memory:", res)
    return res


def _one_layer_out(gguf: Path) -> int:
    """Free VRAM for which the shared rule moves exactly the first layer's experts to the host."""
    from clover_gguf.plan import vram as V
    from clover_gguf.plan.placement import gguf_bytes

    experts, other, cfg = gguf_bytes(gguf, 99)
    acct = V.account(cfg, 1, host_tensor_max=max(max(t) for t in experts.values()))
    return sum(sum(t) for t in experts.values()) + other + acct.overhead + acct.offload_copy - sum(experts[0])


def split(out: Path, mode: str, layers: int, threads: int) -> dict:
    """The 16 GB placement (the shared rule: what `run --fit` picks on a 16 GiB card) timed with
    the three ways the runtime can treat host experts, next to the plan's prediction for them."""
    from clover_gguf.plan import cpu_layers_regex, make_plan
    from clover_gguf.plan.kernels import KernelTable
    from clover_gguf.plan.sizes import open_source

    gguf = _synth(out, layers)
    gpu = _gpu_props(mode)["table_entry"] or "rtx4080"
    kj = out / "kernels.json"
    kern = KernelTable.from_kernels(json.loads(kj.read_text()), str(kj)) if kj.exists() else None
    # the placement a 16 GiB card gets (dry run: one layer's experts out), the speed terms of this GPU
    free = 16 * 2**30 - (300 << 20) if mode == "gpu" else _one_layer_out(gguf)
    plan = make_plan(open_source(str(gguf)), vram_total=16 * 2**30, free=free, gpu=gpu, kernels=kern)
    rows = {r["name"]: r for r in plan["options"]}
    res: dict = {"free_bytes": plan["device"]["free_bytes"], "gpu_terms": plan["speed_label"], "runs": {}}
    from clover_gguf.generation.run import run

    variants = {
        "op offload, pageable": {},
        "op offload, pinned": {"mmap": False},
        "CPU computes": {"op_offload": False},
    }
    for variant, kw in variants.items():
        row = rows.get(f"this file, split ({variant})")
        if row is None:
            continue
        ot = [cpu_layers_regex(row["cpu_expert_layers"])]
        t0 = time.perf_counter()
        try:
            o = run(
                gguf,
                prompt_ids=list(range(300, 364)),
                max_new_tokens=64,
                steps=8,
                block_size=32,
                threads=threads,
                n_gpu_layers=99 if mode == "gpu" else 0,
                override_tensor=ot,
                fit=False,
                log=log,
                **kw,
            ).to_dict()
            got, err = o["gen_tokens_per_s"], None
        except Exception as e:  # noqa: BLE001 - recorded, the other variants still run
            got, err = None, f"{type(e).__name__}: {e}"
        res["runs"][variant] = {"error": err, "cpu_layers": row["cpu_expert_layers"], "gen_tok_s": got,
                                "wall_s": time.perf_counter() - t0, "plan_tok_s_at_4": row["speed"]["4"]["tok_s"],
                                "plan_tok_s_at_8": row["speed"]["8"]["tok_s"]}  # fmt: skip
    (out / "split.json").write_text(json.dumps(res, indent=1) + "\n")
    log("split:", res)
    return res


def _vram_sampler(stop: threading.Event, peak: list) -> None:
    while not stop.is_set():
        try:
            r = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=5,
            )
            peak[0] = max(peak[0], int(r.stdout.split()[0]))
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return
        stop.wait(0.5)


def _bench(cli: Path, gguf: Path, args: list[str], out: Path, name: str) -> dict:
    """llama-clover-cli; the speed figures it prints after the text and the peak GPU memory while it ran."""
    stop, peak = threading.Event(), [0]
    th = threading.Thread(target=_vram_sampler, args=(stop, peak), daemon=True)
    th.start()
    cmd = [str(cli), "-m", str(gguf), "--prompt-ids", ",".join(str(i) for i in range(300, 364)), *args]
    t = time.perf_counter()
    # the generated text of random weights is arbitrary bytes
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=400)
    stop.set()
    th.join()
    (out / f"{name}.log").write_text(" ".join(cmd) + "\n" + r.stdout + r.stderr)
    f = lambda pat: float(m.group(1)) if (m := re.search(pat, r.stderr)) else None  # noqa: E731
    return {
        "command": " ".join(cmd[1:]),
        "rc": r.returncode,
        "wall_s": time.perf_counter() - t,
        "prompt_tok_s": f(r"prompt:.*: ([\d.]+) tok/s"),
        "gen_tok_s": f(r"generation:.*: ([\d.]+) tok/s"),
        "ms_per_step": f(r"steps:.*, ([\d.]+) ms per step"),
        "tokens_per_step": f(r"([\d.]+) tokens per step"),
        "graph_build_ms": f(r"graph build ([\d.]+) ms"),
        "compute_ms": f(r"compute ([\d.]+) ms"),
        "host_ms": f(r"host ([\d.]+) ms"),
        "other_ms": f(r"other ([\d.]+) ms"),
        "vram_peak_mib": peak[0] or None,
    }


def placement_16gb(gguf: Path, budget_gib: float = 16.0, reserve_gib: float = 1.5) -> dict:
    """What a 16 GB card holds: every non-expert tensor and the routed experts of the last
    layers, the experts of the first k layers in CPU memory (-ot), k as small as fits."""
    from gguf import GGUFReader

    r = GGUFReader(gguf)
    total, experts = 0, {}
    for t in r.tensors:
        total += int(t.n_bytes)
        m = re.match(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$", t.name)
        if m:
            experts[int(m.group(1))] = experts.get(int(m.group(1)), 0) + int(t.n_bytes)
    budget = (budget_gib - reserve_gib) * 2**30
    k, on_gpu = 0, total
    while on_gpu > budget and k < len(experts):
        on_gpu -= experts[k]
        k += 1
    regex = r"^blk\.(" + "|".join(str(i) for i in range(k)) + r")\.ffn_(gate|up|down)_exps\.weight$"
    return {
        "file_gib": total / 2**30,
        "gpu_gib": on_gpu / 2**30,
        "cpu_expert_layers": k,
        "cpu_expert_gib": sum(experts[i] for i in range(k)) / 2**30,
        "override": f"{regex}=CPU" if k else None,
        "reserve_gib_for_buffers_and_state": reserve_gib,
        # a 32-row denoising batch is at llama.cpp's op-offload threshold: the CPU-resident
        # experts' weights are copied to the GPU for every pass
        "pcie_bytes_per_step_estimate": sum(experts[i] for i in range(k)),
    }


def speed(out: Path, mode: str, layers: int, threads: int) -> dict:
    from clover_gguf.config import preset
    from clover_gguf.eval.bench.passes import PassesConfig, run_passes
    from clover_gguf.runtime.build import runtime_paths
    from clover_gguf.synthetic import write_synthetic_gguf

    cli = Path(os.environ.get("LLAMA_CPP_LIB_PATH", runtime_paths()["bin_dir"])) / "llama-clover-cli"
    ngl = ["-ngl", "99", "-fit", "off"] if mode == "gpu" else []  # the placement given, not common's fit
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    gguf = work / f"clover-35b-a3b-{layers}l-q4_k_m.gguf"
    res: dict = {"layers": layers, "threads": threads}
    if not gguf.exists():
        t = time.perf_counter()
        write_synthetic_gguf(gguf, preset("clover-35b-a3b"), layers=layers, recipe="q4_k_m", progress=False)
        res["synth_s"] = time.perf_counter() - t
    common = ["-t", str(threads), "--diffusion-block-length", "32", "-n", "128", *ngl]
    steps = lambda n: ["--diffusion-threshold", "0", "--diffusion-steps", str(n)]  # noqa: E731
    for n in (8, 16):
        res[f"steps{n}"] = _bench(cli, gguf, common + steps(n), out, f"bench-steps{n}")
        log(f"steps {n}:", res[f"steps{n}"])
    res["threshold0.9"] = _bench(cli, gguf, common + ["--diffusion-threshold", "0.9"], out, "bench-threshold")
    pl = placement_16gb(gguf)
    res["placement_16gb"] = pl
    ot = ["-ot", pl["override"]] if pl["override"] else []
    res["placement_16gb"]["bench"] = _bench(cli, gguf, common + steps(8) + ot, out, "bench-16gb")
    log("16 GB placement:", res["placement_16gb"])
    (out / "speed.json").write_text(json.dumps(res, indent=1) + "\n")
    # side by side with llama.cpp's own passes at full depth (Qwen3-MoE twin)
    cfg = PassesConfig(
        layers=(layers,),
        threads=(threads,),
        heads=("q4_k_m",),
        rounds=3 if mode == "gpu" else 1,
        n_gpu_layers=99 if mode == "gpu" else 0,
        work=work,
        out=out / "passes",
    )
    try:
        bundle = run_passes(cfg, log=log)
        res["passes"] = bundle["runs"][0]["ratios"]
    except Exception as e:  # noqa: BLE001 - the other figures stand without it
        res["passes_error"] = f"{type(e).__name__}: {e}"
    (out / "speed.json").write_text(json.dumps(res, indent=1) + "\n")
    return res


def summary(out: Path, mode: str, seconds: int) -> None:
    def load(name):
        p = out / name
        return json.loads(p.read_text()) if p.exists() else None

    stages = (
        [json.loads(x) for x in (out / "stages.jsonl").read_text().splitlines()]
        if (out / "stages.jsonl").exists()
        else []
    )
    ops = (out / "ops.txt").read_text().splitlines() if (out / "ops.txt").exists() else []
    s = {
        "mode": mode,
        "gpu": (out / "gpu.txt").read_text().strip() if (out / "gpu.txt").exists() else None,
        "seconds": seconds,
        "stages": stages,
        "ops": ops,
        "parity": load("parity.json"),
        "speed": load("speed.json"),
        "kernels": load("kernels.json"),
        "memory": load("memory.json"),
        "split": load("split.json"),
    }
    (out / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
    L = [f"# device check ({mode})", "", f"- GPU: {s['gpu']}", f"- wall time: {seconds} s", "", "## Stages", ""]
    L += [f"- {st['stage']}: rc {st['rc']}, {st['seconds']} s" for st in stages]
    L += ["", "## test-backend-ops", ""] + [f"- {o}" for o in ops]
    if s["parity"]:
        L += ["", f"## Parity ({s['parity']['compared']})", ""]
        for k, v in s["parity"].items():
            if isinstance(v, dict):
                L.append(
                    f"- {k}: KL {v['kl_mean']:.2e}, max |dlogit| {v['max_abs_logit_diff']:.2e}, greedy tokens "
                    f"equal: {v['greedy_tokens_equal']} (common prefix {v['greedy_common_prefix']})"
                )
    sp = s["speed"]
    if sp:
        L += [
            "",
            f"## Speed: synthetic Clover-35B-A3B, {sp['layers']} layers, q4_k_m, {sp['threads']} threads",
            "",
            "| run | gen tok/s | ms/step | tok/step | graph ms | compute ms | host ms | other ms | prompt tok/s | VRAM MiB |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        fmt = lambda x: "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g}"  # noqa: E731
        runs = [(k, sp[k]) for k in ("steps8", "steps16", "threshold0.9") if k in sp]
        if sp.get("placement_16gb"):
            runs.append(("16 GB placement, steps 8", sp["placement_16gb"]["bench"]))
        for k, b in runs:
            L.append(
                f"| {k} | {fmt(b['gen_tok_s'])} | {fmt(b['ms_per_step'])} | {fmt(b['tokens_per_step'])} | "
                f"{fmt(b['graph_build_ms'])} | {fmt(b['compute_ms'])} | {fmt(b['host_ms'])} | {fmt(b['other_ms'])} | "
                f"{fmt(b['prompt_tok_s'])} | {fmt(b['vram_peak_mib'])} |"
            )
        pl = sp.get("placement_16gb")
        if pl:
            L += [
                "",
                f"16 GB placement: {pl['cpu_expert_layers']} layers' experts in CPU memory "
                f"({pl['cpu_expert_gib']:.2f} GiB), {pl['gpu_gib']:.2f} GiB on the GPU of a {pl['file_gib']:.2f} GiB file; "
                f"PCIe per step (estimate: the CPU experts copied for each 32-row pass) "
                f"{pl['pcie_bytes_per_step_estimate'] / 2**30:.2f} GiB",
            ]
        if sp.get("passes"):
            L += [
                "",
                "Time ratios Clover / llama.cpp (Qwen3-MoE twin): "
                + ", ".join(f"{k} {v:.2f}" for k, v in sp["passes"].items()),
            ]
        if sp.get("passes_error"):
            L += ["", f"passes: {sp['passes_error']}"]
    L += _summary_plan_terms(s)
    (out / "summary.md").write_text("\n".join(L) + "\n")
    print("\n".join(L))


def _summary_plan_terms(s: dict) -> list[str]:
    """The figures `clover-gguf plan --calibration summary.json` takes, and the checks of its model."""
    L = []
    k = s.get("kernels")
    if k:
        L += ["", f"## Kernels on {k['gpu']} ({k['sms']} SMs, {k['ghz']:.3f} GHz): G weights/s, dense", ""]
        L += [f"- {t}: " + ", ".join(f"{n} rows {v:.0f}" for n, v in sorted(per.items(), key=lambda x: int(x[0])))
              for t, per in sorted(k["mmq"].items())]  # fmt: skip
        L.append(f"- bf16 bandwidth fraction at 32 rows: {k['float_bw']}")
        L += [f"- MUL_MAT_ID {t}: " + ", ".join(f"{float(r):.2f} rows/expert {v:.0f}" for r, v in sorted(per.items(),
              key=lambda x: float(x[0]))) for t, per in sorted((k.get("moe") or {}).items())]  # fmt: skip
        for c, v in (k.get("copy") or {}).items():
            L.append(f"- {c} host-to-device copies: {v['gbs']:.2f} GB/s + {1e3 * v['call_ms']:.1f} us a call")
    m = s.get("memory")
    if m:
        L += [
            "",
            f"## VRAM: llama.cpp's buffers vs the plan's account (MiB): {m.get('buffers_mib')} vs {m.get('account_mib')}",
        ]
        if "cuda_context_mib" in m:
            L.append(f"- CUDA context: {m['cuda_context_mib']:.0f} MiB (the plan assumes 300)")
    sp = s.get("split")
    if sp:
        L += ["", "## 16 GB split: measured vs predicted tok/s (steps 8 = 4 tokens a step)", ""]
        L += [f"- {v}: {r['gen_tok_s']} measured, {r['plan_tok_s_at_4']} predicted, {len(r['cpu_layers'])} layers"
              for v, r in sp["runs"].items()]  # fmt: skip
    return L


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("stage", choices=["parity", "kernels", "memory", "speed", "split", "summary"])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--mode", choices=["gpu", "dry"], required=True)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--seconds", type=int, default=0)
    ap.add_argument("--bin", type=Path, help="the build's bin/ (kernels)")
    ap.add_argument("--ggml-h", type=Path, help="the built tree's ggml/include/ggml.h (kernels)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.stage == "parity":
        parity(a.out, a.mode)
    elif a.stage == "kernels":
        kernels(a.out, a.mode, a.bin, a.ggml_h)
    elif a.stage == "memory":
        memory(a.out, a.mode, a.layers)
    elif a.stage == "speed":
        speed(a.out, a.mode, a.layers, a.threads)
    elif a.stage == "split":
        split(a.out, a.mode, a.layers, a.threads)
    else:
        summary(a.out, a.mode, a.seconds)


if __name__ == "__main__":
    main()
