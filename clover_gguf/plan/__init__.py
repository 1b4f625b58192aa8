"""`clover-gguf plan`: which recipe and placement fit a GPU, how fast and at what quality cost.

Sizes are exact (the converter's plan over the model's shapes, plan.sizes); speed comes from
the cost model (plan.cost), quality from the sensitivity curves (plan.fit). docs/plan.md."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from ..convert.plan import fmt_bytes
from . import cost
from .fit import Curves, fit_budget
from .gpus import GPU, find_gpu
from .sizes import GroupTypes, PlanError, Source, convert_line, exact_plan, expert_layer_bytes, header_bytes_estimate

__all__ = ["PlanError", "make_plan", "format_plan"]

RESERVE_BYTES = 600 << 20  # CUDA context, cuBLAS workspace, the desktop: VRAM the model cannot use
N_UBATCH = 256  # clover-gguf run's n_ubatch (runtime.CloverRuntime)
EXPERT_OT = r"ffn_(up|down|gate)_exps"
SCHEMA = "clover-gguf.plan/1"


def _q4_k_m() -> GroupTypes:
    return GroupTypes.make(
        experts_gate_up="q4_k",
        experts_down="q5_k",
        shared_expert="q8_0",
        attention="q8_0",
        embeddings="q8_0",
        output="q6_k",
    )


def _experts(t: str) -> GroupTypes:
    return GroupTypes.make(
        experts_gate_up=t, experts_down=t, shared_expert="q8_0", attention="q8_0", embeddings="q8_0", output="q6_k"
    )


def cpu_layers_regex(layers: list[int]) -> str:
    """One -ot pattern keeping these layers' routed experts in host memory (as --n-cpu-moe N)."""
    return rf"blk\.({'|'.join(str(i) for i in layers)})\.{EXPERT_OT}=CPU"


@dataclass
class Option:
    name: str
    kind: str  # "vram" | "split" | "fit"
    types: GroupTypes
    cpu_layers: list[int] = field(default_factory=list)


def _device(gpu: GPU | None, bandwidth: float | None) -> cost.Device:
    if gpu is not None:
        return cost.Device(gpu.name, bandwidth or gpu.bandwidth_gbs, gpu.tflops, gpu.pcie_gbs)
    if bandwidth is None:
        raise PlanError("give --gpu NAME or --bandwidth GB/s (the speed model needs the memory bandwidth)")
    # an unknown card: PCIe 4.0 x16 and a mid-range compute figure
    return cost.Device(f"GPU at {bandwidth:g} GB/s", bandwidth, 100.0, 0.8 * 1.969 * 16)


