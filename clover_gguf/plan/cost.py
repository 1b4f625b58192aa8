"""Cost of one denoising step and one commit (docs/plan.md).

A forward pass over T block rows reads, per layer, the non-expert weights and the routed
experts the block touches: with top-k of E, a row misses an expert with probability 1-k/E, so
T rows touch a fraction 1-(1-k/E)^T of them (64 % for 32 rows at 8 of 256; 3 % for one AR
token). A step also runs the lm_head over the rows still masked; a commit runs none.

Device (GPU) time: overhead + max(bytes read / effective bandwidth, FLOPs / effective FLOPS).
Experts kept in host memory (``-ot ...=CPU``) cost, for T >= 32 rows, a copy of the whole
layer's expert tensors over PCIe (llama.cpp's op offload moves the weights to the GPU for
batches of 32 or more); below that, the CPU computes them (the CPU terms).

CPU time: c0 + cL * layers + bytes touched / BW + MACs / R, with c0, cL, BW and R fitted to
measurements of this machine (`clover-gguf plan --calibrate`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from ..config import CloverConfig
from ..convert.plan import Plan

LM_VEC_MAX = 7  # rows ggml's CPU matmul does one by one (measured: 1-7 linear, a jump at 8)
LM_TILE = 16  # rows of a tile above that
OP_OFFLOAD_MIN_BATCH = 32  # ggml-cuda's min batch size for offloading host-weight ops
GPU_BW_EFFICIENCY = 0.75  # of the vendor bandwidth a quantized MoE matmul reaches
GPU_FLOPS_EFFICIENCY = 0.35  # dequantizing kernels at small batch
GPU_STEP_OVERHEAD_MS = 1.0  # host sampling + sync per graph
GPU_LAYER_OVERHEAD_MS = 0.05  # kernel launches per layer


def touched_fraction(k: int, E: int, T: int) -> float:
    """Expected fraction of E experts that T rows, each routed to k of them, touch."""
    return 1.0 - (1.0 - k / E) ** T


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
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")

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


def forward_work(
    cfg: CloverConfig, plan: Plan, T: int, lm_rows: float, cpu_layers=frozenset(), commit: bool = False
) -> Work:
    """Bytes read and multiply-adds of a forward pass over T rows with lm_head on lm_rows. A
    commit only updates the memory states: nothing reads the last layer's FFN output, and
    llama.cpp prunes it from the graph."""
    last = cfg.num_hidden_layers - 1
    ffn = ("experts_gate_up", "experts_down", "shared_expert", "router")
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    frac = touched_fraction(k, E, T)
    d, Fe, Fs = cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    w = Work(n_layers=cfg.num_hidden_layers)
    for e in plan.entries:
        if commit and e.group in ffn and e.name.startswith(f"blk.{last}."):
            continue
        if e.group == "embeddings":
            w.bytes_ += T * e.nbytes / e.shape[0]  # row lookups
        elif e.group == "output":
            if lm_rows > 0:
                w.bytes_ += e.nbytes
        elif e.group.startswith("experts"):
            layer = int(e.name.split(".")[1])
            if layer in cpu_layers:
                w.cpu_expert_bytes_touched += frac * e.nbytes
                w.cpu_expert_bytes_full += e.nbytes
            else:
                w.bytes_ += frac * e.nbytes
        else:
            w.bytes_ += e.nbytes
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
    w.n_cpu_layers = len(cpu_layers)
    return w


@dataclass
class Device:
    name: str
    bandwidth_gbs: float
    tflops: float
    pcie_gbs: float


def gpu_ms(w: Work, dev: Device, cpu: CpuCalibration, T: int) -> float:
    t = GPU_STEP_OVERHEAD_MS + GPU_LAYER_OVERHEAD_MS * w.n_layers
    flops = 2 * (w.macs + w.exp_macs + w.lm_rows * w.lm_row_macs)
    t += max(
        w.bytes_ / (dev.bandwidth_gbs * GPU_BW_EFFICIENCY * 1e6), flops / (dev.tflops * GPU_FLOPS_EFFICIENCY * 1e9)
    )
    if w.n_cpu_layers:
        if T >= OP_OFFLOAD_MIN_BATCH:
            t += w.cpu_expert_bytes_full / (dev.pcie_gbs * 1e6)
            t += w.cpu_expert_bytes_full / (dev.bandwidth_gbs * GPU_BW_EFFICIENCY * 1e6)
        else:
            t += cpu.ms(0, w.cpu_expert_bytes_touched, 0.0, w.cpu_expert_macs) - cpu.c0_ms
    return t


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
    cfg: CloverConfig, plan: Plan, tokens_per_step: int, time_fn, cpu_layers=frozenset(), all_rows: bool = True
):
    """(mean step ms, commit ms, tok/s) for a block decoded at tokens_per_step: steps see
    B, B-tps, ... masked rows; the commit is a pass over B rows without lm_head. all_rows:
    the lm_head runs over every row (the runtime does so when the output layer is on a GPU,
    so that every step reuses one graph); else over the masked rows (CPU)."""
    B = cfg.block_size
    n_steps = max(1, math.ceil(B / tokens_per_step))
    steps = [
        time_fn(forward_work(cfg, plan, B, B if all_rows else max(0, B - i * tokens_per_step), cpu_layers), B)
        for i in range(n_steps)
    ]
    commit = time_fn(forward_work(cfg, plan, B, 0, cpu_layers, commit=True), B)
    total = sum(steps) + commit
    return sum(steps) / n_steps, commit, B / (total / 1e3)


def state_bytes(cfg: CloverConfig, n_seq: int = 1) -> int:
    """Memory state (H_kv D x D float32) and conv state per sequence: fixed, context-free."""
    per_layer = cfg.num_key_value_heads * cfg.head_dim**2 * 4 + cfg.hidden_size * (cfg.conv_kernel_size - 1) * 4
    return n_seq * cfg.num_hidden_layers * per_layer


def compute_buffer_bytes(cfg: CloverConfig, n_ubatch: int) -> int:
    """llama.cpp reserves its graph for n_ubatch rows with logits: the lm_head output dominates."""
    acts = n_ubatch * 4 * (8 * cfg.hidden_size + 3 * cfg.num_experts_per_tok * cfg.moe_intermediate_size)
    return n_ubatch * cfg.vocab_size * 4 + acts
