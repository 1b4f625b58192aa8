"""Cost of one denoising step and one commit (docs/plan.md).

A forward pass over T block rows reads, per layer, the non-expert weights and the routed
experts the block touches: the fraction comes from a routing measurement of the model's own
router when there is one (plan.routing), else 1-(1-k/E)^T. A step also runs the lm_head (on a
GPU over every row of the block); a commit runs none.

GPU time (every figure `predicted` until scripts/device_check.sh has run): each weight matrix
costs what llama.cpp's CUDA kernel for its type and rows costs (plan.kernels: MMQ for quantized
weights and more than 8 rows, a bandwidth fraction otherwise), plus a fixed cost per pass and
per layer. Experts kept in host memory (-ot ...=CPU) cost what the runtime as built does with
them (ggml-backend.cpp, ggml-cuda.cu; docs/plan.md has the lines): with op offload (the default)
and a batch of at least 32 rows, the scheduler synchronises the GPU before each host tensor's
split, reads the router's ids back (once per layer), copies only the experts they use, one cudaMemcpyAsync per run of consecutive expert ids, into a
full-size GPU copy of the tensor, and the GPU computes them; pinned (--no-mmap) or pageable
(mmap, the default) host memory sets the copy's rate and per-call cost. Without op offload
(--no-op-offload), or below 32 rows, the CPU computes them (the CPU terms, on the user's CPU).

CPU time: c0 + cL * layers + bytes touched / BW + MACs / R, with c0, cL, BW and R fitted to
measurements of this machine (`clover-gguf plan --calibrate`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..config import CloverConfig
from ..convert import quants
from ..convert.tensor_plan import Plan
from .kernels import FLOAT_TYPES, MMQ_MAX_ROWS_MMVQ, KernelTable
from .routing import Routing, uniform

LM_VEC_MAX = 7  # rows ggml's CPU matmul does one by one (measured: 1-7 linear, a jump at 8)
LM_TILE = 16  # rows of a tile above that
# ggml-cuda.cu:5835 (GGML_OP_OFFLOAD_MIN_BATCH, default 32); a MUL_MAT_ID's batch is its tokens
# (ggml-cuda.cu:5646-5659, op->ne[2])
OP_OFFLOAD_MIN_BATCH = 32
# Assumptions without a public anchor (docs/plan.md, "GPU constants"); device_check.sh measures
# the step these feed into
GPU_STEP_OVERHEAD_MS = 1.0  # host sampling + graph launch + sync per pass
GPU_LAYER_OVERHEAD_MS = 0.05  # Clover's non-matmul kernels per layer (delta rule, conv, norms)
# one GPU stream sync (or a small read back to the host). With one GPU the scheduler has no
# events (they exist with pipeline parallelism only: ggml-backend.cpp:1921-1925,
# llama-context.cpp:430-457), so it synchronises the GPU before it overwrites any split input
# (ggml-backend.cpp:1702-1707): once per offloaded host tensor, plus the ids read (:1741-1745)
SYNC_MS = 0.02
# Host-to-device copies, NVlabs/cuda-oxide PR #976 (RTX 4090, PCIe 4.0 x16, 31.5 GB/s raw):
# pinned 22.51 GB/s at 1 MiB, 23.9 at 16-64 MiB; pageable 13.73 at 1 MiB, 18.42 at 16 MiB.
# As rate + cost per call: pinned 23.9 GB/s (0.76 of raw) + 2.7 us, pageable 18.4 GB/s
# (0.58 of raw, and at most 18.4 GB/s: the driver stages pageable copies through a CPU memcpy)
# + 19 us.
PCIE_PINNED_FRACTION, PCIE_PINNED_CALL_MS = 0.76, 0.0027
PCIE_PAGEABLE_FRACTION, PCIE_PAGEABLE_CALL_MS, PCIE_PAGEABLE_MAX_GBS = 0.58, 0.019, 18.4
COPY_PADDING = 512  # ggml-backend.cpp:1764: each run copies up to 512 bytes more (MMQ padding)


def touched_fraction(k: int, E: int, T: int) -> float:
    """Expected fraction of E experts that T rows, each routed to k of them at random, touch."""
    return uniform(k, E, T)


@dataclass
class CpuCalibration:
    """Fitted CPU terms (per forward pass)."""

    c0_ms: float = 1.0
    c_layer_ms: float = 0.05
    bw_gbs: float = 10.0  # bytes touched
    gmacs: float = 20.0  # dense multiply-adds per ns
    gmacs_experts: float = 10.0  # routed experts' (MUL_MAT_ID: few rows per expert)
    # lm_head: ggml's CPU matmul takes up to LM_VEC_MAX rows one by one (vec_dot) and more in
    # tiles of LM_TILE rows; measured here, each regime gets its own rate
    gmacs_lm_vec: float = 20.0
    gmacs_lm_tile: float = 20.0  # per tile of LM_TILE rows, in row-MACs x LM_TILE
    threads: int = 0
    source: str = "default (uncalibrated)"
    loadavg: tuple[float, float, float] | None = None

    def ms(self, n_layers: int, bytes_: float, macs: float, exp_macs: float = 0.0, lm=(0.0, 0.0)) -> float:
        return (
            self.c0_ms
            + self.c_layer_ms * n_layers
            + bytes_ / (self.bw_gbs * 1e6)
            + macs / (self.gmacs * 1e6)
            + exp_macs / (self.gmacs_experts * 1e6)
            + lm[0] / (self.gmacs_lm_vec * 1e6)
            + lm[1] / (self.gmacs_lm_tile * 1e6)
        )

    def save(self, path: Path) -> None:
        from ..outputs import write_json

        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, asdict(self))

    @classmethod
    def load(cls, path: Path | None = None) -> CpuCalibration:
        p = Path(path) if path else default_calibration_path()
        if not p.is_file() and path is None and REFERENCE_CALIBRATION.is_file():
            # no measurement of this machine yet: the project's reference machine's
            p = REFERENCE_CALIBRATION
        if not p.is_file():
            return cls()
        try:
            d = json.loads(p.read_text())
            return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})
        except (ValueError, TypeError) as e:
            from .sizes import PlanError

            raise PlanError(f"{p}: not a calibration file ({e})") from None


REFERENCE_CALIBRATION = Path(__file__).resolve().parents[2] / "evaldata" / "plan" / "cpu-calibration.json"


def default_calibration_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "clover-gguf" / "plan-calibration.json"


@dataclass
class Mat:
    """One weight matrix a GPU pass multiplies: the weights and bytes it walks through."""

    weights: float
    nbytes: float
    qtype: str
    rows: int
    moe: bool = False  # routed experts (MUL_MAT_ID)


@dataclass
class HostTensor:
    """A host-resident expert tensor of one layer, for one pass."""

    weights: float  # all experts
    nbytes: float
    qtype: str
    n_experts: int
    frac: float  # touched by this pass's rows


@dataclass
class Work:
    """One forward pass's bytes and MACs, split by where they run."""

    bytes_: float = 0.0
    macs: float = 0.0  # dense, lm_head excluded
    lm_rows: float = 0.0
    lm_row_macs: float = 0.0  # V x d
    exp_macs: float = 0.0  # routed experts on the device
    n_layers: int = 0
    cpu_expert_bytes_touched: float = 0.0  # experts in host memory (split placement)
    cpu_expert_bytes_full: float = 0.0
    cpu_expert_macs: float = 0.0
    n_cpu_layers: int = 0
    rows: int = 0
    mats: list[Mat] = field(default_factory=list)  # on the GPU (token_embd stays on the host)
    host: dict[int, list[HostTensor]] = field(default_factory=dict)  # layer -> its host experts
    host_layer_macs: float = 0.0  # per host layer: the routed experts' MACs of this pass
    hidden: int = 0