def make_plan(
    src: Source,
    vram: int | None = None,
    ram: int | None = None,
    gpu: str | None = None,
    bandwidth: float | None = None,
    context: int | None = None,
    curves: Curves | None = None,
    calibration: cost.CpuCalibration | None = None,
    out_name: str = "clover.gguf",
) -> dict:
    """The plan as a JSON-able dict (schema SCHEMA); format_plan prints it."""
    g = find_gpu(gpu) if gpu else None
    if vram is None:
        if g is None:
            raise PlanError("give --vram SIZE or --gpu NAME")
        vram = g.vram_bytes
    dev = _device(g, bandwidth)
    cfg = src.config
    curves = (curves or Curves.load()).for_layers(cfg.num_hidden_layers)
    cpu = calibration or cost.CpuCalibration.load()
    state = cost.state_bytes(cfg)
    compute = cost.compute_buffer_bytes(cfg, N_UBATCH)
    overhead = state + compute + RESERVE_BYTES
    budget_vram = vram - overhead

    options: list[Option] = []
    for t in ("q4_k", "iq4_xs", "q3_k", "iq3_s", "iq2_s"):
        gt = _q4_k_m() if t == "q4_k" else _experts(t)
        options.append(Option(f"{'q4_k_m' if t == 'q4_k' else t + '-experts'} in VRAM", "vram", gt))
    try:
        fit = fit_budget(src, budget_vram, curves)
        options.append(Option(f"fit:{fmt_bytes(budget_vram).replace(' ', '')} in VRAM", "fit", fit.types))
    except PlanError:
        fit = None
    # split: Q4_K_M with the fewest leading layers' experts in host memory that fits
    q4 = _q4_k_m()
    q4plan = exact_plan(src, q4)
    per_layer = expert_layer_bytes(q4plan)
    need = q4plan.total_bytes - budget_vram
    if need > 0:
        n, moved = 0, 0
        while moved < need and n < cfg.num_hidden_layers:
            moved += per_layer[n]
            n += 1
        if moved >= need:
            options.append(Option(f"q4_k_m, {n} layers' experts on CPU", "split", q4, list(range(n))))
    options.append(Option("q4_k_m, all experts on CPU", "split", q4, list(range(cfg.num_hidden_layers))))

    rows = []
    for o in options:
        plan = q4plan if o.types == q4 else exact_plan(src, o.types)
        cpu_b = sum(per_layer[i] for i in o.cpu_layers) if o.types == q4 else 0
        gpu_b = plan.total_bytes - cpu_b
        hdr = header_bytes_estimate(cfg, len(plan.entries))
        fits_vram = gpu_b + overhead <= vram
        fits_ram = ram is None or cpu_b + hdr + (1 << 30) <= ram
        cpu_set = frozenset(o.cpu_layers)

        speed = {}
        for tps in (4, 8):
            step, commit, tok_s = cost.block_times(
                cfg, plan, tps, lambda w, T: cost.gpu_ms(w, dev, cpu, T), cpu_set, all_rows=True
            )
            speed[str(tps)] = {"step_ms": round(step, 3), "commit_ms": round(commit, 3), "tok_s": round(tok_s, 1)}
        gguf = out_name.replace(".gguf", f"-{o.types.short().split(',')[0].split()[1].replace('/', '-')}.gguf")
        run = ["clover-gguf", "run", gguf, "-ngl", "99"]
        cli = ["llama-clover-cli", "-m", gguf, "-ngl", "-1"]
        if cpu_set:
            if len(o.cpu_layers) == cfg.num_hidden_layers:
                run += ["--experts-on-cpu"]
                cli += ["--cpu-moe"]
            else:
                run += ["-ot", cpu_layers_regex(o.cpu_layers)]
                cli += ["-ot", cpu_layers_regex(o.cpu_layers)]
        run += ["-p", "PROMPT"]
        cli += ["-p", "PROMPT"]
        rows.append(
            {
                "name": o.name,
                "kind": o.kind,
                "types": dict(o.types.types),
                "tensor_bytes": plan.total_bytes,
                "file_bytes_est": plan.total_bytes + hdr,
                "bpw": round(plan.bpw, 4),
                "vram_bytes": gpu_b + overhead,
                "vram_weights_bytes": gpu_b,
                "ram_bytes": cpu_b,
                "cpu_expert_layers": o.cpu_layers,
                "fits": bool(fits_vram and fits_ram),
                "fits_vram": bool(fits_vram),
                "speed": speed,
                "kl_pred": round(curves.predict_recipe(o.types), 6),
                "convert": convert_line(src, o.types, gguf),
                "run": shlex.join(run),
                "llama_clover_cli": shlex.join(cli),
            }
        )
    return {
        "schema": SCHEMA,
        "model": src.label,
        "config": {
            "layers": cfg.num_hidden_layers,
            "experts": cfg.num_experts,
            "experts_per_tok": cfg.num_experts_per_tok,
            "block_size": cfg.block_size,
            "vocab": cfg.vocab_size,
            "touched_fraction_block": round(
                cost.touched_fraction(cfg.num_experts_per_tok, cfg.num_experts, cfg.block_size), 4
            ),
            "touched_fraction_token": round(cost.touched_fraction(cfg.num_experts_per_tok, cfg.num_experts, 1), 4),
        },
        "device": {
            "name": dev.name,
            "vram_bytes": vram,
            "ram_bytes": ram,
            "bandwidth_gbs": dev.bandwidth_gbs,
            "pcie_gbs": round(dev.pcie_gbs, 1),
            "tflops": dev.tflops,
        },
        "context": context,
        "overhead": {"state_bytes": state, "compute_buffer_bytes": compute, "reserve_bytes": RESERVE_BYTES},
        "curves": curves.source,
        "calibration": cpu.source,
        "fit": None if fit is None else {"budget_bytes": fit.budget, "table": fit.format()},
        "options": rows,
        "recommended": (recommended(rows) or {}).get("name"),
    }


