"""The plan's cost functions on the shapes of models with public llama.cpp measurements, and the
two terms fitted to them (docs/plan.md, "The GPU model against public measurements").

A public figure is a llama-bench or server run of a standard MoE model: `Measurement` says which
model, card, file types, rows a pass (1 for token generation, the microbatch for prompt
processing) and context depth; `work` turns it into the same `cost.Work` a Clover pass is (weight
matrices by type and rows, MUL_MAT_ID by rows per touched expert, the KV cache or recurrent state
a pass reads, host-resident experts), and `cost.gpu_ms` prices it. Routing is the uniform formula
(llama-bench's prompts are real text, which touches fewer experts: docs/plan.md).

Fitted here, from FIT_SERIES:
- `layer`: what a layer costs besides its weight matmuls (norms, rope, routing, the launches), in
  ms x SM x GHz, from every 1-row figure: the time left after the weights' and the KV cache's
  bandwidth terms. Its value is their geometric mean, its range their spread;
- `moe`: MUL_MAT_ID's rate by rows per touched expert, 1 / rate = a + b x rows, least squares on
  two llama.cpp PRs' batched series (16-128 rows, one build era) after the other terms. Its range
  is the fit's residual spread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from . import cost
from .gpus import GPU, GPUS
from .kernels import ASSUMED, KernelTable, Term
from .routing import uniform


@dataclass(frozen=True)
class Shape:
    """A public MoE model's matrices (weights per matrix), as its config.json gives them."""

    key: str
    name: str
    layers: int
    hidden: int
    experts: int
    top_k: int
    expert_ff: int
    attn: tuple[int, ...]  # a full-attention layer's projections
    vocab: int
    kv_per_pos: int  # f16 KV cache bytes per position of a full-attention layer
    linear: tuple[int, ...] = ()  # a linear-attention (gated delta net) layer's projections
    full_every: int = 1  # every n-th layer is full attention, the others linear
    linear_state: int = 0  # f32 recurrent state bytes of a linear layer (read and written a pass)
    window: tuple[int, int] = (0, 0)  # (layers with a sliding window, its width)
    shared: int = 0  # shared expert weights a layer
    dense_ffn: tuple[int, int] = (0, 0)  # (leading layers with a dense FFN instead of experts, its weights)
    source: str = ""

    def is_full(self, layer: int) -> bool:
        return not self.linear or layer % self.full_every == self.full_every - 1

    @property
    def weights(self) -> float:
        n_full = sum(self.is_full(i) for i in range(self.layers))
        n_moe = self.layers - self.dense_ffn[0]
        return (n_full * sum(self.attn) + (self.layers - n_full) * sum(self.linear) + self.layers * self.shared
                + n_moe * (self.experts * 3 * self.hidden * self.expert_ff + self.experts * self.hidden)
                + self.dense_ffn[0] * self.dense_ffn[1] + 2 * self.vocab * self.hidden)  # fmt: skip


