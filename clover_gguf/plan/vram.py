"""The VRAM account that `clover-gguf plan` and `run`/`serve --fit` share: what llama.cpp puts
on the GPU for a Clover GGUF besides nothing else, and how much of a card is there for it.

On the GPU: the offloaded layers' tensors and the output layer, not `token_embd` (llama.cpp
keeps the input layer in host memory: llama-model.cpp:1617, dev_input = the CPU's buffer
list); the memory state, one cell per sequence (n_seq_max, serve: --parallel + 1); the compute
buffer, reserved for n_ubatch rows with logits; with op offload and experts in host memory,
a full-size GPU copy of the largest host expert tensor inside the compute buffer (the
scheduler's copy target, ggml-backend.cpp:1380-1396, allocated by ggml-alloc at the start of
its split, :1514-1530; a new split per offloaded weight lets the next one reuse it,
:1330-1331; the reserve graph has n_ubatch >= 256 rows, so op offload is in it whatever the
block size); and llama.cpp's own --fit margin of 1 GiB per device
(common/common.h:486), which covers cuBLAS, the CUDA pool and graphs.

Free memory: `run --fit` asks ggml (cudaMemGetInfo, after this process's CUDA context exists).
The plan has no process on the card: it takes the card's total as the driver reports it
(plan.gpus) less a CUDA context (CUDA_CONTEXT_BYTES, an assumption until device_check.sh has
measured one). docs/plan.md."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import CloverConfig

FIT_MARGIN_BYTES = 1 << 30  # llama.cpp's --fit-target default, per device (common/common.h:486)
CUDA_CONTEXT_BYTES = 300 << 20  # plan only; run --fit's free figure already excludes it
RUN_N_UBATCH = 256  # CloverRuntime's minimum n_ubatch (runtime.py)


def runtime_n_ubatch(n_seq: int, block_size: int) -> int:
    """The n_ubatch CloverRuntime chooses: 256, or a block of every sequence if more."""
    return max(RUN_N_UBATCH, n_seq * block_size)


def state_bytes(cfg: CloverConfig, n_seq: int = 1) -> int:
    """Memory state (H_kv D x D float32) and conv state per sequence: fixed, context-free. (On
    the CPU backend llama.cpp reserved 1.01 MiB for one sequence of the 35B shapes' layer
    against 1.02 estimated here: an upper bound.)"""
    per_layer = cfg.num_key_value_heads * cfg.head_dim**2 * 4 + cfg.hidden_size * (cfg.conv_kernel_size - 1) * 4
    return n_seq * cfg.num_hidden_layers * per_layer


def compute_buffer_bytes(cfg: CloverConfig, n_ubatch: int) -> int:
    """llama.cpp's compute buffer: the logits of n_ubatch rows and 3 hidden vectors a row.
    Checked against llama.cpp's own reservation (CPU backend, the same graph): clover-tiny at
    n_ubatch 256 4.76 MiB (this formula 4.75), 35B shapes 248.50 MiB at 256 and 124.25 at 128
    (this formula 248.50 and 124.25)."""
    return n_ubatch * 4 * (cfg.vocab_size + 3 * cfg.hidden_size)


@dataclass
class Account:
    """VRAM besides the weights, for one configuration."""

    state: int
    compute: int
    margin: int
    offload_copy: int = 0  # added only when some layer's experts go to host memory

    @property
    def overhead(self) -> int:
        return self.state + self.compute + self.margin

    def to_dict(self) -> dict:
        return {
            "state_bytes": self.state,
            "compute_buffer_bytes": self.compute,
            "margin_bytes": self.margin,
            "offload_copy_bytes": self.offload_copy,
        }


def account(
    cfg: CloverConfig,
    n_seq: int = 1,
    n_ubatch: int | None = None,
    n_devices: int = 1,
    host_tensor_max: int = 0,
    op_offload: bool = True,
) -> Account:
    """The account for a runtime with n_seq sequences; host_tensor_max: the largest routed-
    expert tensor that would sit in host memory (its GPU copy, with op offload)."""
    ub = n_ubatch or runtime_n_ubatch(n_seq, cfg.block_size)
    copy = host_tensor_max if op_offload else 0
    return Account(state_bytes(cfg, n_seq), compute_buffer_bytes(cfg, ub), FIT_MARGIN_BYTES * n_devices, copy)


def plan_free_bytes(total: int) -> int:
    """What `run --fit` would see free on an idle card of this total: less our CUDA context."""
    return total - CUDA_CONTEXT_BYTES