def recommended(options: list[dict]) -> dict | None:
    """Least predicted KL among the fitting options at least half as fast as the fastest one:
    a split that runs at a fraction of the speed is not worth its quality."""
    fitting = [o for o in options if o["fits"]]
    if not fitting:
        return None
    top = max(o["speed"]["4"]["tok_s"] for o in fitting)
    fast = [o for o in fitting if o["speed"]["4"]["tok_s"] >= 0.5 * top]
    return min(fast, key=lambda o: (o["kl_pred"], -o["speed"]["4"]["tok_s"]))


def format_plan(p: dict) -> str:
    dv = p["device"]
    c = p["config"]
    lines = [
        f"plan for {p['model']}: {c['layers']} layers, {c['experts']} experts top-{c['experts_per_tok']}, "
        f"block {c['block_size']}",
        f"device: {dv['name']}, {fmt_bytes(dv['vram_bytes'])} VRAM, {dv['bandwidth_gbs']:g} GB/s, "
        f"host link ~{dv['pcie_gbs']:g} GB/s" + (f", {fmt_bytes(dv['ram_bytes'])} RAM" if dv["ram_bytes"] else ""),
        f"a {c['block_size']}-row block touches {100 * c['touched_fraction_block']:.0f} % of a layer's experts "
        f"(one AR token: {100 * c['touched_fraction_token']:.1f} %)",
        f"VRAM besides weights: state {fmt_bytes(p['overhead']['state_bytes'])}, compute buffer "
        f"{fmt_bytes(p['overhead']['compute_buffer_bytes'])}, reserve {fmt_bytes(p['overhead']['reserve_bytes'])}"
        + ("" if p["context"] is None else f" (context {p['context']}: the memory state does not grow with it)"),
        "",
        f"{'option':<36} {'fits':<4} {'file':>10} {'bpw':>5} {'VRAM':>10} {'RAM':>10} "
        f"{'tok/s@4':>8} {'tok/s@8':>8} {'pred. KL':>9}",
    ]
    for o in p["options"]:
        lines.append(
            f"{o['name']:<36} {'yes' if o['fits'] else 'no':<4} {fmt_bytes(o['file_bytes_est']):>10} {o['bpw']:5.2f} "
            f"{fmt_bytes(o['vram_bytes']):>10} {fmt_bytes(o['ram_bytes']):>10} "
            f"{o['speed']['4']['tok_s']:8.1f} {o['speed']['8']['tok_s']:8.1f} {o['kl_pred']:9.5f}"
        )
    best = recommended(p["options"])
    if best is not None:
        lines += ["", f"recommended: {best['name']} (least predicted KL at >= half the fastest fitting speed)"]
        for k in ("convert", "run", "llama_clover_cli"):
            lines.append(f"  {best[k]}")
        split = [o for o in p["options"] if o["fits"] and o["kind"] == "split" and o is not best]
        if split:
            s = max(split, key=lambda o: o["speed"]["4"]["tok_s"])
            lines += [f"best split: {s['name']}", f"  {s['convert']}", f"  {s['run']}"]
    else:
        lines += ["", "no option fits this VRAM"]
    if p["fit"]:
        lines += ["", f"fit recipe for {fmt_bytes(p['fit']['budget_bytes'])} of weights:", p["fit"]["table"]]
    lines += [
        "",
        f"quality: predicted KL from {p['curves']} (clover-tiny's curves: a prior for other models)",
        f"speed: GPU terms from the vendor bandwidth (uncalibrated); CPU terms: {p['calibration']}",
    ]
    return "\n".join(lines)
