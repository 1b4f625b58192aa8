"""Automatic placement (`clover-gguf run/serve --fit`) and the plan's split rows: how many
layers' routed experts stay in CPU memory so that the rest fits the free VRAM.

One rule for both: `split_bytes` sorts tensor sizes into what goes to the GPU (per layer's
routed experts, the rest; token_embd stays on the host), plan.vram.account adds the state,
compute buffer, op-offload copy and llama.cpp's margin, and `choose_cpu_layers` picks the
fewest leading layers. fit_gguf feeds it a GGUF's tensor table and the free memory ggml reports;
`clover-gguf plan` feeds it the converter's plan and the card's total less a CUDA context. The
override it returns is the `-ot` the plan prints for a split."""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..convert.tensor_plan import fmt_bytes
from ..errors import CloverError
from . import vram

EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(up|down|gate|gate_up)_exps\.")
LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.")

# ggml_backend_dev_type: GPU is dedicated memory (IGPU shares host memory: nothing to fit)
GGML_BACKEND_DEVICE_TYPE_GPU = 1


class FitError(CloverError, ValueError):
    """Even with every offloaded layer's experts in CPU memory the rest does not fit: one line."""


@dataclass
class GpuDevice:
    name: str
    free: int
    total: int


@dataclass
class Placement:
    cpu_layers: list[int]  # layers whose routed experts stay in CPU memory
    cpu_bytes: int  # their bytes
    gpu_bytes: int  # weights + overheads placed on the GPU(s)
    n_layers: int  # layers offloaded (the candidates)
    devices: list[GpuDevice] = field(default_factory=list)
    account: vram.Account | None = None
    free: int = 0

    def override(self) -> str | None:
        """The -ot REGEX=CPU for the chosen layers (None: everything fits)."""
        if not self.cpu_layers:
            return None
        from . import cpu_layers_regex

        return cpu_layers_regex(self.cpu_layers)

    def message(self) -> str:
        names = "+".join(d.name for d in self.devices) or "GPU"
        free = sum(d.free for d in self.devices)
        on = f"{fmt_bytes(self.gpu_bytes)} on {names} (free {fmt_bytes(free)})"
        if not self.cpu_layers:
            return f"fit: everything fits, {on}"
        return (
            f"fit: {len(self.cpu_layers)} of {self.n_layers} layers' experts in CPU memory "
            f"({fmt_bytes(self.cpu_bytes)}), {on}"
        )


def choose_cpu_layers(
    layer_expert_bytes: dict[int, int], other_bytes: int, free: int, overhead: int, split_extra: int = 0
) -> list[int]:
    """The fewest leading layers (as llama.cpp's --n-cpu-moe) whose routed experts must leave the
    GPU so that the remaining experts + other_bytes + overhead <= free; split_extra: VRAM that
    any split adds (the op-offload copy of a host expert tensor). FitError when the non-expert
    part alone does not fit."""
    layers = sorted(layer_expert_bytes)
    need = sum(layer_expert_bytes.values()) + other_bytes + overhead - free
    if need <= 0:
        return []
    need += split_extra
    if other_bytes + overhead + split_extra > free:
        raise FitError(
            f"fit: even with every layer's experts in CPU memory the GPU needs "
            f"{fmt_bytes(other_bytes + overhead + split_extra)} (weights {fmt_bytes(other_bytes)} + state, compute "
            f"buffer and margin {fmt_bytes(overhead + split_extra)}), free {fmt_bytes(free)}; "
            f"offload fewer layers (-ngl) or use a smaller recipe (clover-gguf plan)"
        )
    out, moved = [], 0
    for il in layers:
        if moved >= need:
            break
        out.append(il)
        moved += layer_expert_bytes[il]
    return out


def split_bytes(named_sizes, n_layer: int, n_gpu_layers: int = -1) -> tuple[dict[int, list[int]], int]:
    """(routed-expert tensor sizes per offloaded layer, other offloaded bytes) from (name, bytes)
    pairs: a GGUF's tensor table or the converter's plan. token_embd stays on the CPU (llama.cpp's
    input layer)."""
    on_gpu, output = gpu_layers(n_layer, n_gpu_layers)
    on = set(on_gpu)
    experts: dict[int, list[int]] = {il: [] for il in on_gpu}
    other = 0
    for name, n in named_sizes:
        m = LAYER_TENSOR.match(name)
        if m:
            il = int(m.group(1))
            if il not in on:
                continue
            if EXPERT_TENSOR.match(name):
                experts[il].append(int(n))
            else:
                other += int(n)
        elif output and not name.startswith("token_embd"):
            other += int(n)
    return experts, other