QWEN3_30B = Shape(
    "qwen3-30b-a3b", "Qwen3-30B-A3B", 48, 2048, 128, 8, 768,
    attn=(2048 * 4096, 2048 * 512, 2048 * 512, 4096 * 2048), vocab=151936, kv_per_pos=2 * 4 * 128 * 2,
    source="config.json: 48 layers, d 2048, 32 heads / 4 KV of 128, 128 experts top-8 of 768 (as llama.cpp prints "
           "it in ollama/ollama#10458), vocab 151936",
)  # fmt: skip
DEEPSEEK_V2_LITE = Shape(
    "deepseek-v2-lite", "DeepSeek-V2-Lite (deepseek2 16B)", 27, 2048, 64, 6, 1408,
    # MLA without a q LoRA: q 16 x 192, kv_a 512 + 64, kv_b 16 x (128 + 128), o
    attn=(2048 * 3072, 2048 * 576, 512 * 4096, 2048 * 2048), vocab=102400, kv_per_pos=576 * 2,
    shared=3 * 2048 * 2816, dense_ffn=(1, 3 * 2048 * 10944),
    source="config.json: 27 layers, d 2048, 16 heads (MLA, kv rank 512, rope 64), 64 experts top-6 of 1408 + 2 "
           "shared, first layer dense (10944), vocab 102400: 15.7 G weights",
)  # fmt: skip
QWEN35_35B = Shape(
    "qwen3.5-35b-a3b", "Qwen3.5/3.6-35B-A3B", 40, 2048, 256, 8, 512,
    # full attention (every 4th layer): q with its output gate 2 x 16 x 256, k, v 2 x 256, o;
    # gated delta net: qkvz 2 x 16 x 128 + 2 x 32 x 128, ba 2 x 32, out 32 x 128
    attn=(2048 * 8192, 2048 * 512, 2048 * 512, 4096 * 2048), vocab=248320, kv_per_pos=2 * 2 * 256 * 2,
    linear=(2048 * 12288, 2048 * 64, 4096 * 2048), full_every=4, linear_state=2 * 32 * 128 * 128 * 4,
    shared=3 * 2048 * 512 + 2048,
    source="config.json as recalled (not re-fetched here): 40 layers, d 2048, full attention every 4th (16 heads / "
           "2 KV of 256, gated), else gated delta net (16 key / 32 value heads of 128), 256 experts top-8 of 512 + "
           "1 shared, vocab 248320 (d, heads, layers and vocab as llama.cpp prints them in llama.cpp#22673)",
)  # fmt: skip
GPT_OSS_120B = Shape(
    "gpt-oss-120b", "gpt-oss-120b", 36, 2880, 128, 4, 2880,
    attn=(2880 * 4096, 2880 * 512, 2880 * 512, 4096 * 2880), vocab=201088, kv_per_pos=2 * 8 * 64 * 2,
    window=(18, 128),
    source="config.json: 36 layers, d 2880, 64 heads / 8 KV of 64, every other layer a 128-token window, 128 "
           "experts top-4 of 2880, vocab 201088: 116.8 G weights",
)  # fmt: skip
GPT_OSS_20B = Shape(
    "gpt-oss-20b", "gpt-oss-20b", 24, 2880, 32, 4, 2880,
    attn=GPT_OSS_120B.attn, vocab=201088, kv_per_pos=GPT_OSS_120B.kv_per_pos, window=(12, 128),
    source="config.json: gpt-oss-120b's layer with 24 layers and 32 experts top-4: 20.9 G weights",
)  # fmt: skip
SHAPES = {s.key: s for s in (QWEN3_30B, DEEPSEEK_V2_LITE, QWEN35_35B, GPT_OSS_120B, GPT_OSS_20B)}

# file types by group; llama.cpp's Q4_0 file keeps output.weight at Q6_K and the router at F32
Q4_0_FILE = {"experts": "q4_0", "attention": "q4_0", "shared": "q4_0", "dense": "q4_0", "output": "q6_k"}
IQ3_S_EXPERTS = {"experts": "iq3_s", "attention": "q8_0", "shared": "q8_0", "dense": "q8_0", "output": "q6_k"}
MXFP4_MOE = {"experts": "mxfp4", "attention": "q8_0", "shared": "q8_0", "dense": "q8_0", "output": "q8_0"}


@dataclass(frozen=True)
class Measurement:
    """A public tokens/s figure: `rows` a pass (a prompt's microbatch, or 1 for token generation),
    at a mean context `depth`, with the first `host_layers` layers' experts in host memory."""

    what: str
    shape: Shape
    gpu: GPU
    types: dict = field(hash=False)
    rows: int
    depth: int
    tok_s: float
    source: str
    host_layers: int = 0
    pinned: bool = False  # host experts: mmap (pageable, the default) or --no-mmap
    generating: bool = False  # token generation (logits every pass); a prompt has the last token's only

    @property
    def lm_rows(self) -> int:
        return 1 if self.generating else 0

    def work(self) -> cost.Work:
        return work(self.shape, self.types, self.rows, self.depth, self.lm_rows, self.host_layers)

    def pass_ms(self, kern: KernelTable) -> float:
        return cost.gpu_ms(self.work(), device(self.gpu), kern, cost.HostLink(True, self.pinned), cost.CpuCalibration())

    def predict(self, kern: KernelTable) -> dict[str, float]:
        """tokens/s at the middle and both ends of the kernel table's ranges."""
        return {b: float(self.rows / self.pass_ms(kern.variant(b)) * 1e3) for b in ("mid", "slow", "fast")}


def device(g: GPU) -> cost.Device:
    return cost.Device(g.name, g.bandwidth_gbs, g.tflops, g.pcie_raw_gbs, g.sm_ghz)


def _bpw(qtype: str) -> float:
    from ..convert import quants

    return quants.bits_per_weight(quants.parse_type(qtype)) / 8


