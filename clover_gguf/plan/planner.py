"""`clover-gguf plan`: which recipe and placement fit a GPU, how fast and at what quality cost.

Sizes are exact (the converter's plan over the model's shapes, plan.sizes); the placement is
the one `run --fit` makes (plan.placement, plan.vram); speed comes from the cost model
(plan.cost: GPU kernel rates from plan.kernels, routing from plan.routing, CPU terms from
`plan --calibrate`), quality from the sensitivity curves (plan.budget). docs/plan.md."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

import numpy as np

from ..convert.tensor_plan import fmt_bytes
from . import cost, vram
from .budget import Curves, fit_budget
from .gpus import GPU, GPUS, find_gpu
from .kernels import BOUNDS, PARTIAL_ASSUMPTIONS, KernelTable
from .placement import FitError, place, split_bytes
from .routing import Routing, fingerprint_checkpoint, fingerprint_gguf
from .sizes import GroupTypes, PlanError, Source, convert_line, exact_plan, header_bytes_estimate

__all__ = ["PlanError", "make_plan", "format_plan", "cpu_layers_regex"]

EXPERT_OT = r"ffn_(up|down|gate)_exps"
SCHEMA = "clover-gguf.plan/2"
IN_VRAM = ("vram", "fit", "file")


def cpu_layers_regex(layers: list[int]) -> str:
    """One -ot pattern keeping these layers' routed experts in host memory (as --n-cpu-moe N)."""
    return rf"blk\.({'|'.join(str(i) for i in layers)})\.{EXPERT_OT}=CPU"


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


def _all(t: str) -> GroupTypes:
    return GroupTypes.make(**{g: t for g in ("experts_gate_up", "experts_down", "shared_expert", "attention",
                                             "embeddings", "output")})  # fmt: skip


# recipes the plan sizes (name, types, shown only when it fits)
RECIPES = [
    ("bf16", lambda: _all("bf16"), True),
    ("q8_0", lambda: _all("q8_0"), True),
    ("q6_k-experts", lambda: _experts("q6_k"), True),
    ("q5_k-experts", lambda: _experts("q5_k"), True),
    ("q4_k_m", _q4_k_m, False),
    ("iq4_xs-experts", lambda: _experts("iq4_xs"), False),
    ("q3_k-experts", lambda: _experts("q3_k"), False),
    ("iq3_s-experts", lambda: _experts("iq3_s"), False),
    ("iq2_s-experts", lambda: _experts("iq2_s"), False),
]
LINKS = {  # split variants: what the runtime does with host experts
    "op offload, pageable": (cost.HostLink(True, False), []),
    "op offload, pinned": (cost.HostLink(True, True), ["--no-mmap"]),
    "CPU computes": (cost.HostLink(False, False), ["--no-op-offload"]),
}
COMMON_SPELLING = {"--no-mmap": ["-lm", "none"]}  # llama-clover-cli's (common's) name of a `run` flag


@dataclass
class Option:
    name: str
    kind: str  # "vram" | "fit" | "file" | "split"
    plan: object  # convert.tensor_plan.Plan
    types: GroupTypes | None  # None: the GGUF as it is
    cpu_layers: list[int] = field(default_factory=list)
    link: cost.HostLink = field(default_factory=cost.HostLink)
    flags: list[str] = field(default_factory=list)
    hidden_unless_fits: bool = False