def place(
    experts: dict[int, list[int]], other: int, free: int, cfg, n_seq: int = 1, op_offload: bool = True,
    n_devices: int = 1, n_ubatch: int | None = None,
) -> Placement:  # fmt: skip
    """The placement of these bytes on `free` bytes of VRAM (the shared rule)."""
    per_layer = {il: sum(ts) for il, ts in experts.items()}
    biggest = max((t for ts in experts.values() for t in ts), default=0)
    acct = vram.account(cfg, n_seq, n_ubatch, n_devices, biggest, op_offload)
    chosen = choose_cpu_layers(per_layer, other, free, acct.overhead, acct.offload_copy)
    if not chosen:
        acct.offload_copy = 0
    cpu = sum(per_layer[il] for il in chosen)
    gpu = sum(per_layer.values()) - cpu + other + acct.overhead + acct.offload_copy
    return Placement(chosen, cpu, gpu, len(per_layer), account=acct, free=free)


def gpu_layers(n_layer: int, n_gpu_layers: int) -> tuple[list[int], bool]:
    """(offloaded layers, output on the GPU) for -ngl, as llama.cpp counts it: the output layer
    first, then the last layers; a negative -ngl offloads everything."""
    if n_gpu_layers < 0 or n_gpu_layers > n_layer:
        return list(range(n_layer)), True
    if n_gpu_layers == 0:
        return [], False
    return list(range(n_layer + 1 - n_gpu_layers, n_layer)), True


def gguf_bytes(path: str | Path, n_gpu_layers: int) -> tuple[dict[int, list[int]], int, object]:
    """(routed-expert tensor sizes per offloaded layer, other offloaded bytes, CloverConfig) from
    the GGUF's tensor table."""
    from ..gguf_io.reader import config_from_reader, open_gguf

    r = open_gguf(path)
    cfg = config_from_reader(r, path)
    experts, other = split_bytes(((t.name, int(t.n_bytes)) for t in r.tensors), cfg.num_hidden_layers, n_gpu_layers)
    return experts, other, cfg


def gpu_devices(lib=None) -> list[GpuDevice]:
    """The GPU devices ggml has registered, with the free and total memory they report."""
    from ..runtime import bindings

    lib = lib or bindings.load()
    d = lib.lib_path.parent
    ggml = ctypes.CDLL(str(d / "libggml.so") if (d / "libggml.so").exists() else "libggml.so")
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    sigs = {
        "ggml_backend_dev_count": ([], sz),
        "ggml_backend_dev_get": ([sz], vp),
        "ggml_backend_dev_type": ([vp], ctypes.c_int),
        "ggml_backend_dev_name": ([vp], ctypes.c_char_p),
        "ggml_backend_dev_memory": ([vp, ctypes.POINTER(sz), ctypes.POINTER(sz)], None),
    }
    fn = {}
    for name, (args, res) in sigs.items():
        f = getattr(ggml, name)
        f.argtypes, f.restype = args, res
        fn[name] = f
    out = []
    for i in range(fn["ggml_backend_dev_count"]()):
        dev = fn["ggml_backend_dev_get"](i)
        if fn["ggml_backend_dev_type"](dev) != GGML_BACKEND_DEVICE_TYPE_GPU:
            continue
        free, total = sz(0), sz(0)
        fn["ggml_backend_dev_memory"](dev, ctypes.byref(free), ctypes.byref(total))
        out.append(GpuDevice(fn["ggml_backend_dev_name"](dev).decode(errors="replace"), free.value, total.value))
    return out


NO_GPU = "fit: no GPU device, nothing to fit"


def fit_gguf(
    path: str | Path,
    n_gpu_layers: int,
    n_seq: int = 1,
    devices: list[GpuDevice] | None = None,
    op_offload: bool = True,
) -> Placement | None:
    """The placement for this GGUF on the GPU devices (those ggml reports when None); None when
    there is no GPU device. FitError when even the non-expert weights do not fit."""
    devices = gpu_devices() if devices is None else devices
    if not devices:
        return None
    experts, other, cfg = gguf_bytes(path, n_gpu_layers)
    free = sum(d.free for d in devices)
    p = place(experts, other, free, cfg, n_seq, op_offload, len(devices))
    p.devices = devices
    return p


def fit_overrides(
    path: str | Path,
    n_gpu_layers: int,
    fit: bool | None,
    explicit: bool,
    n_seq: int = 1,
    log=print,
    devices: list[GpuDevice] | None = None,
    rpc: bool = False,
    op_offload: bool = True,
) -> list[str]:
    """The -ot REGEX=CPU specs --fit adds (logging one line on what it chose). fit None: on when
    -ngl offloads something and the user gave no placement of their own (-ot, --experts-on-cpu)
    and no rpc-servers (they place their own share; --fit then sizes the local GPUs only)."""
    if fit is False or (fit is None and (n_gpu_layers == 0 or explicit or rpc)):
        return []
    if explicit:
        raise FitError("--fit chooses what stays in CPU memory itself: give it or -ot/--experts-on-cpu, not both")
    if n_gpu_layers == 0:
        log("fit: -ngl 0 offloads nothing, nothing to fit")
        return []
    p = fit_gguf(path, n_gpu_layers, n_seq, devices, op_offload)
    if p is None:
        log(NO_GPU)
        return []
    log(p.message())
    ot = p.override()
    return [ot] if ot else []
