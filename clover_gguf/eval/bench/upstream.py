"""llama.cpp's own forward passes, for side-by-side timings: a Qwen3-MoE GGUF that holds a Clover
GGUF's embedding, attention, router, expert and output tensors byte for byte (so upstream does
slightly less work per layer: no memory, conv or shared expert), driven through llama.cpp's
plain llama_decode by ctypes (llama-cpp-python's low-level bindings) in the same build.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.gguf_writer import WriterState

from ...constants import ARCH, Keys
from ...outputs import output_file
from . import BenchError

TWIN_ARCH = "qwen3moe"
# Clover keys with the same meaning in qwen3moe (suffix after "{arch}.")
_SHARED_KEYS = (
    "context_length",
    "embedding_length",
    "block_count",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "rope.freq_base",
    "rope.dimension_count",
    "expert_count",
    "expert_used_count",
    "expert_feed_forward_length",
)
# the tensors a Qwen3-MoE layer has; the rest of Clover's (memory, conv, shared expert) stay out
_TWIN_TENSOR = r"^(token_embd|output_norm|output)\.weight$|^blk\.\d+\.(attn_(norm|q|k|v|output|q_norm|k_norm)|ffn_(norm|gate_inp|gate_exps|up_exps|down_exps))\.weight$"


def _field_value(field):
    if field.types[0] == GGUFValueType.ARRAY:
        return [field.contents(i) for i in range(len(field.data))], field.types[-1]
    return field.contents(), None


def write_twin(clover_gguf: str | Path, out: str | Path) -> Path:
    """The Qwen3-MoE twin of a Clover GGUF (same bytes for every tensor they share)."""
    import re

    out = Path(out)
    r = GGUFReader(clover_gguf)
    w = GGUFWriter(None, TWIN_ARCH)
    for suffix in _SHARED_KEYS:
        f = r.get_field(f"{ARCH}.{suffix}")
        if f is not None:
            v, _ = _field_value(f)
            w.add_key_value(f"{TWIN_ARCH}.{suffix}", v, f.types[0])
    n_ff = int(r.get_field(Keys.fmt(Keys.EXPERT_FEED_FORWARD_LENGTH)).contents())
    w.add_key_value(f"{TWIN_ARCH}.feed_forward_length", n_ff, GGUFValueType.UINT32)
    for name, f in r.fields.items():
        if name.startswith("tokenizer."):
            v, sub = _field_value(f)
            w.add_key_value(name, v, f.types[0], sub_type=sub)
    for t in r.tensors:
        if re.match(_TWIN_TENSOR, t.name):
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)  # quantized data is byte-shaped
    with output_file(out, force=True) as f:
        w.fout, w.state = [f], WriterState.EMPTY
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    return out


class Upstream:
    """A llama.cpp context on the twin: timed forward passes of n tokens with k rows of logits."""

    def __init__(self, gguf: str | Path, n_threads: int, n_gpu_layers: int = 0, n_ctx: int = 2048, n_batch: int = 512):
        from ...runtime import bindings as B

        self.lib = B.load()
        lc = self.lc = self.lib.lc
        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = n_gpu_layers
        self.model = lc.llama_model_load_from_file(str(gguf).encode(), mp)
        if not self.model:
            raise BenchError(f"llama.cpp could not load {gguf}")
        cp = B.context_params(self.lib, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=n_threads)
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise BenchError(f"llama.cpp could not create a context for {gguf}")
        self.mem = lc.llama_get_memory(self.ctx)
        self.n_batch = n_batch

    def close(self) -> None:
        if self.ctx:
            self.lc.llama_free(self.ctx)
            self.lc.llama_model_free(self.model)
            self.ctx = self.model = None

    def decode(self, tokens: list[int], pos0: int, n_logits: int) -> None:
        """One llama_decode of the tokens at pos0.., with logits for the first n_logits rows
        (copied to the host, as llama_decode does)."""
        lc = self.lc
        n = len(tokens)
        b = lc.llama_batch_init(n, 0, 1)
        try:
            for i, t in enumerate(tokens):
                b.token[i] = t
                b.pos[i] = pos0 + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = 0
                b.logits[i] = 1 if i < n_logits else 0
            b.n_tokens = n
            rc = lc.llama_decode(self.ctx, b)
            if rc != 0:
                raise BenchError(f"llama_decode failed ({rc})")
            lc.llama_synchronize(self.ctx)
        finally:
            lc.llama_batch_free(b)

    def decode_each(self, tokens: list[int], pos0: int) -> None:
        """Autoregressive generation's passes: one token per llama_decode, with its logits."""
        for i, t in enumerate(tokens):
            self.decode([t], pos0 + i, 1)

    def forget_from(self, pos: int) -> None:
        """Remove positions >= pos from the KV cache (to repeat a pass at the same place)."""
        self.lc.llama_memory_seq_rm(self.mem, 0, pos, -1)

    def clear(self) -> None:
        self.lc.llama_memory_clear(self.mem, True)


__all__ = ["TWIN_ARCH", "Upstream", "write_twin"]
