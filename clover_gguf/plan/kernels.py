"""GPU matmul rates by quant type and rows, for the cost model: seeded from published llama.cpp
measurements, replaced by this project's own when a GPU has run scripts/device_check.sh.

Which CUDA kernel runs (vendored ggml-cuda, see docs/plan.md for file:line):
- quantized weights, more than 8 rows (Clover's 32-row steps and commits): MMQ, for dense
  matmuls and for MUL_MAT_ID alike. Its cost at 16-64 rows is set by the weights it walks
  through, hardly by their bits: llama-bench on an RTX 4090 gives within +-7 % the same tokens/s
  at 16 and at 32 rows for Q4_K_S, Q3_K_S, IQ4_XS, IQ2_S and Q4_0 (the anchors below). So the
  rate is weights per second, scaled from the anchor GPU by SMs x boost clock.
  For MUL_MAT_ID on NVIDIA the tile width follows the block's rows, not the rows per expert
  (mmq.cu: ncols_opt = ne12 except on RDNA3/4): each touched expert costs one tile of the
  block's width, so the rows per expert change only how many experts are touched (routing).
- quantized weights, 8 rows or fewer: MMVQ, bandwidth bound (a fraction of the bandwidth).
- BF16/F16/F32 weights: mmf / cuBLAS, bandwidth bound.

Rates are in G weights/s per (SM x GHz); an anchor "llama 8B ... ub J: X t/s" is a dense
LLaMA-3-8B prompt at microbatch J, which walks 6.98 G weights per microbatch (8.03 G minus the
token embedding and the output matrix, 2 x 128256 x 4096: the output runs once per prompt)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from .gpus import GPU, GPUS

LLAMA3_8B_WEIGHTS_PER_UBATCH = 6.98e9
FLOAT_TYPES = {"f32", "f16", "bf16"}
TILES = (16, 32, 64)  # MMQ tile widths (rows) with seeds


RTX4090 = GPUS["rtx4090"]
RTX3090 = GPUS["rtx3090"]


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
# one check of the SM x clock scaling: RTX 5090 (170 SMs, 2.407 GHz), llama 8B IQ2_S, ub 32:
# 4238.94 t/s (llama.cpp PR #24127) against 988 G weights/s predicted from the 4090 seed: +7 %
SCALING_CHECK = Anchor(
    "iq2_s", 32, 4238.94, GPUS["rtx5090"], "llama.cpp PR #24127 (RTX 5090, llama 8B IQ2_S, ub 32, pp512)"
)

# bandwidth-bound regimes, fraction of the vendor bandwidth
FLOAT_BW = (
    0.840,
    "llama.cpp PR #15131 (RTX 4090, llama 8B BF16, batch 8: 485.16 t/s x 13.96 GB / 8 = 847 GB/s of 1008)",
)
MMVQ_BW = {  # quantized, <= 8 rows: batch-1 figures (nominal bits per weight of the llama-bench label)
    "iq3_s": (0.659, "llama.cpp PR #8215 (RTX 4090, llama 8B IQ3_S 3.4375 bpw, batch 1: 221.34 t/s)"),
    "q4_0": (0.657, "llama.cpp PR #15802 (RTX 3090, llama 8B Q4_0 4.5 bpw, batch 1: 156.56 t/s of 936 GB/s)"),
}
MMVQ_DEFAULT = "q4_0"
# a MUL_MAT_ID tile costs what a dense tile of the same width costs: the same MMQ kernel walks
# each touched expert's weights with the block's tile width (mmq.cu:299-304); no public
# measurement isolates it, device_check.sh measures the ratio
MOE_FACTOR = (1.0, "assumption: mmq.cu runs MUL_MAT_ID as dense tiles per touched expert")
MMQ_MAX_ROWS_MMVQ = 8  # ggml-cuda mmvq.cuh: MMVQ_MAX_BATCH_SIZE


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


@dataclass
class KernelTable:
    """Rates the cost model uses; `source` says seeded or measured."""

    mmq: dict[str, dict[int, tuple[float, str]]] = field(default_factory=_seed_mmq)
    float_bw: tuple[float, str] = FLOAT_BW
    mmvq_bw: dict[str, tuple[float, str]] = field(default_factory=lambda: dict(MMVQ_BW))
    moe_factor: tuple[float, str] = MOE_FACTOR
    measured_on: str | None = None  # GPU name of a device_check run
    source: str = "seeded from published llama.cpp measurements (docs/plan.md)"

    def mmq_rate(self, qtype: str, rows: int) -> float:
        """G weights/s per SM x GHz for a tile of `rows` rows (linear in log2(rows) between seeds)."""
        per = self.mmq.get(qtype) or self.mmq["q4_k"]
        js = sorted(per)
        j = min(max(rows, js[0]), js[-1])
        lo = max(x for x in js if x <= j)
        hi = min(x for x in js if x >= j)
        if lo == hi:
            return per[lo][0]
        f = (math.log2(j) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
        return per[lo][0] + f * (per[hi][0] - per[lo][0])

    def bw_fraction(self, qtype: str) -> float:
        """Fraction of the bandwidth in a bandwidth-bound regime (float types, or <= 8 rows)."""
        if qtype in FLOAT_TYPES:
            return self.float_bw[0]
        return (self.mmvq_bw.get(qtype) or self.mmvq_bw[MMVQ_DEFAULT])[0]

    def label(self, gpu_name: str) -> str:
        """'predicted' until a device check ran; 'measured' on the GPU it ran on."""
        if self.measured_on and self.measured_on.lower() in gpu_name.lower():
            return "calibrated"
        return "predicted"

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
        k["ghz"], bandwidth fractions; each replaces its seed."""
        t = cls()
        sm_ghz = float(k["sms"]) * float(k["ghz"])
        for qt, per in k["mmq"].items():
            for rows, gws in per.items():
                t.mmq.setdefault(qt.lower(), {})[int(rows)] = (float(gws) / sm_ghz, f"measured on {k['gpu']}")
        if k.get("float_bw"):
            t.float_bw = (float(k["float_bw"]), f"measured on {k['gpu']}")
        for qt, f in (k.get("mmvq_bw") or {}).items():
            t.mmvq_bw[qt.lower()] = (float(f), f"measured on {k['gpu']}")
        if k.get("moe_vs_dense"):
            t.moe_factor = (float(k["moe_vs_dense"]), f"measured on {k['gpu']}")
        t.measured_on = k["gpu"]
        t.source = f"measured on {k['gpu']} by scripts/device_check.sh ({where})"
        return t


def seed_table_markdown() -> str:
    """The seeded MMQ rates as docs/plan.md shows them."""
    t = _seed_mmq()
    lines = ["| type | 16 rows | 32 rows | 64 rows | source |", "|---|---|---|---|---|"]
    for qt in sorted(t):
        srcs = sorted({s for _, s in t[qt].values()})
        lines.append(f"| {qt} | " + " | ".join(f"{t[qt][j][0]:.2f}" for j in TILES) + f" | {'; '.join(srcs)} |")
    return "\n".join(lines)
