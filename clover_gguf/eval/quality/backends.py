"""Block-logit providers for the eval, one interface over three ways to run a model:

* ``reference-bf16``: the PyTorch reference (float32 compute) on the checkpoint's BF16 weights;
* ``reference-dequant``: the same code on a GGUF's weights dequantized with gguf-py
  (``gguf_reader.load_gguf_as_hf_tensors``): measures the quantization of the weights alone;
* ``runtime``: the patched llama.cpp (``clover_gguf.runtime.CloverRuntime``), when built:
  measures weights + kernels as users run them.

``window_logits(clean [nb, B], noisy [R, nb, B], select [R, nb, B]) -> [n, V]``: the logits
of the selected (masked) positions of every noisy block, each block read against the state
after committing the clean blocks before it, ordered row-major over ``select``.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import torch

from ...util import default_threads, sha256_file


def model_dir_hash(model_dir) -> str:
    """sha256 over config.json and the safetensors files (names + bytes)."""
    d = Path(model_dir)
    h = hashlib.sha256()
    for p in sorted(d.glob("config.json")) + sorted(d.glob("*.safetensors")):
        h.update(p.name.encode())
        h.update(sha256_file(p).encode())
    return h.hexdigest()


def load_reference(model_dir):
    from ...reference.model import CloverModel

    return CloverModel.from_pretrained(model_dir, dtype=torch.float32)


def load_dequantized(gguf_path):
    """(model, config) of the PyTorch reference on a GGUF's dequantized weights."""
    from ...gguf_io.reader import load_gguf_as_hf_tensors
    from ...reference.model import CloverModel

    cfg, tensors = load_gguf_as_hf_tensors(gguf_path)
    return CloverModel.from_tensors(cfg, tensors, torch.float32)


def runtime_status() -> tuple[bool, str]:
    """(available, why not / what) for the llama.cpp runtime."""
    try:
        from ...runtime import bindings, runtime  # noqa: F401

        bindings.load()
    except Exception as e:  # not written yet, not built, or libllama without the clover API
        return False, f"{type(e).__name__}: {e}"
    return True, "patched llama.cpp loaded (clover_gguf.runtime)"


def open_runtime(gguf_path, n_threads: int | None = None, n_gpu_layers: int = 0, max_block: int | None = None):
    """CloverRuntime on a GGUF; ``max_block`` raises n_ubatch/n_batch to fit that block size."""
    from ...runtime.runtime import CloverRuntime

    kw = {}
    if max_block and max_block > 256:  # CloverRuntime's default n_ubatch is max(256, B)
        kw = {"n_ubatch": int(max_block), "n_batch": int(max_block)}
    return CloverRuntime(str(gguf_path), n_threads=n_threads or default_threads(), n_gpu_layers=n_gpu_layers, **kw)


class TorchProvider:
    """The PyTorch reference: clean blocks committed layer-parallel (chunked delta rule, one
    forward for the whole window) and every noisy copy read against the clean state at its
    block's start -- the two-stream forward of training, without its loss."""

    def __init__(self, model, name: str):
        self.model, self.name = model, name
        self.vocab_size = model.config.vocab_size

    @torch.no_grad()
    def window_logits(self, clean: torch.Tensor, noisy: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
        nb, B = clean.shape
        pos = torch.arange(nb * B).view(1, nb, B)
        # one forward: the clean window committed once, every noisy copy reads its states
        return self.model.forward_train(clean[None].long(), noisy.long(), pos, None, select=select)

    def diagnose(self, block: list[int]) -> str:
        """The first module whose output is not finite, over one denoising step of ``block``."""
        from ...reference.nonfinite import first_nonfinite_module

        found, checked = first_nonfinite_module(self.model, [], block)
        return f"; the first non-finite output is {found}" if found else f"; all {checked} module outputs finite"


class RuntimeProvider:
    """The llama.cpp runtime, block by block: for each block, every noisy copy is denoised
    (state read only), then the clean block is committed."""

    name = "runtime"

    def __init__(self, rt):
        self.rt = rt

    def window_logits(self, clean, noisy, select):
        nb, B = clean.shape
        R = noisy.shape[0]
        rows = {}
        self.rt.reset()
        for b in range(nb):
            for r in range(R):
                if select[r, b].any():
                    lg = torch.as_tensor(self.rt.block_logits([int(x) for x in noisy[r, b]])).float()
                    rows[(r, b)] = lg[select[r, b]]
            self.rt.commit([int(x) for x in clean[b]], B)
        return torch.cat([rows[(r, b)] for r in range(R) for b in range(nb) if (r, b) in rows])

    def diagnose(self, block: list[int]) -> str:
        return self.rt.diagnose_nonfinite([], block)


def timed(fn, *a, **k):
    t0 = time.perf_counter()
    out = fn(*a, **k)
    return out, time.perf_counter() - t0
