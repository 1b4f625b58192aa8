"""GPU terms of the cost model, each with its sources and the spread of those sources: seeded
from published measurements, replaced by this project's own when a GPU has run
scripts/device_check.sh (its summary.json, `plan --calibration`).

Which CUDA kernel runs (vendored ggml-cuda, see docs/plan.md for file:line):
- quantized dense weights, more than 8 rows: MMQ. Its cost at 16-64 rows is set by the weights
  it walks through, hardly by their bits: llama-bench on an RTX 4090 gives within +-7 % the same
  tokens/s at 16 and at 32 rows for Q4_K_S, Q3_K_S, IQ4_XS, IQ2_S and Q4_0 (the anchors below).
  So the rate is weights per second, scaled from the anchor GPU by SMs x boost clock.
- routed experts (MUL_MAT_ID), more than 8 rows: also MMQ, but public batched MoE figures show
  it far cheaper per touched weight than a dense matmul of as many rows (plan.public fits it by
  rows per touched expert).
- quantized weights, 8 rows or fewer: MMVQ, bandwidth bound (a fraction of the bandwidth).
- BF16/F16/F32 weights: mmf / cuBLAS, bandwidth bound.

Rates are in G weights/s per (SM x GHz); an anchor "llama 8B ... ub J: X t/s" is a dense
LLaMA-3-8B prompt at microbatch J, which walks 6.98 G weights per microbatch (8.03 G minus the
token embedding and the output matrix, 2 x 128256 x 4096: the output runs once per prompt).

Every term carries `fast` and `slow`: multipliers of the time it contributes, from the spread of
its sources (`Term`); the plan evaluates the model at `mid`, `fast` and `slow` for its ranges."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from .gpus import GPU, GPUS

LLAMA3_8B_WEIGHTS_PER_UBATCH = 6.98e9
FLOAT_TYPES = {"f32", "f16", "bf16"}
TILES = (16, 32, 64)  # MMQ tile widths (rows) with seeds
BOUNDS = ("mid", "fast", "slow")


RTX4090 = GPUS["rtx4090"]
RTX3090 = GPUS["rtx3090"]
RTX5090 = GPUS["rtx5090"]
# vLLM's kernel figures were taken on cards outside the plan's table; only bandwidth is used
A100_PCIE_40GB_GBS = 1555.0  # vendor figure (A100 PCIe 40GB)


@dataclass(frozen=True)
class Anchor:
    """One published figure: dense LLaMA-3-8B tokens/s at microbatch `rows` on `gpu`."""

    qtype: str
    rows: int
    tok_s: float
    gpu: GPU
    source: str  # "llama.cpp PR #7860: RTX 4090, llama 8B Q4_K_S, ub 32"

    @property
    def rate(self) -> float:
        """G weights/s per SM x GHz."""
        return LLAMA3_8B_WEIGHTS_PER_UBATCH * self.tok_s / self.rows / self.gpu.sm_ghz / 1e9


@dataclass(frozen=True)
class Term:
    """A constant of the GPU model: `value`, and the spread of its sources as multipliers of the
    time it contributes (`fast` <= 1 <= `slow`). kind: "measured" (public figures), "fit" (this
    project's fit to public figures), "assumption" (no public figure: assumed bounds), or
    "calibrated" (scripts/device_check.sh on this GPU). archs: the GPU architectures its sources
    measured (gpus.GPU.arch); on others the term is unanchored."""

    name: str
    value: float
    fast: float
    slow: float
    source: str
    kind: str
    archs: frozenset = frozenset()

    def scale(self, bound: str) -> float:
        return {"mid": 1.0, "fast": self.fast, "slow": self.slow}[bound]

    def to_dict(self) -> dict:
        """As `plan --json` prints it (the copies' ranges depend on the link: planner._speed_terms)."""
        return {"value": self.value, "time_range": [round(self.fast, 3), round(self.slow, 3)], "kind": self.kind,
                "source": self.source, "archs": sorted(self.archs)}  # fmt: skip


MMQ_ANCHORS = [
    Anchor("q4_k", 16, 1946.01, RTX4090, "llama.cpp PR #7860 (RTX 4090, llama 8B Q4_K_S, ub 16, pp2048)"),
    Anchor("q4_k", 32, 3358.03, RTX4090, "llama.cpp PR #7860 (RTX 4090, llama 8B Q4_K_S, ub 32, pp2048)"),
    Anchor("q4_k", 64, 5349.26, RTX4090, "llama.cpp PR #7860 (RTX 4090, llama 8B Q4_K_S, ub 64, pp2048)"),
    Anchor("iq4_xs", 16, 1970.30, RTX4090, "llama.cpp PR #8278 (RTX 4090, llama 8B IQ4_XS, ub 16, pp2048)"),
    Anchor("iq4_xs", 32, 3417.54, RTX4090, "llama.cpp PR #8278 (RTX 4090, llama 8B IQ4_XS, ub 32, pp2048)"),
    Anchor("iq4_xs", 63, 5407.20, RTX4090, "llama.cpp PR #8278 (RTX 4090, llama 8B IQ4_XS, ub 63, pp2048)"),
    Anchor("iq2_s", 32, 3573.84, RTX4090, "llama.cpp PR #8495 (RTX 4090, llama 8B IQ2_S, ub 32, pp2048)"),
    Anchor("iq2_s", 64, 5693.41, RTX4090, "llama.cpp PR #8495 (RTX 4090, llama 8B IQ2_S, ub 64, pp2048)"),
    Anchor("q3_k", 16, 1938.69, RTX4090, "llama.cpp PR #8062 (RTX 4090, llama 8B Q3_K_S, ub 16, pp2048)"),
]
# Q6_K has RTX 3090 figures only: used as a ratio to IQ4_XS on the same card and PR series
Q6K_3090 = {16: 1011.44, 32: 1715.38}  # llama.cpp PR #8062 (RTX 3090, llama 8B Q6_K)
IQ4XS_3090 = {16: 1112.37, 32: 1839.03}  # llama.cpp PR #8416 (RTX 3090, llama 8B IQ4_XS)
# SMs x clock scaling, checked within one build (llama.cpp PR #24127, llama 8B IQ2_S, ub 32,
# pp512): the RTX 5090 reaches 0.86 of what SMs x clock predicts from the same build's RTX 4090;
# and that build's RTX 4090 is 1.08x PR #8495's 2024 build (the seed)
SCALING_CHECK = Anchor("iq2_s", 32, 4238.94, RTX5090, "llama.cpp PR #24127 (RTX 5090, llama 8B IQ2_S, ub 32, pp512)")
SCALING_BASE = Anchor("iq2_s", 32, 3875.70, RTX4090, "llama.cpp PR #24127 (RTX 4090, llama 8B IQ2_S, ub 32, pp512)")
CARD_TRANSFER = SCALING_CHECK.rate / SCALING_BASE.rate  # 0.862
BUILD_DRIFT = SCALING_BASE.rate / MMQ_ANCHORS[6].rate  # 1.084: the same card, a 2026 build against 2024's

# bandwidth-bound regimes, fraction of the vendor bandwidth. BF16 dense: llama.cpp on an RTX
# 4090; MoE at 32 rows: vLLM's fused-MoE kernel on data-centre cards (touched experts' bytes /
# kernel time / vendor bandwidth, uniform random routing as benchmark_moe.py draws it)
FLOAT_BW = (
    0.840,
    "llama.cpp PR #15131 (RTX 4090, llama 8B BF16, batch 8: 485.16 t/s x 13.96 GB / 8 = 847 GB/s of 1008)",
)
MMVQ_BW = {  # quantized, <= 8 rows: batch-1 figures (nominal bits per weight of the llama-bench label)
    "iq3_s": (0.659, "llama.cpp PR #8215 (RTX 4090, llama 8B IQ3_S 3.4375 bpw, batch 1: 221.34 t/s)"),
    "q4_0": (0.657, "llama.cpp PR #15802 (RTX 3090, llama 8B Q4_0 4.5 bpw, batch 1: 156.56 t/s of 936 GB/s)"),
}
MMVQ_DEFAULT = "q4_0"
MMQ_MAX_ROWS_MMVQ = 8  # ggml-cuda mmvq.cuh: MMVQ_MAX_BATCH_SIZE


@dataclass(frozen=True)
class MoeKernelFigure:
    """A vLLM fused-MoE kernel time (benchmark_moe.py: both expert matmuls of one layer, random
    routing), converted to a fraction of the card's bandwidth over the touched experts' bytes."""

    what: str
    experts: int
    top_k: int
    d: int
    n: int  # vLLM's N: the intermediate size per rank
    bytes_per_weight: float
    batch: int
    us: float
    bandwidth_gbs: float
    arch: str
    source: str

    @property
    def fraction(self) -> float:
        touched = self.experts * (1 - (1 - self.top_k / self.experts) ** self.batch)
        return touched * 3 * self.n * self.d * self.bytes_per_weight / (self.us * 1e3) / self.bandwidth_gbs


VLLM_MOE = [
    MoeKernelFigure("Qwen3-30B-A3B BF16, A100 PCIe 40GB", 128, 8, 2048, 768, 2, 32, 808.53, A100_PCIE_40GB_GBS,
                    "ampere-dc", "vLLM PR #19049 (A100 PCIe 40GB, E=128 N=768 BF16, batch 32, default config: 808.53 us)"),
    MoeKernelFigure("Mixtral BF16 tp=2, H100", 8, 2, 4096, 7168, 2, 32, 487.35, GPUS["h100-sxm"].bandwidth_gbs,
                    "hopper", "vLLM PR #24700 (H100 80GB HBM3, E=8 N=7168 BF16, batch 32, tuned: 487.35 us)"),
    MoeKernelFigure("Qwen3-30B-A3B FP8, H100", 128, 8, 2048, 768, 1, 32, 238.37, GPUS["h100-sxm"].bandwidth_gbs,
                    "hopper", "vLLM PR #24700 (H100 80GB HBM3, E=128 N=768 FP8 w8a8, batch 32, main: 238.37 us)"),
]  # fmt: skip

# Host-to-device copies, NVlabs/cuda-oxide PR #976 (RTX 4090, PCIe 4.0 x16, 31.5 GB/s raw):
# pinned 22.51 GB/s at 1 MiB, 23.9 at 16-64 MiB; pageable 13.73 at 1 MiB, 18.42 at 16 MiB,
# 12.88 at 64 MiB. As rate + cost per call (this project's two-point fit, 1 and 16 MiB): pinned
# 23.9 GB/s (0.76 of raw) + 2.7 us, pageable 18.4 GB/s (0.58 of raw) + 19 us.
PCIE_GEN4_RAW_GBS = 31.5
PINNED_GBS, PINNED_CALL_MS = 23.9, 0.0027
PAGEABLE_GBS, PAGEABLE_CALL_MS, PAGEABLE_64MIB_GBS = 18.42, 0.019, 12.88
PCIE_PINNED_FRACTION = PINNED_GBS / PCIE_GEN4_RAW_GBS
PCIE_PAGEABLE_FRACTION = PAGEABLE_GBS / PCIE_GEN4_RAW_GBS


# no public figure: value and assumed bounds (ms), labelled as assumptions wherever printed
ASSUMED = {
    "pass": (0.1, 0.05, 0.5, "the runtime's call, the candidates' readback and host work per pass, beyond what a "
             "llama-bench ubatch has (that is in the per-layer fit)"),
    "sync": (0.02, 0.01, 0.05, "one GPU synchronisation (before a split input is overwritten; the ids read back)"),
}  # fmt: skip


# assumptions inside a measured term (the plan prints them with the term's range)
PARTIAL_ASSUMPTIONS = {
    "mmq": "q5_k, q8_0 and iq3_s take q4_k's MMQ rates (no public figure at 16-64 rows), and beyond 64 rows a "
    "matmul costs column tiles of 64",
    "pinned": "pinned copies on PCIe 5.0 are not measured: from the PCIe 4.0 rate to the same fraction of PCIe 5.0",
    "pageable": "pageable copies on links faster than PCIe 4.0 are not measured: the middle figure keeps one PCIe "
    "4.0 system's 18.4 GB/s cap, the slow end is its 64 MiB rate, the fast end its 16 MiB fraction of the link",
}
PCIE4 = frozenset({"pcie4"})  # the copy figures' one system: anchored by link generation, not GPU


def _archs(*gpus: GPU) -> frozenset:
    return frozenset(g.arch for g in gpus)


def _seed_mmq() -> dict[str, dict[int, tuple[float, str]]]:
    """type -> tile rows -> (rate, source); types without an anchor get q4_k's, said so."""
    t: dict[str, dict[int, tuple[float, str]]] = {}
    for a in MMQ_ANCHORS:
        t.setdefault(a.qtype, {})[min(TILES, key=lambda j: abs(j - a.rows))] = (a.rate, a.source)
    q4 = t["q4_k"]

    def shape_like_q4(qt: str, why: str) -> None:
        have = t[qt]
        base_j = next(iter(have))
        for j in TILES:
            if j not in have:
                have[j] = (have[base_j][0] * q4[j][0] / q4[base_j][0], f"{why}; {j}-row value scaled as q4_k's")

    shape_like_q4("iq2_s", "llama.cpp PR #8495")
    shape_like_q4("q3_k", "llama.cpp PR #8062")
    iq4 = t["iq4_xs"]
    t["q6_k"] = {
        j: (
            iq4[j][0] * Q6K_3090[j] / IQ4XS_3090[j],
            "llama.cpp PRs #8062/#8416: Q6_K / IQ4_XS on an RTX 3090, x IQ4_XS",
        )
        for j in (16, 32)
    }
    t["q6_k"][64] = (t["q6_k"][32][0] * q4[64][0] / q4[32][0], "as the 32-row value, scaled as q4_k's")
    for qt in ("q5_k", "q8_0", "iq3_s"):
        t.setdefault(qt, {j: (q4[j][0], "no public anchor found: q4_k's value") for j in TILES})
    return t


def _float_term() -> Term:
    fr = [f.fraction for f in VLLM_MOE]
    lo, hi = min(fr + [FLOAT_BW[0]]), max(fr + [FLOAT_BW[0]])
    src = "; ".join([FLOAT_BW[1]] + [f"{f.source} = {f.fraction:.3f} of the bandwidth" for f in VLLM_MOE])
    return Term("float_bw", FLOAT_BW[0], FLOAT_BW[0] / hi, FLOAT_BW[0] / lo, src, "measured",
                frozenset({RTX4090.arch} | {f.arch for f in VLLM_MOE}))  # fmt: skip


# public.py's fit (layer_and_moe_fit) of the per-layer and MoE terms to public figures, kept as
# numbers: the fit runs the cost model, which stands on this module.
# tests/plan/test_public_gpu.py::test_the_stored_fit_is_the_fit refits and compares.
FIT_LAYER = (13.2059324, 0.7204654, 1.3115089)  # ms x SM x GHz per layer; the spread (fast, slow)
FIT_LAYER_ARCHS = frozenset({"ampere", "ada", "blackwell"})
FIT_MOE_AB = (0.15742074, 0.02251562)  # 1 / rate = a + b x rows per touched expert
FIT_MOE_SPREAD = (0.9268275, 1.1890107)
FIT_MOE_ARCHS = frozenset({"ampere", "ada"})


def _fit_terms() -> tuple[Term, Term]:
    c, lo, hi = FIT_LAYER
    a, b = FIT_MOE_AB
    layer = Term("layer", c, lo, hi,
                 "fit (plan/public.py): the time a 1-row figure leaves after its weights' and KV cache's bandwidth "
                 "terms, per layer x SMs x GHz, geometric mean of 6 figures: llama.cpp PRs #15631, #15525, #19057, "
                 "ik_llama.cpp PR #1593, noonghunna/club-3090 #390", "fit", FIT_LAYER_ARCHS)  # fmt: skip
    moe = Term("moe", 1.0, *FIT_MOE_SPREAD,
               f"fit (plan/public.py): 1 / rate = {a:.3f} + {b:.4f} x rows per touched expert (G weights/s per SM x "
               "GHz), 7 batched figures: llama.cpp PR #15631 (RTX 4090, Qwen3-30B-A3B Q4_0, 16/32/64 rows), PR #15525 "
               "(RTX 3090, DeepSeek-V2-Lite Q4_0, 16/32/64/128 rows)", "fit", FIT_MOE_ARCHS)  # fmt: skip
    return layer, moe


def _seed_terms() -> dict[str, Term]:
    layer_term, moe_term = _fit_terms()
    mmq_gpus = {a.gpu for a in MMQ_ANCHORS} | {RTX3090, SCALING_CHECK.gpu}
    v = [x[0] for x in MMVQ_BW.values()]
    terms = [
        Term("mmq", 1.0, 1 / BUILD_DRIFT, 1 / CARD_TRANSFER,
             f"{len(MMQ_ANCHORS)} llama.cpp llama-bench figures (PRs #7860, #8278, #8495, #8062, #8416), RTX 4090/3090; "
             f"spread: another card at {CARD_TRANSFER:.2f}x the SMs x clock prediction (PR #24127, RTX 5090 against the "
             f"same build's RTX 4090), a newer build {BUILD_DRIFT:.2f}x the seed (PR #24127's RTX 4090 against #8495's)",
             "measured", _archs(*mmq_gpus)),
        moe_term,
        _float_term(),
        Term("mmvq_bw", 1.0, min(v) / max(v), max(v) / min(v), "; ".join(s for _, s in MMVQ_BW.values()),
             "measured", _archs(RTX4090, RTX3090)),
        layer_term,
        *(Term(k, v, lo / v, hi / v, f"assumption: {why}; assumed {lo:g}-{hi:g} ms", "assumption")
          for k, (v, lo, hi, why) in ASSUMED.items()),
        Term("pinned", PCIE_PINNED_FRACTION, 1.0, 1.0,
             "NVlabs/cuda-oxide PR #976 (RTX 4090, PCIe 4.0 x16: 23.9 GB/s at 16-64 MiB); on PCIe 5.0 not measured: "
             "between the PCIe 4.0 rate and the same fraction of PCIe 5.0", "measured", PCIE4),
        Term("pageable", PCIE_PAGEABLE_FRACTION, 1.0, 1.0,
             "NVlabs/cuda-oxide PR #976 (RTX 4090, PCIe 4.0 x16: 18.42 GB/s at 16 MiB, 12.88 at 64 MiB); the cap at "
             "18.4 GB/s on faster links is an assumption (one PCIe 4.0 system): from 12.88 GB/s to the 16 MiB "
             "fraction of the link", "measured", PCIE4),
        Term("copy_call", PAGEABLE_CALL_MS, 1.0, 1.0,
             "this project's two-point fit (1 and 16 MiB) to NVlabs/cuda-oxide PR #976: pinned 2.7 us, pageable "
             "19 us a call", "fit", PCIE4),
    ]  # fmt: skip
    return {t.name: t for t in terms}


@dataclass
class KernelTable:
    """Rates and constants the cost model uses, each with its spread (`terms`); `bound` says which
    end of the spreads this table stands for; `source` says seeded or measured."""

    mmq: dict[str, dict[int, tuple[float, str]]] = field(default_factory=_seed_mmq)
    float_bw: tuple[float, str] = FLOAT_BW
    mmvq_bw: dict[str, tuple[float, str]] = field(default_factory=lambda: dict(MMVQ_BW))
    terms: dict[str, Term] = field(default_factory=lambda: dict(_seed_terms_cached()))
    # MUL_MAT_ID: 1 / rate = a + b x rows per touched expert (plan.public's fit), times a measured
    # factor per type once a device check has run
    moe_ab: tuple[float, float] = FIT_MOE_AB
    moe_measured: dict[str, float] = field(default_factory=dict)  # type -> measured / fit
    layer_c: float = field(default_factory=lambda: _seed_terms_cached()["layer"].value)  # ms x SM x GHz per layer
    copy_measured: dict | None = None  # {"pinned": (GB/s, ms a call), "pageable": ...} of the measured system
    bound: str = "mid"
    measured_on: str | None = None  # GPU name of a device_check run
    measured_key: str | None = None  # its entry in the GPU table (device_check.py's table_entry)
    source: str = "seeded from published measurements (docs/plan.md)"

    def variant(self, bound: str) -> KernelTable:
        """This table at one end of its terms' spreads ("fast", "slow") or at their values ("mid")."""
        assert bound in BOUNDS
        return replace(self, bound=bound)

    def s(self, term: str) -> float:
        """Multiplier of the time `term` contributes at this table's bound."""
        return self.terms[term].scale(self.bound)

    def mmq_rate(self, qtype: str, rows: int) -> float:
        """G weights/s per SM x GHz for a tile of `rows` rows (linear in log2(rows) between seeds)."""
        per = self.mmq.get(qtype) or self.mmq["q4_k"]
        js = sorted(per)
        j = min(max(rows, js[0]), js[-1])
        lo = max(x for x in js if x <= j)
        hi = min(x for x in js if x >= j)
        if lo == hi:
            r = per[lo][0]
        else:
            f = (math.log2(j) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
            r = per[lo][0] + f * (per[hi][0] - per[lo][0])
        return r / self.s("mmq")

    def moe_rate(self, qtype: str, per_expert: float) -> float:
        """MUL_MAT_ID, G touched weights/s per SM x GHz at `per_expert` rows per touched expert
        (more than 8 rows in all): the public fit, the type's dense ratio to q4_k's (bits hardly
        matter to MMQ), and a device check's measured factor."""
        a, b = self.moe_ab
        r = 1.0 / (a + b * max(per_expert, 1.0)) * _seed_type_factor().get(qtype, 1.0)
        r *= self.moe_measured.get(qtype, self.moe_measured.get("*", 1.0))
        return r / self.s("moe")

    def bw_fraction(self, qtype: str) -> float:
        """Fraction of the bandwidth in a bandwidth-bound regime (float types, or <= 8 rows)."""
        if qtype in FLOAT_TYPES:
            return self.float_bw[0] / self.s("float_bw")
        return (self.mmvq_bw.get(qtype) or self.mmvq_bw[MMVQ_DEFAULT])[0] / self.s("mmvq_bw")

    def layer_ms(self, sm_ghz: float) -> float:
        """Per layer and pass, what is not a weight matmul (norms, rope, routing, attention
        kernels, launches): fitted as ms x SM x GHz, so a faster GPU runs it faster."""
        return self.layer_c / sm_ghz * self.s("layer")

    @property
    def pass_ms(self) -> float:
        return self.terms["pass"].value * self.s("pass")

    @property
    def sync_ms(self) -> float:
        return self.terms["sync"].value * self.s("sync")

    def copy(self, raw_gbs: float, pinned: bool) -> tuple[float, float]:
        """(GB/s, ms a call) of host-to-device copies over a link of `raw_gbs`. A measured
        system's own figures when a device check ran (calibrated GPUs only: see for_gpu)."""
        if self.copy_measured:
            return tuple(self.copy_measured["pinned" if pinned else "pageable"])
        pin_mid = PCIE_PINNED_FRACTION * raw_gbs
        if pinned:
            # PCIe 4.0 measured; a faster link between the 4.0 rate and the same fraction of it
            rate = {"mid": pin_mid, "fast": pin_mid, "slow": min(pin_mid, PINNED_GBS)}[self.bound]
            return rate, PINNED_CALL_MS
        mid = min(PCIE_PAGEABLE_FRACTION * raw_gbs, PAGEABLE_GBS)
        rate = {"mid": mid, "fast": PCIE_PAGEABLE_FRACTION * raw_gbs, "slow": min(mid, PAGEABLE_64MIB_GBS)}
        return rate[self.bound], PAGEABLE_CALL_MS

    def unanchored(self, gpu: GPU) -> list[str]:
        """Terms with sources (not assumptions) none of which measured this GPU's architecture (or,
        for host copies, its PCIe generation)."""
        tags = {gpu.arch, f"pcie{gpu.pcie_gen}"}
        return [t.name for t in self.terms.values() if t.kind in ("measured", "fit") and not tags & t.archs]

    def for_gpu(self, gpu_name: str, key: str | None = None) -> KernelTable:
        """The table for a plan on `gpu_name`: a device check's figures on another GPU carry to
        this one by SMs x clock, with the card-to-card spread; its copy figures do not carry."""
        if not self.measured_on or self.label(gpu_name, key) == "calibrated":
            return self
        terms = dict(self.terms)
        for k in ("mmq", "moe"):
            terms[k] = replace(terms[k], fast=1.0, slow=1 / CARD_TRANSFER, kind="measured",
                               source=f"{terms[k].source}; on another GPU by SMs x clock (PR #24127's spread)")  # fmt: skip
        return replace(self, terms=terms, copy_measured=None)

    def label(self, gpu_name: str, key: str | None = None) -> str:
        """'predicted' until a device check ran; 'calibrated' on the GPU it ran on (by the GPU
        table's key when both are known, else by name)."""
        if not self.measured_on:
            return "predicted"
        if key and self.measured_key:
            return "calibrated" if key == self.measured_key else "predicted"
        return "calibrated" if _same_card(self.measured_on, gpu_name) else "predicted"

    @classmethod
    def load(cls, summary: Path | None) -> KernelTable:
        """The seeds, or the device check's kernel rates (summary.json's "kernels") replacing them."""
        if summary is None:
            return cls()
        from .sizes import PlanError

        try:
            d = json.loads(Path(summary).read_text())
        except (OSError, ValueError) as e:
            raise PlanError(f"{summary}: cannot read a device check summary ({e})") from None
        k = d.get("kernels") if isinstance(d, dict) else None
        if not k or not k.get("mmq"):
            raise PlanError(f'{summary}: no "kernels" section (run scripts/device_check.sh with the kernels stage)')
        try:
            return cls.from_kernels(k, str(summary))
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f'{summary}: "kernels" lacks or mangles {e}') from None

    @classmethod
    def from_kernels(cls, k: dict, where: str) -> KernelTable:
        """device_check.py's kernels.json: G weights/s by type and rows on a GPU of k["sms"] SMs at
        k["ghz"] (dense "mmq"; MUL_MAT_ID "moe" by rows per touched expert), bandwidth fractions,
        host copies; each replaces its seed and its range."""
        t = cls()
        gpu = k["gpu"]
        sm_ghz = float(k["sms"]) * float(k["ghz"])
        at = f"measured on {gpu}"
        terms = dict(t.terms)

        def calibrated(name: str, value: float | None = None) -> None:
            old = terms[name]
            terms[name] = Term(name, old.value if value is None else value, 1.0, 1.0, f"{at} ({where})", "calibrated",
                               old.archs)  # fmt: skip

        for qt, per in k["mmq"].items():
            for rows, gws in per.items():
                t.mmq.setdefault(qt.lower(), {})[int(rows)] = (float(gws) / sm_ghz, at)
        calibrated("mmq")
        if k.get("moe"):
            ratios: dict[str, list[float]] = {}
            for qt, per in k["moe"].items():
                for rho, gws in per.items():
                    fit = t.variant("mid").moe_rate(qt.lower(), float(rho))
                    ratios.setdefault(qt.lower(), []).append(float(gws) / sm_ghz / fit)
            t.moe_measured = {qt: _median(v) for qt, v in ratios.items()}
            t.moe_measured["*"] = _median([x for v in ratios.values() for x in v])
            calibrated("moe")
        if k.get("float_bw"):
            t.float_bw = (float(k["float_bw"]), at)
            calibrated("float_bw")
        for qt, f in (k.get("mmvq_bw") or {}).items():
            t.mmvq_bw[qt.lower()] = (float(f), at)
        if k.get("mmvq_bw"):
            calibrated("mmvq_bw")
        cp = k.get("copy") or {}
        if cp.get("pinned") and cp.get("pageable"):
            t.copy_measured = {m: (float(cp[m]["gbs"]), float(cp[m]["call_ms"])) for m in ("pinned", "pageable")}
            for m in ("pinned", "pageable", "copy_call"):
                calibrated(m)
        t.terms = terms
        t.measured_on = gpu
        t.measured_key = k.get("table_entry")
        t.source = f"measured on {gpu} by scripts/device_check.sh ({where})"
        return t


def _median(v: list[float]) -> float:
    v = sorted(v)
    return (v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2


def _same_card(a: str, b: str) -> bool:
    """'NVIDIA H200' (nvidia-smi) and 'H200 SXM' (the table) name the same card."""
    norm = lambda s: s.lower().replace("nvidia", "").replace("geforce", "").replace(" ", "")  # noqa: E731
    x, y = norm(a), norm(b)
    return bool(x) and bool(y) and (x in y or y in x)


@lru_cache(maxsize=1)
def _seed_type_factor() -> dict[str, float]:
    """A type's seeded 32-row MMQ rate over q4_k's (the fit's Q4_0 counts as q4_k): within +-7 %."""
    t = _seed_mmq()
    return {qt: per[32][0] / t["q4_k"][32][0] for qt, per in t.items()}


@lru_cache(maxsize=1)
def _seed_terms_cached() -> dict[str, Term]:
    return _seed_terms()


def seed_table_markdown() -> str:
    """The seeded MMQ rates as docs/plan.md shows them."""
    t = _seed_mmq()
    lines = ["| type | 16 rows | 32 rows | 64 rows | source |", "|---|---|---|---|---|"]
    for qt in sorted(t):
        srcs = sorted({s for _, s in t[qt].values()})
        lines.append(f"| {qt} | " + " | ".join(f"{t[qt][j][0]:.2f}" for j in TILES) + f" | {'; '.join(srcs)} |")
    return "\n".join(lines)