def _qtype(e) -> str:
    return quants.type_name(e.qtype).lower()


def forward_work(
    cfg: CloverConfig,
    plan: Plan,
    T: int,
    lm_rows: float,
    cpu_layers=frozenset(),
    commit: bool = False,
    routing: Routing | None = None,
    masked: float = 1.0,
) -> Work:
    """Bytes read and multiply-adds of a forward pass over T rows with lm_head on lm_rows, of
    which a fraction `masked` are mask tokens (0 for a commit). A commit only updates the memory
    states: nothing reads the last layer's FFN output, and llama.cpp prunes it from the graph."""
    last = cfg.num_hidden_layers - 1
    ffn = ("experts_gate_up", "experts_down", "shared_expert", "router")
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    routing = routing or Routing(k, E)
    masked = 0.0 if commit else masked
    d, Fe, Fs = cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    w = Work(n_layers=cfg.num_hidden_layers, rows=T, hidden=cfg.hidden_size)
    for e in plan.entries:
        if commit and e.group in ffn and e.name.startswith(f"blk.{last}."):
            continue
        n = math.prod(e.shape)
        if e.group == "embeddings":
            w.bytes_ += T * e.nbytes / e.shape[0]  # row lookups, on the host
        elif e.group == "output":
            if lm_rows > 0:
                w.bytes_ += e.nbytes
                w.mats.append(Mat(n, e.nbytes, _qtype(e), int(lm_rows)))
        elif e.group.startswith("experts"):
            layer = int(e.name.split(".")[1])
            frac = routing.fraction(T, masked, layer)
            if layer in cpu_layers:
                w.cpu_expert_bytes_touched += frac * e.nbytes
                w.cpu_expert_bytes_full += e.nbytes
                w.host.setdefault(layer, []).append(HostTensor(n, e.nbytes, _qtype(e), e.shape[0], frac))
            else:
                w.bytes_ += frac * e.nbytes
                w.mats.append(Mat(frac * n, frac * e.nbytes, _qtype(e), T, moe=True))
        else:
            w.bytes_ += e.nbytes
            if len(e.shape) >= 2:
                w.mats.append(Mat(n, e.nbytes, _qtype(e), T))
    L = cfg.num_hidden_layers
    attn_row = (
        2 * H * D * d + 2 * Hkv * D * d  # q, o, k, v
        + 2 * Hkv * d  # alpha/beta
        + 4 * Hkv * D * D  # delta-rule state update and readout
        + T * H * D  # attention inside the block
    )  # fmt: skip
    ffn_row = 3 * Fs * d + d + E * d  # shared expert and its gate, router
    n_ffn = L - 1 if commit else L
    exp_macs = T * k * 3 * Fe * d
    w.macs = L * T * attn_row + n_ffn * T * ffn_row
    w.lm_rows, w.lm_row_macs = lm_rows, cfg.vocab_size * d
    n_cpu = len([i for i in cpu_layers if i < n_ffn])
    w.exp_macs = (n_ffn - n_cpu) * exp_macs
    w.cpu_expert_macs = n_cpu * exp_macs
    w.host_layer_macs = exp_macs
    w.n_cpu_layers = len(cpu_layers)
    return w


