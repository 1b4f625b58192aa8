"""The one table of the values a Clover model may have: config.json keys, the GGUF keys the
converter writes from them, and the rules that tie them together.

The converter refuses a config.json that breaks a limit, the GGUF reader refuses such a
file, and the patched llama.cpp (patches/0007, ``src/clover-validate.cpp``, which mirrors
this table line by line; tests/test_limits.py compares the two) refuses to load it, all
with the same wording::

    <key> = <value>: must be an integer in [1, 1024]

The bounds are wide enough for any real Clover (Clover-35B-A3B is far inside them) and tight
enough that nothing derived from them overflows or asks for an absurd allocation before
the file's tensors are even looked at.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .constants import ARCH
from .errors import CloverError


class LimitError(CloverError, ValueError):
    """A value outside its limit; the message names the key, the value and the range."""


@dataclass(frozen=True)
class Limit:
    gguf: str  # GGUF key suffix after "{arch}."
    config: str | None  # config.json key, None when config.json has no such key
    lo: float
    hi: float
    integer: bool = True
    lo_open: bool = False  # lo itself is refused

    @property
    def gguf_key(self) -> str:
        return f"{ARCH}.{self.gguf}"

    def describe(self) -> str:
        """'an integer in [1, 1024]' / 'a finite number in (0, 1]'."""
        lo = f"{self.lo:g}" if not self.integer else str(int(self.lo))
        hi = f"{self.hi:g}" if not self.integer else str(int(self.hi))
        what = "an integer" if self.integer else "a finite number"
        return f"{what} in {'(' if self.lo_open else '['}{lo}, {hi}]"

    def ok(self, v) -> bool:
        if isinstance(v, bool) or not isinstance(v, int | float):
            return False
        if self.integer and not isinstance(v, int):
            return False
        if isinstance(v, float) and not math.isfinite(v):  # (an int of any size compares exactly)
            return False
        return (v > self.lo if self.lo_open else v >= self.lo) and v <= self.hi

    def check(self, v, key: str | None = None) -> None:
        if not self.ok(v):
            raise LimitError(f"{key or self.gguf_key} = {fmt_value(v)}: must be {self.describe()}")


def fmt_value(v) -> str:
    """A value as both sides print it: integers plainly, floats with %g, strings quoted."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else f"{v:g}"
    if isinstance(v, str):
        return repr(v)
    if isinstance(v, int) and abs(v) >= 10**30:  # JSON integers have no size limit
        digits = len(str(abs(v)))
        return f"{str(v)[:12]}... ({digits} digits)"
    return str(v)


MAX_VOCAB = 1 << 24
MAX_STATE_BYTES = 16 << 30  # the memory state of all layers: block_count * head_count_kv * D^2 * 4

LIMITS: tuple[Limit, ...] = (
    Limit("vocab_size", "vocab_size", 1, MAX_VOCAB),
    Limit("context_length", "max_position_embeddings", 1, 1 << 30),
    Limit("embedding_length", "hidden_size", 1, 65536),
    Limit("block_count", "num_hidden_layers", 1, 512),
    Limit("feed_forward_length", None, 1, 1 << 20),
    Limit("attention.head_count", "num_attention_heads", 1, 256),
    Limit("attention.head_count_kv", "num_key_value_heads", 1, 256),
    Limit("attention.key_length", "head_dim", 2, 512),
    Limit("attention.value_length", None, 2, 512),
    Limit("attention.layer_norm_rms_epsilon", "rms_norm_eps", 0.0, 1.0, integer=False, lo_open=True),
    Limit("rope.freq_base", "rope_theta", 1.0, 1e12, integer=False),
    Limit("rope.dimension_count", None, 2, 512),
    Limit("expert_count", "num_experts", 1, 1024),
    Limit("expert_used_count", "num_experts_per_tok", 1, 1024),
    Limit("expert_feed_forward_length", "moe_intermediate_size", 1, 1 << 20),
    Limit("expert_shared_feed_forward_length", "shared_expert_intermediate_size", 1, 1 << 20),
    Limit("diffusion.block_size", "block_size", 1, 1024),
    Limit("ssm.conv_kernel", "conv_kernel_size", 1, 64),
    Limit("memory.l2norm_epsilon", None, 0.0, 1.0, integer=False, lo_open=True),
)
BY_GGUF = {lim.gguf: lim for lim in LIMITS}
BY_CONFIG = {lim.config: lim for lim in LIMITS if lim.config}
TOKEN_ID_KEYS = ("mask_token_id", "bos_token_id", "eos_token_id", "pad_token_id")


def check_config_values(get, key_name=lambda lim: lim.gguf_key) -> None:
    """Check every limit and rule on values given by ``get(limit) -> value or None`` (None:
    absent). ``key_name(limit)`` is how a message names the key. Raises LimitError."""
    vals = {}
    for lim in LIMITS:
        v = get(lim)
        if v is not None:
            lim.check(v, key_name(lim))
            vals[lim.gguf] = v

    def name(g):
        return key_name(BY_GGUF[g])

    def rule(cond: bool, g: str, what: str):
        if not cond:
            raise LimitError(f"{name(g)} = {fmt_value(vals[g])}: {what}")

    h, hkv = vals.get("attention.head_count"), vals.get("attention.head_count_kv")
    if h is not None and hkv is not None:
        rule(h % hkv == 0, "attention.head_count_kv", f"must divide {name('attention.head_count')} ({h})")
    d = vals.get("attention.key_length")
    if d is not None:
        rule(d % 2 == 0, "attention.key_length", "must be even (RoPE pairs dimensions)")
        for other in ("attention.value_length", "rope.dimension_count"):
            if other in vals:
                rule(vals[other] == d, other, f"must equal {name('attention.key_length')} ({d})")
    e, k = vals.get("expert_count"), vals.get("expert_used_count")
    if e is not None and k is not None:
        rule(k <= e, "expert_used_count", f"must be at most {name('expert_count')} ({e})")
    b, ctx = vals.get("diffusion.block_size"), vals.get("context_length")
    if b is not None and ctx is not None:
        rule(ctx >= b, "context_length", f"must be at least {name('diffusion.block_size')} ({b})")
    n_layer = vals.get("block_count")
    if n_layer is not None and hkv is not None and d is not None:
        state = n_layer * hkv * d * d * 4
        rule(
            state <= MAX_STATE_BYTES,
            "block_count",
            f"memory state of {state} bytes ({name('block_count')} x {name('attention.head_count_kv')} x "
            f"{name('attention.key_length')}^2 x 4) exceeds {MAX_STATE_BYTES} bytes",
        )


def check_token_id(key: str, v, vocab_size: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab_size:
        raise LimitError(f"{key} = {fmt_value(v)}: must be a token id in [0, {vocab_size - 1}]")
