"""Cost of one denoising step and one commit (docs/plan.md).

A forward pass over T block rows reads, per layer, the non-expert weights and the routed
experts the block touches: the fraction comes from a routing measurement of the model's own
router when there is one (plan.routing), else 1-(1-k/E)^T. A step also runs the lm_head (on a
GPU over every row of the block); a commit runs none.

GPU time (every figure `predicted` until scripts/device_check.sh has run): each weight matrix
costs what llama.cpp's CUDA kernel for its type and rows costs (plan.kernels: MMQ for quantized
weights and more than 8 rows, MUL_MAT_ID's own rate by rows per touched expert for routed
experts, a bandwidth fraction otherwise), plus a fixed cost per pass and per layer (fitted to
public figures: plan.public). Experts kept in host memory (-ot ...=CPU) cost what the runtime as built does with
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
from .kernels import FLOAT_TYPES, MMQ_MAX_ROWS_MMVQ, TILES, KernelTable
from .routing import Routing, uniform

LM_VEC_MAX = 7  # rows ggml's CPU matmul does one by one (measured: 1-7 linear, a jump at 8)
LM_TILE = 16  # rows of a tile above that
# ggml-cuda.cu:5835 (GGML_OP_OFFLOAD_MIN_BATCH, default 32); a MUL_MAT_ID's batch is its tokens
# (ggml-cuda.cu:5646-5659, op->ne[2])
OP_OFFLOAD_MIN_BATCH = 32
# With one GPU the scheduler has no events (they exist with pipeline parallelism only:
# ggml-backend.cpp:1921-1925, llama-context.cpp:430-457), so it synchronises the GPU before it
# overwrites any split input (ggml-backend.cpp:1702-1707): once per offloaded host tensor, plus
# the ids read (:1741-1745). The GPU constants (sync, copies, fixed costs) are plan.kernels'.
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
    per_expert: float = 0.0  # MUL_MAT_ID: mean rows per touched expert


@dataclass
class HostTensor:
    """A host-resident expert tensor of one layer, for one pass."""

    weights: float  # all experts
    nbytes: float
    qtype: str
    n_experts: int
    frac: float  # touched by this pass's rows
    top_k: int = 0  # experts a row uses (rows per touched expert: MUL_MAT_ID's rate)


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
                w.host.setdefault(layer, []).append(HostTensor(n, e.nbytes, _qtype(e), e.shape[0], frac, k))
            else:
                w.bytes_ += frac * e.nbytes
                w.mats.append(Mat(frac * n, frac * e.nbytes, _qtype(e), T, True, rows_per_expert(T, k, E, frac)))
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
    # GPU only (the CPU fit has these in its terms): the memory state each layer reads, and the
    # logits the in-graph sampler reads back (plan.cost.gpu_ms: float bandwidth)
    w.mats.append(Mat(0, L * Hkv * D * D * 4, "f32", T))
    if lm_rows > 0:
        w.mats.append(Mat(0, 2 * lm_rows * cfg.vocab_size * 4, "f32", T))
    return w


def rows_per_expert(T: float, k: int, E: int, frac: float) -> float:
    """Mean rows a touched expert gets: T rows routed to k experts each, over E x frac experts."""
    return T * k / (E * frac) if frac > 0 else 1.0


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

    def copy(self, raw: float, kern: KernelTable | None = None) -> tuple[float, float]:
        """(GB/s, ms a call) of a host-to-device copy over a link of `raw` GB/s (plan.kernels)."""
        return (kern or KernelTable()).copy(raw, self.pinned)


def tile_rows(rows: int) -> int:
    """MMQ's tile width for a matmul of `rows` rows: the smallest multiple of 8 >= rows, <= 128
    (mmq.cuh, J from 8 to 128 in steps of 8)."""
    return min(128, 8 * math.ceil(rows / 8))


def mat_cost(m: Mat, dev: Device, kern: KernelTable) -> tuple[float, str]:
    """(ms, the kernels.Term that sets it) of one weight matrix over its rows."""
    if m.nbytes <= 0:
        return 0.0, "float_bw"
    bw = dev.bandwidth_gbs * 1e6  # bytes per ms
    if m.qtype in FLOAT_TYPES or m.rows <= MMQ_MAX_ROWS_MMVQ:
        return m.nbytes / (kern.bw_fraction(m.qtype) * bw), "float_bw" if m.qtype in FLOAT_TYPES else "mmvq_bw"
    if m.moe:
        t, term = m.weights / (kern.moe_rate(m.qtype, m.per_expert) * dev.sm_ghz * 1e6), "moe"  # weights per ms
    elif m.rows > TILES[-1]:  # beyond the seeds: column tiles of the widest seeded width
        t = m.weights * math.ceil(m.rows / TILES[-1]) / (kern.mmq_rate(m.qtype, TILES[-1]) * dev.sm_ghz * 1e6)
        term = "mmq"
    else:
        t, term = m.weights / (kern.mmq_rate(m.qtype, tile_rows(m.rows)) * dev.sm_ghz * 1e6), "mmq"
    floor = m.nbytes / (kern.bw_fraction("bf16") * bw)
    return (t, term) if t >= floor else (floor, "float_bw")


def mat_ms(m: Mat, dev: Device, kern: KernelTable) -> float:
    return mat_cost(m, dev, kern)[0]


def expected_runs(n: int, p: float) -> float:
    """Runs of consecutive used ids among n experts each used with probability p."""
    return p + (n - 1) * p * (1 - p)


def host_layer_ms(ts: list[HostTensor], w: Work, dev: Device, kern: KernelTable, link: HostLink, cpu) -> float:
    """One pass's cost of one layer whose routed experts sit in host memory."""
    return sum(host_layer_costs(ts, w, dev, kern, link, cpu).values())


