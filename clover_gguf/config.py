"""config.json: load, validate, presets, and the tensor shapes a config implies."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .constants import (
    CONFIG_KEYS,
    EXPERT_TENSORS,
    EXPERTS_AFTER,
    GLOBAL_TENSORS_FIRST,
    GLOBAL_TENSORS_LAST,
    HF_ARCHITECTURE,
    HF_EXPERT_FUSED_SHAPES,
    HF_EXPERT_PER,
    LAYER_TENSORS,
    MODEL_TYPE,
    dims,
)
from .errors import CloverError
from .inputs import DuplicateKeyError, loads_json
from .limits import TOKEN_ID_KEYS, LimitError, check_config_values, check_token_id, fmt_value
from .outputs import write_json


class ConfigError(CloverError, ValueError):
    """A config.json that is missing a key, has a wrong type, or inconsistent shapes."""


@dataclass(frozen=True)
class CloverConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    conv_kernel_size: int
    block_size: int
    rms_norm_eps: float
    rope_theta: float
    mask_token_id: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    norm_topk_prob: bool
    tie_word_embeddings: bool
    torch_dtype: str = "bfloat16"

    # ---- construction -----------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> CloverConfig:
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object")
        if d.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ConfigError(f"{source}: key 'model_type' is {d.get('model_type')!r}, expected {MODEL_TYPE!r}")
        vals = {}
        for key, typ in CONFIG_KEYS.items():
            if key not in d:
                raise ConfigError(f"{source}: missing key '{key}'")
            v = d[key]
            if typ is float and isinstance(v, int) and not isinstance(v, bool):
                if abs(v) > 1e300:  # float() of a longer JSON integer raises OverflowError
                    raise ConfigError(f"{source}: key '{key}' = {fmt_value(v)}: must be a finite number")
                v = float(v)
            if typ is int and (isinstance(v, bool) or not isinstance(v, int)):
                raise ConfigError(f"{source}: key '{key}' must be an integer, got {v!r}")
            if typ is float and not isinstance(v, float):
                raise ConfigError(f"{source}: key '{key}' must be a number, got {v!r}")
            if typ is bool and not isinstance(v, bool):
                raise ConfigError(f"{source}: key '{key}' must be true or false, got {v!r}")
            vals[key] = v
        vals["torch_dtype"] = d.get("torch_dtype", "bfloat16")
        ctx = d.get("max_position_embeddings")
        try:
            # the limits first: nothing below may size anything from an absurd value
            check_config_values(
                lambda lim: ctx if lim.config == "max_position_embeddings" else vals.get(lim.config),
                lambda lim: f"key '{lim.config}'",
            )
        except LimitError as e:
            raise ConfigError(f"{source}: {e}") from None
        cfg = cls(**vals)
        cfg.validate(source)
        return cfg

    @classmethod
    def load(cls, path: str | Path) -> CloverConfig:
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.exists():
            raise ConfigError(f"{p}: config file not found")
        if not p.is_file():
            raise ConfigError(f"{p}: not a regular file")
        try:
            text = p.read_bytes().decode("utf-8")
            d = loads_json(text)
        except DuplicateKeyError as e:  # json.loads would keep the last value silently
            raise ConfigError(f"{p}: key '{e.key}' is given more than once") from None
        except OSError as e:
            raise ConfigError(f"{p}: cannot read ({e.strerror or e})") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{p}: not UTF-8 text (byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not valid JSON ({e})") from None
        except RecursionError:
            raise ConfigError(f"{p}: not valid JSON (nested too deeply)") from None
        return cls.from_dict(d, source=str(p))

    def validate(self, source: str = "config.json") -> None:
        """The limits (limits.py) and the rules that tie the keys together."""
        try:
            check_config_values(lambda lim: getattr(self, lim.config or "", None), lambda lim: f"key '{lim.config}'")
            for k in TOKEN_ID_KEYS:
                check_token_id(f"key '{k}'", getattr(self, k), self.vocab_size)
        except LimitError as e:
            raise ConfigError(f"{source}: {e}") from None
        if self.tie_word_embeddings:
            raise ConfigError(f"{source}: key 'tie_word_embeddings' must be false for Clover")

    def to_dict(self) -> dict:
        d = {"model_type": MODEL_TYPE, "architectures": [HF_ARCHITECTURE]}
        d.update(asdict(self))
        return d

    def save(self, path: str | Path) -> None:
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        write_json(p, self.to_dict())

    def sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    # ---- derived ------------------------------------------------------------------------
    @property
    def kv_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def symbols(self) -> dict[str, int]:
        """The shape symbols of constants.TensorSpec."""
        return {
            "V": self.vocab_size,
            "d": self.hidden_size,
            "H": self.num_attention_heads,
            "Hkv": self.num_key_value_heads,
            "D": self.head_dim,
            "E": self.num_experts,
            "Fe": self.moe_intermediate_size,
            "Fs": self.shared_expert_intermediate_size,
            "Kc": self.conv_kernel_size,
        }

    def expected_tensors(self, fused: bool = False) -> dict[str, tuple[int, ...]]:
        """HF tensor name -> shape, in spec section 5 order (constants' tensor table)."""
        sym = self.symbols()
        t = {s.hf: dims(s.shape, sym) for s in GLOBAL_TENSORS_FIRST}
        for i in range(self.num_hidden_layers):
            for s in LAYER_TENSORS:
                t[s.hf.format(bid=i)] = dims(s.shape, sym)
                if s.hf != EXPERTS_AFTER:
                    continue
                if fused:
                    for name, shape in HF_EXPERT_FUSED_SHAPES.items():
                        t[name.format(bid=i)] = dims(shape, sym)
                else:
                    for x in range(self.num_experts):
                        for proj, (_, shape) in EXPERT_TENSORS.items():
                            t[HF_EXPERT_PER.format(bid=i, xid=x, proj=proj)] = dims(shape, sym)
        t.update({s.hf: dims(s.shape, sym) for s in GLOBAL_TENSORS_LAST})
        return t

    def n_params(self) -> int:
        n = 0
        for shape in self.expected_tensors().values():
            k = 1
            for s in shape:
                k *= s
            n += k
        return n


PRESETS: dict[str, dict] = {
    # Clover-35B-A3B's shapes (spec section 1); token ids are placeholders for synth.
    "clover-35b-a3b": dict(
        vocab_size=248320,
        hidden_size=2048,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=256,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        conv_kernel_size=4,
        block_size=32,
        rms_norm_eps=1e-6,
        rope_theta=10000000.0,
        mask_token_id=248319,
        bos_token_id=248316,
        eos_token_id=248317,
        pad_token_id=248317,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
    "clover-tiny": dict(
        vocab_size=4100,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        conv_kernel_size=4,
        block_size=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        mask_token_id=1,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
}


def preset(name: str, **overrides) -> CloverConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    d = dict(PRESETS[name])
    d.update(overrides)
    return CloverConfig.from_dict(d, source=f"preset {name}")