def work(shape: Shape, types: dict, T: int, depth: int, lm_rows: int, host_layers: int = 0) -> cost.Work:
    """One pass over T rows at a context of `depth`, as the cost model prices a Clover pass."""
    d, E, k = shape.hidden, shape.experts, shape.top_k
    w = cost.Work(n_layers=shape.layers, rows=T, hidden=d)
    frac = uniform(k, E, T)
    per_expert = cost.rows_per_expert(T, k, E, frac)
    n_exp = E * d * shape.expert_ff  # one of gate, up, down
    exp_macs = T * k * 3 * d * shape.expert_ff

    def dense(n: float, group: str) -> None:
        w.mats.append(cost.Mat(n, n * _bpw(types[group]), types[group], T))
        w.macs += T * n

    kv = 0.0
    for i in range(shape.layers):
        full = shape.is_full(i)
        for n in shape.attn if full else shape.linear:
            dense(n, "attention")
        if full:
            windowed = i % 2 == 0 and i // 2 < shape.window[0]
            kv += (min(depth, shape.window[1]) if windowed else depth) * shape.kv_per_pos
        if i < shape.dense_ffn[0]:
            dense(shape.dense_ffn[1], "dense")
            continue
        if shape.shared:
            dense(shape.shared, "shared")
        w.mats.append(cost.Mat(E * d, E * d * 4, "f32", T))  # the router, F32
        qt = types["experts"]
        if i < host_layers:
            w.host[i] = [cost.HostTensor(n_exp, n_exp * _bpw(qt), qt, E, frac, k) for _ in range(3)]
            w.cpu_expert_macs += exp_macs
        else:
            w.mats += [cost.Mat(frac * n_exp, frac * n_exp * _bpw(qt), qt, T, True, per_expert) for _ in range(3)]
            w.exp_macs += exp_macs
    w.host_layer_macs = exp_macs
    w.n_cpu_layers = host_layers
    w.mats.append(cost.Mat(0, kv, "f16", T))  # flash attention reads the KV cache once a pass
    n_linear = sum(not shape.is_full(i) for i in range(shape.layers))
    w.mats.append(cost.Mat(0, 2 * n_linear * shape.linear_state, "f32", T))
    if lm_rows:
        n = shape.vocab * d
        w.mats.append(cost.Mat(n, n * _bpw(types["output"]), types["output"], lm_rows))
        w.lm_rows, w.lm_row_macs = lm_rows, n
    return w


# The fit's data. Batched MoE series from two llama.cpp PRs of August 2025 (the PR's own build
# column; llama-bench prompt processing at the microbatch given: pp4096 has a mean depth of 2048,
# pp512 of 256), and every 1-row figure found (the per-layer term: its range is their spread)
RTX4090, RTX3090, RTX5060TI = GPUS["rtx4090"], GPUS["rtx3090"], GPUS["rtx5060ti-16gb"]
_S15631 = "llama.cpp PR #15631 (RTX 4090, qwen3moe 30B.A3B Q4_0, microbatch {}, pp4096: {} t/s)"
_S15525 = "llama.cpp PR #15525 (RTX 3090, deepseek2 16B Q4_0, microbatch {}, pp512: {} t/s)"
FIT_SERIES = [
    *(Measurement(f"RTX 4090 Qwen3-30B-A3B Q4_0, {j} row(s)", QWEN3_30B, RTX4090, Q4_0_FILE, j, 2048, t,
                  _S15631.format(j, t)) for j, t in ((1, 205.87), (16, 959.90), (32, 1556.32), (64, 2508.44))),
    *(Measurement(f"RTX 3090 DeepSeek-V2-Lite Q4_0, {j} row(s)", DEEPSEEK_V2_LITE, RTX3090, Q4_0_FILE, j, 256, t,
                  _S15525.format(j, t))
      for j, t in ((1, 180.53), (16, 784.29), (32, 1209.58), (64, 1802.95), (128, 2253.15))),
    Measurement("RTX 3090 gpt-oss-20b MXFP4, 1 row", GPT_OSS_20B, RTX3090, MXFP4_MOE, 1, 2048, 186.29,
                "llama.cpp PR #15631 (RTX 3090, gpt-oss 20B MXFP4 MoE, microbatch 1, pp4096: 186.29 t/s)"),
    Measurement("RTX 3090 DeepSeek-V2-Lite Q4_0, 1 row at 32k context", DEEPSEEK_V2_LITE, RTX3090, Q4_0_FILE, 1,
                32768 + 256, 156.74, "llama.cpp PR #19057 (RTX 3090, deepseek2 16B Q4_0, microbatch 1, "
                "pp512@d32768: 156.74 t/s)"),
    Measurement("RTX 5060 Ti 16 GB, Qwen3.5-35B-A3B IQ3_S, generation", QWEN35_35B, RTX5060TI, IQ3_S_EXPERTS, 1,
                1000, 69.0, "ik_llama.cpp PR #1593 (RTX 5060 Ti, Qwen3.5-35B-A3B Unsloth UD IQ3_S, stock llama.cpp "
                "b8125, all in VRAM: 69 t/s generation; depth not stated, 1000 assumed)", generating=True),
    Measurement("RTX 3090, Qwen3.6-35B-A3B ~15 GB file, generation", QWEN35_35B, RTX3090, IQ3_S_EXPERTS, 1, 500,
                141.0, "noonghunna/club-3090 issue #390 (RTX 3090, Qwen3.6-35B-A3B in 15 GB, mainline llama.cpp: 141 "
                "t/s narrative decode; file types not stated: IQ3_S experts assumed)", generating=True),
]  # fmt: skip


