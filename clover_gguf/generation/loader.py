"""One front door for generation: ``load(path)`` opens a safetensors model folder (the PyTorch
reference) or a ``.gguf`` file (the patched llama.cpp runtime) as a Generator. Both backends
have the same interface, so `run`, `serve`, `eval` and training's checks open models one way:

- ``generate(ids, cfg, on_block=None) -> GenerationResult`` with a GenerationConfig
  (``config(**kw)`` fills in the model's block size, mask and EOS tokens);
- ``tokenize(text, add_special=False)`` (``add_special``: BOS/EOS as the model's
  add_bos_token/add_eos_token say, llama-clover-cli's rule), ``detokenize(ids)``,
  ``chat_prompt(messages, enable_thinking=True, **kw)``, ``token_id(text)``;
- facts: ``backend`` ("llama.cpp", "pytorch-float32"), ``path``, ``n_vocab``, ``n_ctx``,
  ``block_size``, ``mask_token_id``, ``eos_token_id``, ``placement`` (the runtime's, with RPC);
- ``logits_backend()``: the reference/generate.py LogitsBackend of one sequence, for callers
  that drive the denoising loop themselves (eval's stability check); ``close()``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..constants import DEFAULT_CONTEXT_LENGTH
from ..reference.generate import GenerationResult, NonFiniteError, TorchBackend, generate
from .config import GenerationConfig


def load(
    path: str | Path,
    *,
    threads: int | None = None,
    dtype: str = "float32",
    n_gpu_layers: int = 0,
    experts_on_cpu: bool = False,
    override_tensor=(),
    fit: bool | None = None,
    rpc: str | None = None,
    log=None,
    **runtime_options,
):
    """A TorchGenerator for a model folder, a RuntimeGenerator for a ``.gguf``. ``threads``: the
    runtime's n_threads, or torch's thread count (when given). ``dtype``: the reference's
    (folders only). For a .gguf: ``-ngl``, ``--experts-on-cpu``, ``-ot REGEX=CPU`` specs,
    ``--fit`` (plan/placement.py), ``--rpc``, and CloverRuntime's other keyword arguments
    (n_seq_max, n_ubatch, n_batch, n_ctx, op_offload, mmap)."""
    path = Path(path)
    if path.suffix == ".gguf":
        return RuntimeGenerator.open(
            path, threads, n_gpu_layers, experts_on_cpu, override_tensor, fit, rpc, log, **runtime_options
        )
    if threads:
        torch.set_num_threads(threads)
    return TorchGenerator.from_dir(path, dtype)


class TorchGenerator:
    """The PyTorch reference (reference/generate.py's loop) and the folder's tokenizer."""

    def __init__(
        self, model, tokenizer=None, path: Path | None = None, dtype: str = "float32", n_ctx: int | None = None
    ):
        c = model.config
        self.model, self.tokenizer, self.path = model, tokenizer, path
        self.backend = f"pytorch-{dtype}"
        self.n_vocab, self.block_size = c.vocab_size, c.block_size
        self.mask_token_id, self.eos_token_id = c.mask_token_id, c.eos_token_id
        self.n_ctx = n_ctx or DEFAULT_CONTEXT_LENGTH
        self.placement = None

    @classmethod
    def from_dir(cls, model_dir: Path, dtype: str = "float32") -> TorchGenerator:
        from ..reference.model import CloverModel

        model = CloverModel.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        tok = None
        if (model_dir / "tokenizer.json").exists():
            from ..tokenizer import CloverTokenizer

            tok = CloverTokenizer.from_dir(model_dir)
        return cls(model, tok, model_dir, dtype, _context_length(model_dir))

    def _tok(self):
        if self.tokenizer is None:
            raise ValueError(f"{self.path}: no tokenizer.json; pass token ids instead of a text prompt")
        return self.tokenizer

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        tok = self._tok()
        ids = tok.encode(text)
        if add_special and tok.config.get("add_bos_token") is True and tok.bos_id is not None:
            ids = [tok.bos_id, *ids]
        if add_special and tok.config.get("add_eos_token") is True and tok.eos_id is not None:
            ids = [*ids, tok.eos_id]
        return ids

    def detokenize(self, ids) -> str:
        return self._tok().decode(ids)

    def chat_prompt(self, messages: list[dict], enable_thinking: bool = True, **kwargs) -> str:
        return self._tok().apply_chat_template(messages, enable_thinking=enable_thinking, **kwargs)

    def token_id(self, text: str) -> int | None:
        return self._tok().token_to_id(text)

    def config(self, **kw) -> GenerationConfig:
        return _config(self, kw)

    def logits_backend(self) -> TorchBackend:
        return TorchBackend(self.model)

    def generate(self, ids, cfg: GenerationConfig, on_block=None) -> GenerationResult:
        try:
            return generate(TorchBackend(self.model), ids, cfg, on_block=on_block)
        except NonFiniteError as e:  # never tokens from NaN/Inf logits; the message names the model
            if self.path is None:
                raise
            raise NonFiniteError(f"{self.path}: {e}") from None

    def close(self) -> None:
        pass


class RuntimeGenerator:
    """A GGUF through the patched llama.cpp (runtime/runtime.py's CloverRuntime, as ``rt``)."""

    backend = "llama.cpp"

    def __init__(self, rt):
        self.rt, self.path = rt, rt.path
        self.n_vocab, self.n_ctx, self.block_size = rt.n_vocab, rt.n_ctx_train, rt.default_block_size
        self.mask_token_id, self.eos_token_id = rt.mask_token_id, rt.eos_token_id
        self.placement = rt.placement if rt.rpc_servers else None

    @classmethod
    def open(cls, path, threads, n_gpu_layers, experts_on_cpu, override_tensor, fit, rpc, log, **kw):
        import sys

        from ..plan.placement import fit_overrides
        from ..runtime.bindings import parse_override
        from ..runtime.runtime import CloverRuntime

        cpu_tensors = [parse_override(s) for s in override_tensor]
        # --fit: the leading layers' experts that must stay in CPU memory for the rest to fit
        explicit = bool(override_tensor) or experts_on_cpu
        log = log or (lambda m: print(m, file=sys.stderr))
        n_seq, op_offload = kw.get("n_seq_max", 1), kw.get("op_offload", True)
        ot = fit_overrides(
            path, n_gpu_layers, fit, explicit, n_seq=n_seq, log=log, rpc=bool(rpc), op_offload=op_offload
        )
        cpu_tensors += [parse_override(s) for s in ot]
        rt = CloverRuntime(
            path,
            n_threads=threads,
            n_gpu_layers=n_gpu_layers,
            experts_on_cpu=experts_on_cpu,
            cpu_tensors=cpu_tensors,
            rpc_servers=rpc,
            **kw,
        )
        return cls(rt)

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        # add_special: BOS/EOS as the GGUF's add_bos_token/add_eos_token say
        return self.rt.tokenize(text, add_special=add_special)

    def detokenize(self, ids) -> str:
        return self.rt.detokenize(ids)

    def chat_prompt(self, messages: list[dict], enable_thinking: bool = True, **kwargs) -> str:
        return self.rt.chat_prompt(messages, enable_thinking=enable_thinking, **kwargs)

    def token_id(self, text: str) -> int | None:
        return self.rt.token_id(text)

    def config(self, **kw) -> GenerationConfig:
        return _config(self, kw)

    def logits_backend(self):
        from ..runtime.runtime import RuntimeBackend

        return RuntimeBackend(self.rt)

    def generate(self, ids, cfg: GenerationConfig, on_block=None) -> GenerationResult:
        return self.rt.generate(ids, cfg, on_block=on_block)

    def close(self) -> None:
        self.rt.close()


def _config(gen, kw: dict) -> GenerationConfig:
    """A GenerationConfig with the model's block size, mask and EOS tokens unless ``kw`` sets them."""
    facts = {"block_size": gen.block_size, "mask_token_id": gen.mask_token_id, "eos_token_id": gen.eos_token_id}
    return GenerationConfig(**{**facts, **{k: v for k, v in kw.items() if v is not None or k not in facts}})


def _context_length(model_dir: Path) -> int:
    """config.json's max_position_embeddings (checked by CloverConfig), else what the converter writes."""
    d = json.loads((model_dir / "config.json").read_text())
    return int(d.get("max_position_embeddings", DEFAULT_CONTEXT_LENGTH))