def _device(
    gpu: GPU | None, bandwidth: float | None, total: int | None, free: int | None
) -> tuple[cost.Device, str, int, GPU]:
    """(device, what was assumed, total VRAM bytes); without a GPU of the table, the card's size
    (total, else the free memory given) picks the figures assumed."""
    note = ""
    if gpu is None:
        total = total if total is not None else free
        if total is None:
            raise PlanError("give --gpu NAME, or --vram SIZE (the card's memory), or --free-vram SIZE")
        # an unknown card: the figures of the table's median-bandwidth card of the nearest size
        near = min(abs(g.vram_bytes - total) for g in GPUS.values())
        same = sorted((g for g in GPUS.values() if abs(g.vram_bytes - total) == near), key=lambda g: g.bandwidth_gbs)
        gpu = same[(len(same) - 1) // 2]
        what = "bandwidth, SMs and host link" if bandwidth is None else "SMs and host link"
        note = (f"an unknown {fmt_bytes(total)} card: the {what} of the {gpu.name} assumed (the median-bandwidth "
                f"card of that size in the GPU table); give --gpu for yours")  # fmt: skip
        name = f"GPU with {fmt_bytes(total)}" + (f" at {bandwidth:g} GB/s" if bandwidth else f" (~{gpu.name})")
    else:
        name = gpu.name
    dev = cost.Device(name, bandwidth or gpu.bandwidth_gbs, gpu.tflops, gpu.pcie_raw_gbs, gpu.sm_ghz)
    return dev, note, total if total is not None else gpu.vram_bytes, gpu


def _routing(src: Source) -> Routing:
    cfg = src.config
    fp = None
    if src.path is not None and src.path.is_dir():
        fp = fingerprint_checkpoint(src.ck, cfg.num_hidden_layers)
    elif src.path is not None:
        fp = fingerprint_gguf(src.path)
    return Routing.load_for(cfg.num_experts_per_tok, cfg.num_experts, fp)


def _file_plan(src: Source):
    from .calibrate import gguf_plan

    return gguf_plan(src.path)[1]


def _whole(plan, cfg, n_seq) -> int:
    """VRAM that everything on the GPU needs (token_embd stays on the host)."""
    experts, other = split_bytes(((e.name, e.nbytes) for e in plan.entries), cfg.num_hidden_layers)
    return sum(sum(ts) for ts in experts.values()) + other + vram.account(cfg, n_seq).overhead


def _place(plan, cfg, free, n_seq, link, all_cpu=False):
    """The placement by the shared rule (run --fit's); all_cpu: every layer's experts on the host."""
    experts, other = split_bytes(((e.name, e.nbytes) for e in plan.entries), cfg.num_hidden_layers)
    if all_cpu:
        p = place({il: [] for il in experts}, other, free, cfg, n_seq, link.op_offload)
        p.cpu_layers = sorted(experts)
        p.cpu_bytes = sum(sum(ts) for ts in experts.values())
        biggest = max((t for ts in experts.values() for t in ts), default=0)
        p.gpu_bytes += biggest if link.op_offload else 0
        return p
    return place(experts, other, free, cfg, n_seq, link.op_offload)


def _options(src: Source, free: int, n_seq: int, curves: Curves) -> tuple[list[Option], object]:
    cfg = src.config
    opts: list[Option] = []
    if src.path is not None and src.path.suffix == ".gguf":
        fp = _file_plan(src)
        opts.append(Option("this file in VRAM", "file", fp, None))
        for lname, (link, flags) in LINKS.items():
            opts.append(Option(f"this file, split ({lname})", "split", fp, None, link=link, flags=flags))
    for name, make, hide in RECIPES:
        gt = make()
        opts.append(Option(f"{name} in VRAM", "vram", exact_plan(src, gt), gt, hidden_unless_fits=hide))
    acct = vram.account(cfg, n_seq)
    try:
        fit = fit_budget(src, free - acct.overhead, curves, gpu_only=True)
        gt = fit.types
        opts.append(Option(f"fit:{fmt_bytes(free - acct.overhead).replace(' ', '')} in VRAM", "fit",
                           exact_plan(src, gt), gt))  # fmt: skip
    except PlanError:
        fit = None
    q4 = _q4_k_m()
    q4plan = exact_plan(src, q4)
    for lname, (link, flags) in LINKS.items():
        opts.append(Option(f"q4_k_m, split ({lname})", "split", q4plan, q4, link=link, flags=flags))
    for lname in ("op offload, pageable", "CPU computes"):
        link, flags = LINKS[lname]
        o = Option(f"q4_k_m, all experts on CPU ({lname})", "split", q4plan, q4, link=link, flags=flags)
        o.cpu_layers = list(range(cfg.num_hidden_layers))
        opts.append(o)
    return opts, fit


def _commands(src: Source, o: Option, out_name: str) -> dict:
    cfg = src.config
    if o.types is None:
        gguf, conv = str(src.path), None
    else:
        gguf = out_name.replace(".gguf", f"-{o.types.experts_tag()}.gguf")
        conv = convert_line(src, o.types, gguf)
    run = ["clover-gguf", "run", gguf, "-ngl", "99"]
    # common's options: the plan's placement instead of common's --fit
    cli = ["llama-clover-cli", "-m", gguf, "-ngl", "all", "-fit", "off"]
    if o.cpu_layers:
        if len(o.cpu_layers) == cfg.num_hidden_layers:
            run += ["--experts-on-cpu"]
            cli += ["--cpu-moe"]
        else:
            run += ["-ot", cpu_layers_regex(o.cpu_layers)]
            cli += ["-ot", cpu_layers_regex(o.cpu_layers)]
        run += o.flags
        cli += [a for f in o.flags for a in COMMON_SPELLING.get(f, [f])]
    run += ["-p", "PROMPT"]
    cli += ["-p", "PROMPT"]
    return {"convert": conv, "run": shlex.join(run), "llama_clover_cli": shlex.join(cli)}


def _speed(cfg, plan, cpu_set, time_fn, routing) -> dict:
    """tok/s at 4 and 8 tokens a step; time_fn gives (mid, slow, fast) ms: the ranges' ends."""
    out = {}
    for tps in (4, 8):
        step, commit, tok_s = cost.block_times(cfg, plan, tps, time_fn, cpu_set, all_rows=True, routing=routing)
        r = lambda x, n: [round(float(x[2]), n), round(float(x[1]), n)]  # noqa: E731 (BOUNDS: mid, fast, slow)
        out[str(tps)] = {"step_ms": round(float(step[0]), 3), "commit_ms": round(float(commit[0]), 3),
                         "tok_s": round(float(tok_s[0]), 1), "tok_s_range": r(tok_s, 1),
                         "step_ms_range": r(step, 3)[::-1], "commit_ms_range": r(commit, 3)[::-1]}  # fmt: skip
    return out


SHARE_THAT_MATTERS = 0.1  # a term below this share of a pass's time does not make it unanchored


def _terms_used(cfg, plan, cpu_set, time_parts, routing) -> dict[str, float]:
    """Each term's share of the first step at 4 tokens a step (all rows masked) and the commit."""
    B = cfg.block_size
    parts: dict[str, float] = {}
    for w in (cost.forward_work(cfg, plan, B, B, cpu_set, routing=routing),
              cost.forward_work(cfg, plan, B, 0, cpu_set, commit=True, routing=routing)):  # fmt: skip
        for k, v in time_parts(w).items():
            parts[k] = parts.get(k, 0.0) + v
    total = sum(parts.values()) or 1.0
    return {k: v / total for k, v in parts.items()}


def make_plan(
    src: Source,
    vram_total: int | None = None,
    ram: int | None = None,
    gpu: str | None = None,
    bandwidth: float | None = None,
    context: int | None = None,
    curves: Curves | None = None,
    calibration: cost.CpuCalibration | None = None,
    kernels: KernelTable | None = None,
    free: int | None = None,
    parallel: int | None = None,
    out_name: str = "clover.gguf",
) -> dict:
    """The plan as a JSON-able dict (schema SCHEMA); format_plan prints it. free: the free VRAM
    as `run --fit` sees it (default: the card's total less a CUDA context); parallel: size the
    state and compute buffer for `serve --parallel N` (N + 1 sequences)."""
    g = find_gpu(gpu) if gpu else None
    dev, dev_note, total, card = _device(g, bandwidth, vram_total, free)
    free = free if free is not None else vram.plan_free_bytes(total)
    cfg = src.config
    n_seq = parallel + 1 if parallel else 1
    curves = (curves or Curves.load()).for_layers(cfg.num_hidden_layers)
    cpu = calibration or cost.CpuCalibration.load()
    key = g.key if g else None
    kern = (kernels or KernelTable()).for_gpu(dev.name, key)
    routing = _routing(src)
    opts, fit = _options(src, free, n_seq, curves)
    rows = []
    for o in opts:
        row = _row(src, o, free, n_seq, ram, dev, kern, cpu, routing, curves, out_name, card)
        if row is not None:
            rows.append(row)
    if any(r["fits"] and r["name"] == "q4_k_m in VRAM" for r in rows):
        rows = [r for r in rows if "all experts on CPU" not in r["name"]]  # splits do not matter here
    same_model = curves.of_model(src.path)
    acct = vram.account(cfg, n_seq)
    return {
        "schema": SCHEMA,
        "model": src.label,
        "config": {
            "layers": cfg.num_hidden_layers,
            "experts": cfg.num_experts,
            "experts_per_tok": cfg.num_experts_per_tok,
            "block_size": cfg.block_size,
            "vocab": cfg.vocab_size,
        },
        "routing": _routing_json(routing, cfg.block_size),
        "device": {
            "name": dev.name,
            "assumed": dev_note or None,
            "vram_bytes": total,
            "free_bytes": free,
            "ram_bytes": ram,
            "bandwidth_gbs": dev.bandwidth_gbs,
            "pcie_raw_gbs": round(dev.pcie_raw_gbs, 1),
            "sm_ghz": round(dev.sm_ghz, 1),
            "tflops": dev.tflops,
        },
        **_speed_json(kern, dev, key, card),
        "context": context,
        "sequences": n_seq,
        "overhead": {**acct.to_dict(), "cuda_context_bytes": total - free},
        "curves": curves.source,
        "kl_label": "predicted" if same_model else "prior",
        "fit": None if fit is None else {"budget_bytes": fit.budget, "table": fit.format(kl_head(same_model))},
        "calibration": f"{cpu.source}, {cpu.threads or '?'} thread(s)",
        "options": rows,
        "recommended": (recommended(rows) or {}).get("name"),
    }


def _routing_json(routing, block_size: int) -> dict:
    return {
        "source": routing.source,
        "measured": routing.measured,
        "block_all_masked": round(routing.fraction(block_size, 1.0), 4),
        "block_commit": round(routing.fraction(block_size, 0.0), 4),
        "one_token": round(routing.fraction(1, 1.0), 4),
    }


def _speed_json(kern: KernelTable, dev: cost.Device, key: str | None, card) -> dict:
    """What the GPU figures stand on: the kernel table's label and terms, what is assumed and
    unanchored, and the copy rates."""
    return {
        "speed_label": kern.label(dev.name, key),
        "speed_range": "low-high: every GPU term at the slow and at the fast end of its sources' spread",
        "kernels": kern.source,
        "arch": card.arch,
        "unanchored": kern.unanchored(card),
        "speed_terms": _speed_terms(kern, dev),
        "assumptions": [k for k, t in kern.terms.items() if t.kind == "assumption"],
        "assumption_notes": {k: v for k, v in PARTIAL_ASSUMPTIONS.items() if kern.terms[k].kind != "calibrated"},
        "copy_gbs": {
            m: {b: round(kern.variant(b).copy(dev.pcie_raw_gbs, m == "pinned")[0], 2) for b in BOUNDS}
            for m in ("pinned", "pageable")
        },
    }


def _speed_terms(kern: KernelTable, dev: cost.Device) -> dict:
    """The kernel table's terms as JSON; the copies' ranges are this device's link's (kernels.copy)."""
    out = {k: t.to_dict() for k, t in kern.terms.items()}
    for m in ("pinned", "pageable"):
        r = {b: kern.variant(b).copy(dev.pcie_raw_gbs, m == "pinned")[0] for b in BOUNDS}
        out[m]["time_range"] = [round(r["mid"] / r["fast"], 3), round(r["mid"] / r["slow"], 3)]
    return out


def _row(src, o: Option, free, n_seq, ram, dev, kern, cpu, routing, curves, out_name, card) -> dict | None:
    cfg = src.config
    whole = _whole(o.plan, cfg, n_seq)
    try:
        p = _place(o.plan, cfg, free, n_seq, o.link, all_cpu=bool(o.cpu_layers))
        if o.kind == "split":
            if not p.cpu_layers:
                return None  # it fits: the in-VRAM row says so
            o.cpu_layers = p.cpu_layers
        fits_vram = (not p.cpu_layers or o.kind == "split") and p.gpu_bytes <= free
    except FitError:
        p, fits_vram = None, False
    if o.hidden_unless_fits and not fits_vram:
        return None
    tensor_bytes = o.plan.total_bytes
    cpu_b = p.cpu_bytes if p and o.kind == "split" else 0
    hdr = header_bytes_estimate(cfg, len(o.plan.entries))
    fits_ram = ram is None or cpu_b + hdr + (1 << 30) <= ram
    cpu_set = frozenset(o.cpu_layers)
    link = o.link
    tables = [kern.variant(b) for b in BOUNDS]

    def time_fn(w):
        return np.array([cost.gpu_ms(w, dev, t, link, cpu) for t in tables])

    shares = _terms_used(cfg, o.plan, cpu_set, lambda w: cost.gpu_costs(w, dev, kern, link, cpu), routing)
    loose = set(kern.unanchored(card))

    kl = curves.predict_recipe(o.types) if o.types is not None else None
    return {
        "name": o.name,
        "kind": o.kind,
        "types": dict(o.types.types) if o.types is not None else None,
        "tensor_bytes": tensor_bytes,
        "file_bytes_est": tensor_bytes + hdr,
        "bpw": round(o.plan.bpw, 4),
        "vram_bytes": (p.gpu_bytes if p else None) if o.kind == "split" else whole,
        "ram_bytes": cpu_b,
        "cpu_expert_layers": o.cpu_layers,
        "host_memory": None if not cpu_set else ("pinned" if link.pinned else "pageable"),
        "op_offload": None if not cpu_set else link.op_offload,
        "fits": bool(fits_vram and fits_ram and p is not None),
        "fits_vram": bool(fits_vram and p is not None),
        "speed": _speed(cfg, o.plan, cpu_set, time_fn, routing),
        "time_shares": {k: round(v, 3) for k, v in sorted(shares.items(), key=lambda x: -x[1]) if v >= 0.005},
        "unanchored": sorted(k for k, v in shares.items() if k in loose and v >= SHARE_THAT_MATTERS),
        "kl_pred": None if kl is None else round(kl, 6),
        **_commands(src, o, out_name),
    }


def kl_head(same_model: bool) -> str:
    return "pred. KL" if same_model else "KL prior"


def recommended(options: list[dict]) -> dict | None:
    """Least predicted KL among the options that keep every weight in VRAM (ties: the faster);
    when none fits in VRAM, the fastest split. Quality decides among in-VRAM options because
    their predicted speeds are close and uncertain, while their KL order is a property of the
    recipes: a bigger card never gets a lossier recommendation, and BF16 wins where it fits."""
    fitting = [o for o in options if o["fits"]]
    whole = [o for o in fitting if o["kind"] in IN_VRAM and o["kl_pred"] is not None]
    if whole:
        return min(whole, key=lambda o: (o["kl_pred"], -o["speed"]["4"]["tok_s"]))
    if not fitting:
        return None
    return max(fitting, key=lambda o: o["speed"]["4"]["tok_s"])


def format_plan(p: dict) -> str:
    dv, c, r = p["device"], p["config"], p["routing"]
    kl = kl_head(p["kl_label"] == "predicted")
    lines = [
        f"plan for {p['model']}: {c['layers']} layers, {c['experts']} experts top-{c['experts_per_tok']}, "
        f"block {c['block_size']}",
        f"device: {dv['name']}, {fmt_bytes(dv['vram_bytes'])} VRAM ({fmt_bytes(dv['free_bytes'])} free after the "
        f"CUDA context), {dv['bandwidth_gbs']:g} GB/s, PCIe {dv['pcie_raw_gbs']:g} GB/s raw"
        + (f", {fmt_bytes(dv['ram_bytes'])} RAM" if dv["ram_bytes"] else ""),
    ]
    if dv["assumed"]:
        lines.append(f"  ({dv['assumed']})")
    o = p["overhead"]
    lines += [
        f"VRAM besides weights: state {fmt_bytes(o['state_bytes'])} ({p['sequences']} sequence(s)), compute buffer "
        f"{fmt_bytes(o['compute_buffer_bytes'])}, llama.cpp's --fit margin {fmt_bytes(o['margin_bytes'])}; "
        f"a split adds the op-offload copy of one expert tensor; token_embd stays in host memory",
        f"routing: a {c['block_size']}-row block touches {100 * r['block_all_masked']:.0f} % of a layer's experts "
        f"when all rows are masked, {100 * r['block_commit']:.0f} % in a commit ({r['source']})",
        "",
        f"{'option':<50} {'fits':<4} {'file':>10} {'bpw':>5} {'VRAM':>10} {'RAM':>10} "
        f"{'tok/s@4':>11} {'tok/s@8':>11} {kl:>9}",
    ]
    for x in p["options"]:
        kl = "" if x["kl_pred"] is None else f"{x['kl_pred']:9.5f}"
        vr = "-" if x["vram_bytes"] is None else fmt_bytes(x["vram_bytes"])
        mark = "†" if x["unanchored"] else " "
        lines.append(
            f"{x['name']:<50} {'yes' if x['fits'] else 'no':<4} {fmt_bytes(x['file_bytes_est']):>10} "
            f"{x['bpw']:5.2f} {vr:>10} {fmt_bytes(x['ram_bytes']):>10} "
            f"{fmt_range(x['speed']['4']['tok_s_range']):>10}{mark} {fmt_range(x['speed']['8']['tok_s_range']):>10}{mark} "
            f"{kl:>9}"
        )
    lines += _footer(p)
    return "\n".join(lines)


def fmt_range(r) -> str:
    """A tok/s range as low-high, to the digits its size needs."""
    lo, hi = r
    return f"{lo:.0f}–{hi:.0f}" if lo >= 10 else f"{lo:.1f}–{hi:.1f}"


def _speed_notes(p: dict) -> list[str]:
    """What the speed ranges stand on: the assumptions, the terms fitted here, the unanchored ones."""
    t = p["speed_terms"]
    lines = [
        f"speed: {p['speed_label']}, each figure low–high: every GPU term at the slow and the fast end of its "
        f"sources' spread (docs/plan.md); GPU kernels {p['kernels']}; CPU terms: {p['calibration']}",
        "  assumptions (no public figure; their assumed bounds are in the ranges): "
        + "; ".join(f"{k} {t[k]['value']:g} ms ({t[k]['source'].split('; assumed ')[-1]})" for k in p["assumptions"]),
        "  fitted here to public figures: " + ", ".join(k for k in t if t[k]["kind"] == "fit"),
    ]
    if any(o["host_memory"] for o in p["options"]):
        c = p["copy_gbs"]
        rates = "; ".join(f"{m} {c[m]['mid']:g} ({c[m]['slow']:g}–{c[m]['fast']:g})" for m in ("pinned", "pageable"))
        lines.append(f"  host copies, GB/s: {rates}")
    notes = p["assumption_notes"]
    lines += [f"  assumption within {k}: {v}" for k, v in notes.items() if k not in ("pinned", "pageable") or
              any(o["host_memory"] for o in p["options"])]  # fmt: skip
    if any(o["unanchored"] for o in p["options"]):
        used = sorted({u for o in p["options"] for u in o["unanchored"]})
        lines.append(f"  † unanchored: no public figure on this GPU's architecture ({p['arch']}) or link for "
                     f"{', '.join(used)}: carried from other architectures by SMs × clock or bandwidth")  # fmt: skip
    return lines


def _footer(p: dict) -> list[str]:
    best = recommended(p["options"])
    lines = [""]
    if best is None:
        lines.append("no option fits this VRAM")
    else:
        lines.append(f"recommended: {best['name']} (least {'predicted KL' if p['kl_label'] == 'predicted' else 'KL prior'}"
                     " among the options that fit in VRAM; else the fastest split)")  # fmt: skip
        lines += [f"  {best[k]}" for k in ("convert", "run", "llama_clover_cli") if best[k]]
        splits = [o for o in p["options"] if o["fits"] and o["kind"] == "split" and o is not best]
        if splits:
            s = max(splits, key=lambda o: o["speed"]["4"]["tok_s"])
            lines += [f"fastest split: {s['name']}"] + [f"  {s[k]}" for k in ("convert", "run") if s[k]]
    if p["fit"]:
        lines += ["", f"fit recipe for {fmt_bytes(p['fit']['budget_bytes'])} of GPU weights:", p["fit"]["table"]]
    kl = (f"predicted KL from {p['curves']} (sensitivity runs of this model)" if p["kl_label"] == "predicted"
          else f"KL prior: {p['curves']} (another model's sensitivity curves, scaled to this depth): it ranks "
               "recipes, it is not this model's KL")  # fmt: skip
    lines += ["", f"quality: {kl}", *_speed_notes(p)]
    return lines