@dataclass
class Device:
    name: str
    bandwidth_gbs: float
    tflops: float
    pcie_raw_gbs: float  # the link's raw rate per direction
    sm_ghz: float  # SMs x boost GHz (MMQ rates scale with it)


@dataclass
class HostLink:
    """What the runtime does with host-resident experts: --no-op-offload, --no-mmap."""

    op_offload: bool = True
    pinned: bool = False  # mmap (the default) leaves them in pageable memory

    def gbs(self, raw: float) -> float:
        if self.pinned:
            return PCIE_PINNED_FRACTION * raw
        return min(PCIE_PAGEABLE_FRACTION * raw, PCIE_PAGEABLE_MAX_GBS)

    @property
    def call_ms(self) -> float:
        return PCIE_PINNED_CALL_MS if self.pinned else PCIE_PAGEABLE_CALL_MS


def tile_rows(rows: int) -> int:
    """MMQ's tile width for a matmul of `rows` rows: the smallest multiple of 8 >= rows, <= 128
    (mmq.cuh, J from 8 to 128 in steps of 8)."""
    return min(128, 8 * math.ceil(rows / 8))


def mat_ms(m: Mat, dev: Device, kern: KernelTable) -> float:
    if m.nbytes <= 0:
        return 0.0
    bw = dev.bandwidth_gbs * 1e6  # bytes per ms
    if m.qtype in FLOAT_TYPES or m.rows <= MMQ_MAX_ROWS_MMVQ:
        return m.nbytes / (kern.bw_fraction(m.qtype) * bw)
    rate = kern.mmq_rate(m.qtype, tile_rows(m.rows)) * dev.sm_ghz * 1e6  # weights per ms
    if m.moe:
        rate *= kern.moe_factor[0]
    return max(m.weights / rate, m.nbytes / (kern.bw_fraction("bf16") * bw))