def host_layer_costs(ts: list[HostTensor], w: Work, dev: Device, kern: KernelTable, link: HostLink, cpu) -> dict:
    """host_layer_ms by term (kernels.Term names; "cpu" for the CPU's own terms)."""
    T = w.rows
    gbs, call_ms = link.copy(dev.pcie_raw_gbs, kern)
    copy = "pinned" if link.pinned else "pageable"
    out: dict[str, float] = {}

    def add(term: str, ms: float) -> None:
        out[term] = out.get(term, 0.0) + ms

    if link.op_offload and T >= OP_OFFLOAD_MIN_BATCH:
        add("sync", (len(ts) + 1) * kern.sync_ms)
        for x in ts:
            runs = expected_runs(x.n_experts, x.frac)
            pad = runs * min(x.nbytes / x.n_experts, COPY_PADDING)
            add("copy_call", runs * call_ms)
            add(copy, (x.frac * x.nbytes + pad) / (gbs * 1e6))
            pe = rows_per_expert(T, x.top_k or 1, x.n_experts, x.frac)
            add(*reversed(mat_cost(Mat(x.frac * x.weights, x.frac * x.nbytes, x.qtype, T, True, pe), dev, kern)))
        return out
    # the CPU computes them: the rows' activations go over and the results come back (T x d
    # float32 each way), two syncs, and the CPU's rate for routed experts (`plan --calibrate`)
    acts = 2 * T * w.hidden * 4
    touched = sum(x.frac * x.nbytes for x in ts)
    add("sync", 2 * kern.sync_ms)
    add(copy, acts / (gbs * 1e6))
    add("cpu", cpu.ms(0, touched, 0.0, w.host_layer_macs) - cpu.c0_ms)
    return out


def gpu_costs(w: Work, dev: Device, kern: KernelTable, link: HostLink, cpu: CpuCalibration) -> dict[str, float]:
    """A pass's GPU time by kernels.Term ("cpu": the CPU's terms; "compute": the FLOP floor's excess)."""
    out = {"pass": kern.pass_ms, "layer": kern.layer_ms(dev.sm_ghz) * w.n_layers}
    for m in w.mats:
        t, term = mat_cost(m, dev, kern)
        out[term] = out.get(term, 0.0) + t
    for ts in w.host.values():
        for term, t in host_layer_costs(ts, w, dev, kern, link, cpu).items():
            out[term] = out.get(term, 0.0) + t
    flops = 2 * (w.macs + w.exp_macs + w.cpu_expert_macs + w.lm_rows * w.lm_row_macs)
    total = sum(out.values())
    if flops / (dev.tflops * 1e9) > total:
        out["compute"] = flops / (dev.tflops * 1e9) - total
    return out


def gpu_ms(w: Work, dev: Device, kern: KernelTable, link: HostLink, cpu: CpuCalibration) -> float:
    return sum(gpu_costs(w, dev, kern, link, cpu).values())


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
