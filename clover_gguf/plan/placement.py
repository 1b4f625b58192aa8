"""Automatic placement (`clover-gguf run/serve --fit`): how many layers' routed experts stay in
CPU memory so that the rest fits the free VRAM the backend reports.

The decision (choose_cpu_layers) is a pure function of byte counts; fit_gguf feeds it the
GGUF's own tensor sizes, the plan's overheads (state, compute buffer, reserve) and the free
memory of the GPU devices ggml reports. The override it returns is the `-ot` that
`clover-gguf plan` prints for a split."""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..convert.plan import fmt_bytes
from . import cost

EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(up|down|gate|gate_up)_exps\.")
LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.")

# ggml_backend_dev_type: GPU is dedicated memory (IGPU shares host memory: nothing to fit)
GGML_BACKEND_DEVICE_TYPE_GPU = 1


class FitError(ValueError):
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


def choose_cpu_layers(layer_expert_bytes: dict[int, int], other_bytes: int, free: int, overhead: int) -> list[int]:
    """The fewest leading layers (as llama.cpp's --n-cpu-moe) whose routed experts must leave the
    GPU so that the remaining experts + other_bytes + overhead <= free. FitError when the
    non-expert part alone does not fit."""
    layers = sorted(layer_expert_bytes)
    need = sum(layer_expert_bytes.values()) + other_bytes + overhead - free
    if need <= 0:
        return []
    if other_bytes + overhead > free:
        raise FitError(
            f"fit: even with every layer's experts in CPU memory the GPU needs {fmt_bytes(other_bytes + overhead)} "
            f"(weights {fmt_bytes(other_bytes)} + state, compute buffer and reserve {fmt_bytes(overhead)}), "
            f"free {fmt_bytes(free)}; offload fewer layers (-ngl) or use a smaller recipe (clover-gguf plan)"
        )
    out, moved = [], 0
    for il in layers:
        if moved >= need:
            break
        out.append(il)
        moved += layer_expert_bytes[il]
    return out


def gpu_layers(n_layer: int, n_gpu_layers: int) -> tuple[list[int], bool]:
    """(offloaded layers, output on the GPU) for -ngl, as llama.cpp counts it: the output layer
    first, then the last layers; a negative -ngl offloads everything."""
    if n_gpu_layers < 0 or n_gpu_layers > n_layer:
        return list(range(n_layer)), True
    if n_gpu_layers == 0:
        return [], False
    return list(range(n_layer + 1 - n_gpu_layers, n_layer)), True


def gguf_bytes(path: str | Path, n_gpu_layers: int) -> tuple[dict[int, int], int, object]:
    """(routed-expert bytes per offloaded layer, other offloaded bytes, CloverConfig) from the
    GGUF's tensor table. token_embd stays on the CPU (llama.cpp's input layer)."""
    from ..gguf_io.reader import config_from_reader, open_gguf

    r = open_gguf(path)
    cfg = config_from_reader(r, path)
    on_gpu, output = gpu_layers(cfg.num_hidden_layers, n_gpu_layers)
    on = set(on_gpu)
    experts: dict[int, int] = {il: 0 for il in on_gpu}
    other = 0
    for t in r.tensors:
        n = int(t.n_bytes)
        m = LAYER_TENSOR.match(t.name)
        if m:
            il = int(m.group(1))
            if il not in on:
                continue
            if EXPERT_TENSOR.match(t.name):
                experts[il] += n
            else:
                other += n
        elif output and not t.name.startswith("token_embd"):
            other += n
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
    path: str | Path, n_gpu_layers: int, n_seq: int = 1, devices: list[GpuDevice] | None = None
) -> Placement | None:
    """The placement for this GGUF on the GPU devices (those ggml reports when None); None when
    there is no GPU device. FitError when even the non-expert weights do not fit."""
    from . import N_UBATCH, RESERVE_BYTES

    devices = gpu_devices() if devices is None else devices
    if not devices:
        return None
    experts, other, cfg = gguf_bytes(path, n_gpu_layers)
    overhead = cost.state_bytes(cfg, n_seq) + cost.compute_buffer_bytes(cfg, N_UBATCH) + RESERVE_BYTES * len(devices)
    free = sum(d.free for d in devices)
    chosen = choose_cpu_layers(experts, other, free, overhead)
    cpu = sum(experts[il] for il in chosen)
    gpu = sum(experts.values()) - cpu + other + overhead
    return Placement(chosen, cpu, gpu, len(experts), devices)


def fit_overrides(
    path: str | Path,
    n_gpu_layers: int,
    fit: bool | None,
    explicit: bool,
    n_seq: int = 1,
    log=print,
    devices: list[GpuDevice] | None = None,
    rpc: bool = False,
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
    p = fit_gguf(path, n_gpu_layers, n_seq, devices)
    if p is None:
        log(NO_GPU)
        return []
    log(p.message())
    ot = p.override()
    return [ot] if ot else []