def expected_runs(n: int, p: float) -> float:
    """Runs of consecutive used ids among n experts each used with probability p."""
    return p + (n - 1) * p * (1 - p)


def host_layer_ms(ts: list[HostTensor], w: Work, dev: Device, kern: KernelTable, link: HostLink, cpu) -> float:
    """One pass's cost of one layer whose routed experts sit in host memory."""
    T = w.rows
    if link.op_offload and T >= OP_OFFLOAD_MIN_BATCH:
        t = (len(ts) + 1) * SYNC_MS
        for x in ts:
            runs = expected_runs(x.n_experts, x.frac)
            pad = runs * min(x.nbytes / x.n_experts, COPY_PADDING)
            t += runs * link.call_ms + (x.frac * x.nbytes + pad) / (link.gbs(dev.pcie_raw_gbs) * 1e6)
            t += mat_ms(Mat(x.frac * x.weights, x.frac * x.nbytes, x.qtype, T, moe=True), dev, kern)
        return t
    # the CPU computes them: the rows' activations go over and the results come back (T x d
    # float32 each way), two syncs, and the CPU's rate for routed experts (`plan --calibrate`)
    acts = 2 * T * w.hidden * 4
    touched = sum(x.frac * x.nbytes for x in ts)
    cpu_part = cpu.ms(0, touched, 0.0, w.host_layer_macs) - cpu.c0_ms
    return 2 * SYNC_MS + acts / (link.gbs(dev.pcie_raw_gbs) * 1e6) + cpu_part


def gpu_ms(w: Work, dev: Device, kern: KernelTable, link: HostLink, cpu: CpuCalibration) -> float:
    t = GPU_STEP_OVERHEAD_MS + GPU_LAYER_OVERHEAD_MS * w.n_layers
    t += sum(mat_ms(m, dev, kern) for m in w.mats)
    t += sum(host_layer_ms(ts, w, dev, kern, link, cpu) for ts in w.host.values())
    flops = 2 * (w.macs + w.exp_macs + w.cpu_expert_macs + w.lm_rows * w.lm_row_macs)
    return max(t, flops / (dev.tflops * 1e9))


def cpu_ms(w: Work, cpu: CpuCalibration) -> float:
    return cpu.ms(
        w.n_layers, w.bytes_ + w.cpu_expert_bytes_touched, w.macs, w.exp_macs + w.cpu_expert_macs, lm_features(w)
    )


def lm_features(w: Work) -> tuple[float, float]:
    """(MACs in the one-row regime, row-MACs x LM_TILE x tiles in the tiled regime)."""
    n = w.lm_rows
    if n <= 0:
        return 0.0, 0.0
    if n <= LM_VEC_MAX:
        return n * w.lm_row_macs, 0.0
    return 0.0, math.ceil(n / LM_TILE) * LM_TILE * w.lm_row_macs


def block_times(
    cfg: CloverConfig,
    plan: Plan,
    tokens_per_step: int,
    time_fn,
    cpu_layers=frozenset(),
    all_rows: bool = True,
    routing: Routing | None = None,
    block_size: int | None = None,
):
    """(mean step ms, commit ms, tok/s) for a block decoded at tokens_per_step: steps see
    B, B-tps, ... masked rows; the commit is a pass over B rows without lm_head. all_rows:
    the lm_head runs over every row (the runtime does so when the output layer is on a GPU,
    so that every step reuses one graph); else over the masked rows (CPU). time_fn(work)."""
    B = block_size or cfg.block_size
    n_steps = max(1, math.ceil(B / tokens_per_step))
    steps = []
    for i in range(n_steps):
        masked = max(0, B - i * tokens_per_step)
        w = forward_work(cfg, plan, B, B if all_rows else masked, cpu_layers, routing=routing, masked=masked / B)
        steps.append(time_fn(w))
    commit = time_fn(forward_work(cfg, plan, B, 0, cpu_layers, commit=True, routing=routing))
    total = sum(steps) + commit
    return sum(steps) / n_steps, commit, B / (total / 1e3)