@dataclass
class Fit:
    layer_term: Term
    moe_term: Term
    moe_ab: tuple[float, float]
    points: list[dict]


def _bootstrap() -> KernelTable:
    """The seeded table before the fit: no MoE rate, no per-layer cost, every spread 1."""
    names = ("mmq", "moe", "float_bw", "mmvq_bw", "layer", "pass", "sync")
    terms = {n: Term(n, ASSUMED[n][0] if n in ASSUMED else 1.0, 1.0, 1.0, "", "fit") for n in names}
    return KernelTable(terms=terms, moe_ab=(1e-12, 0.0), layer_c=0.0)


def layer_and_moe_fit() -> Fit:
    return fit(tuple(FIT_SERIES))


@lru_cache(maxsize=4)
def fit(series: tuple[Measurement, ...]) -> Fit:
    """The per-layer term from the 1-row figures of `series`, then the MoE rate from the others."""
    kern = _bootstrap()
    points: list[dict] = []
    per_layer = []
    for m in (m for m in series if m.rows == 1):
        left = 1e3 / m.tok_s - m.pass_ms(kern)
        per_layer.append((m, left / m.shape.layers * m.gpu.sm_ghz))
    c = math.exp(sum(math.log(x) for _, x in per_layer) / len(per_layer))
    for m, x in per_layer:
        points.append({"what": m.what, "term": "layer", "value": x, "source": m.source})
    kern.layer_c = c
    rho, rate = [], []
    for m in (m for m in series if m.rows > 1):
        w = m.work()
        moe = [x for x in w.mats if x.moe]
        w.mats = [x for x in w.mats if not x.moe]
        w.exp_macs = 0.0
        rest = cost.gpu_ms(w, device(m.gpu), kern, cost.HostLink(), cost.CpuCalibration())
        left = m.rows / m.tok_s * 1e3 - rest
        rho.append(moe[0].per_expert)
        rate.append(sum(x.weights for x in moe) / left / 1e6 / m.gpu.sm_ghz)
        points.append({"what": m.what, "term": "moe", "rows_per_expert": rho[-1], "value": rate[-1],
                       "source": m.source})  # fmt: skip
    # 1/rate = a + b rho, least squares in relative error
    r, p = np.array(rate), np.array(rho)
    (a, b), *_ = np.linalg.lstsq(np.stack([r, r * p], 1), np.ones_like(r), rcond=None)
    ratio = r * (a + b * p)  # measured / fitted rate
    for pt in points:
        if pt["term"] == "moe":
            pt["fit"] = float(1 / (a + b * pt["rows_per_expert"]))
    one = [m for m in series if m.rows == 1]
    batched = [m for m in series if m.rows > 1]
    xs = [x for _, x in per_layer]
    layer = Term("layer", c, min(xs) / c, max(xs) / c,
                 f"fit: the time a 1-row figure leaves after its weights' and KV cache's bandwidth terms, per layer "
                 f"x SMs x GHz ({', '.join(f'{x:.1f}' for x in xs)}; geometric mean {c:.1f}): "
                 + "; ".join(m.source for m in one), "fit", frozenset(m.gpu.arch for m in one))  # fmt: skip
    moe_t = Term("moe", 1.0, 1 / max(ratio), 1 / min(ratio),
                 f"fit: 1 / rate = {a:.3f} + {b:.4f} x rows per touched expert (G weights/s per SM x GHz), "
                 f"{len(rate)} batched figures within {min(ratio):.2f}-{max(ratio):.2f}x: "
                 + "; ".join(m.source for m in batched), "fit", frozenset(m.gpu.arch for m in batched))  # fmt: skip
    return Fit(layer, moe_t, (float(a), float(b)), points)
