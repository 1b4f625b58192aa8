"""One source of truth for Clover's names: config keys, HF tensor names, GGUF keys and
GGUF tensor names, and the mapping between them (gguf-py's constants.py style).

Every other module (reference loader, converter, GGUF reader, eval, the llama.cpp patch
that reads these files) must take names from here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ARCH = "clover"
MODEL_TYPE = "clover"
HF_ARCHITECTURE = "CloverForBlockDiffusion"

# --- config.json -------------------------------------------------------------------
# key -> python type; all are required (spec section 1).
CONFIG_KEYS: dict[str, type] = {
    "vocab_size": int,
    "hidden_size": int,
    "num_hidden_layers": int,
    "num_attention_heads": int,
    "num_key_value_heads": int,
    "head_dim": int,
    "num_experts": int,
    "num_experts_per_tok": int,
    "moe_intermediate_size": int,
    "shared_expert_intermediate_size": int,
    "conv_kernel_size": int,
    "block_size": int,
    "rms_norm_eps": float,
    "rope_theta": float,
    "mask_token_id": int,
    "bos_token_id": int,
    "eos_token_id": int,
    "pad_token_id": int,
    "norm_topk_prob": bool,
    "tie_word_embeddings": bool,
}

# l2norm(x) = x / sqrt(sum(x^2) + L2NORM_EPS)  (spec section 2.3)
L2NORM_EPS = 1e-6

# the threshold schedule's default confidence (docs/CONTRACTS.md)
DEFAULT_THRESHOLD = 0.9


# --- GGUF metadata keys (arch-prefixed keys use "{arch}") ------------------------------
class Keys:
    # llama.cpp standard keys, same meaning
    CONTEXT_LENGTH = "{arch}.context_length"
    EMBEDDING_LENGTH = "{arch}.embedding_length"
    BLOCK_COUNT = "{arch}.block_count"
    FEED_FORWARD_LENGTH = "{arch}.feed_forward_length"
    HEAD_COUNT = "{arch}.attention.head_count"
    HEAD_COUNT_KV = "{arch}.attention.head_count_kv"
    KEY_LENGTH = "{arch}.attention.key_length"
    VALUE_LENGTH = "{arch}.attention.value_length"
    RMS_EPS = "{arch}.attention.layer_norm_rms_epsilon"
    ROPE_FREQ_BASE = "{arch}.rope.freq_base"
    ROPE_DIMENSION_COUNT = "{arch}.rope.dimension_count"
    EXPERT_COUNT = "{arch}.expert_count"
    EXPERT_USED_COUNT = "{arch}.expert_used_count"
    EXPERT_FEED_FORWARD_LENGTH = "{arch}.expert_feed_forward_length"
    EXPERT_SHARED_FEED_FORWARD_LENGTH = "{arch}.expert_shared_feed_forward_length"
    EXPERT_WEIGHTS_NORM = "{arch}.expert_weights_norm"
    EXPERT_GATING_FUNC = "{arch}.expert_gating_func"  # 1 = softmax (llama.cpp enum)
    CONV_KERNEL = "{arch}.ssm.conv_kernel"  # K_c of the right-context conv (the SSM family's key)
    # Clover's own
    DIFFUSION_BLOCK_SIZE = "{arch}.diffusion.block_size"  # default decoding block B
    MEMORY_L2NORM_EPS = "{arch}.memory.l2norm_epsilon"  # eps of l2norm on q/k
    # tokenizer
    TOKENIZER_MODEL = "tokenizer.ggml.model"
    TOKENIZER_PRE = "tokenizer.ggml.pre"
    MASK_ID = "tokenizer.ggml.mask_token_id"
    BOS_ID = "tokenizer.ggml.bos_token_id"
    EOS_ID = "tokenizer.ggml.eos_token_id"
    PAD_ID = "tokenizer.ggml.padding_token_id"
    CHAT_TEMPLATE = "tokenizer.chat_template"
    # provenance
    SOURCE_CONFIG_SHA256 = "clover_gguf.source_config_sha256"
    # sha256 of the source weights as the converter read them (convert/fingerprint.py): eval
    # refuses a GGUF whose value is not its reference's
    SOURCE_WEIGHTS_SHA256 = "clover_gguf.source_weights_sha256"
    TOOL_VERSION = "clover_gguf.version"
    RECIPE = "clover_gguf.recipe"
    # --- converter (clover_gguf.convert) ---
    VOCAB_SIZE = "{arch}.vocab_size"
    GENERAL_ARCHITECTURE = "general.architecture"
    GENERAL_TYPE = "general.type"  # "model"
    GENERAL_NAME = "general.name"
    GENERAL_SIZE_LABEL = "general.size_label"
    GENERAL_LICENSE = "general.license"
    GENERAL_FILE_TYPE = "general.file_type"  # llama_ftype of the experts' type
    GENERAL_QUANT_VERSION = "general.quantization_version"
    TOKENIZER_TOKENS = "tokenizer.ggml.tokens"
    TOKENIZER_TOKEN_TYPE = "tokenizer.ggml.token_type"
    TOKENIZER_MERGES = "tokenizer.ggml.merges"
    ADD_BOS = "tokenizer.ggml.add_bos_token"
    ADD_EOS = "tokenizer.ggml.add_eos_token"
    # true when the file carries the converter's byte-level placeholder vocabulary (the
    # model dir had no tokenizer.json); such a file loads but does not tokenize text
    TOKENIZER_PLACEHOLDER = "clover_gguf.tokenizer_placeholder"
    SOURCE_LAYOUT = "clover_gguf.source_expert_layout"  # "per_expert" | "fused"
    # llama-quantize's own provenance keys when an imatrix weighted the quantization
    QUANTIZE_IMATRIX_FILE = "quantize.imatrix.file"
    QUANTIZE_IMATRIX_DATASET = "quantize.imatrix.dataset"
    QUANTIZE_IMATRIX_N_ENTRIES = "quantize.imatrix.entries_count"
    QUANTIZE_IMATRIX_N_CHUNKS = "quantize.imatrix.chunks_count"
    # llama.cpp's GGUF imatrix file (tools/imatrix): general.type = "imatrix", per weight
    # tensor W the F32 tensors "W.in_sum2" [n_mat, n_per_row] and "W.counts" [n_mat, 1]
    IMATRIX_DATASETS = "imatrix.datasets"
    IMATRIX_CHUNK_COUNT = "imatrix.chunk_count"
    IMATRIX_CHUNK_SIZE = "imatrix.chunk_size"

    @staticmethod
    def fmt(key: str, arch: str = ARCH) -> str:
        return key.format(arch=arch)


EXPERT_GATING_FUNC_SOFTMAX = 1  # llama.cpp LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
TOKENIZER_PRE_NAME = "qwen2"  # llama.cpp pre-tokenizer matching Qwen2's regex
TOKENIZER_MODEL_NAME = "gpt2"  # llama.cpp's name for byte-level BPE vocabularies
GENERAL_TYPE_MODEL = "model"
GENERAL_TYPE_IMATRIX = "imatrix"
IMATRIX_SUM2_SUFFIX = ".in_sum2"
IMATRIX_COUNTS_SUFFIX = ".counts"
# Clover has no trained context limit (the memory state is fixed-size); llama.cpp needs a
# {arch}.context_length, so the converter writes this unless config.json has
# max_position_embeddings.
DEFAULT_CONTEXT_LENGTH = 262144
PLACEHOLDER_TOKEN = "<|clover_placeholder_{i}|>"  # placeholder vocabulary, ids >= 256

# --- tensor names ----------------------------------------------------------------------
# The one table of Clover's tensors: HF name (with {bid} for the layer), GGUF name, shape in
# torch order written in the config's symbols (see CloverConfig.symbols: V d H Hkv D E Fe Fs
# Kc; "H*D" is a product), and the transform the converter applies. The GGUF file stores the
# same numpy shape (ggml's ne is the reverse). Everything else (config.expected_tensors, the
# converter's plan, the GGUF reader, the imatrix names, the reference model's module names)
# is derived from these rows.


@dataclass(frozen=True)
class TensorSpec:
    hf: str
    gguf: str
    shape: tuple[str, ...]
    transform: str | None = None  # "a_log": stored as ssm_a = -exp(A_log); "conv": [d, 1, Kc] -> [d, Kc]


GLOBAL_TENSORS_FIRST = (TensorSpec("model.embed_tokens.weight", "token_embd.weight", ("V", "d")),)
GLOBAL_TENSORS_LAST = (
    TensorSpec("model.norm.weight", "output_norm.weight", ("d",)),
    TensorSpec("lm_head.weight", "output.weight", ("V", "d")),
)

_L = "model.layers.{bid}."
LAYER_TENSORS = (
    TensorSpec(_L + "input_layernorm.weight", "blk.{bid}.attn_norm.weight", ("d",)),
    TensorSpec(_L + "self_attn.q_proj.weight", "blk.{bid}.attn_q.weight", ("H*D", "d")),
    TensorSpec(_L + "self_attn.k_proj.weight", "blk.{bid}.attn_k.weight", ("Hkv*D", "d")),
    TensorSpec(_L + "self_attn.v_proj.weight", "blk.{bid}.attn_v.weight", ("Hkv*D", "d")),
    TensorSpec(_L + "self_attn.o_proj.weight", "blk.{bid}.attn_output.weight", ("d", "H*D")),
    TensorSpec(_L + "self_attn.q_norm.weight", "blk.{bid}.attn_q_norm.weight", ("D",)),
    TensorSpec(_L + "self_attn.k_norm.weight", "blk.{bid}.attn_k_norm.weight", ("D",)),
    TensorSpec(_L + "self_attn.memory.a_proj.weight", "blk.{bid}.ssm_alpha.weight", ("Hkv", "d")),
    TensorSpec(_L + "self_attn.memory.b_proj.weight", "blk.{bid}.ssm_beta.weight", ("Hkv", "d")),
    # stored as ssm_a = -exp(A_log), as llama.cpp's qwen35 does
    TensorSpec(_L + "self_attn.memory.A_log", "blk.{bid}.ssm_a", ("Hkv",), "a_log"),
    TensorSpec(_L + "self_attn.memory.dt_bias", "blk.{bid}.ssm_dt.bias", ("Hkv",)),
    TensorSpec(_L + "self_attn.memory.key", "blk.{bid}.mem_key.weight", ("H", "D")),
    TensorSpec(_L + "self_attn.memory.calibration", "blk.{bid}.mem_calib.weight", ("H",)),
    # torch [d, 1, Kc] is stored squeezed as [d, Kc] (ggml ne [Kc, d], the ssm_conv layout)
    TensorSpec(_L + "conv.weight", "blk.{bid}.ssm_conv1d.weight", ("d", "1", "Kc"), "conv"),
    TensorSpec(_L + "conv.scale", "blk.{bid}.conv_scale.weight", ("d",)),
    TensorSpec(_L + "post_attention_layernorm.weight", "blk.{bid}.ffn_norm.weight", ("d",)),
    TensorSpec(_L + "mlp.gate.weight", "blk.{bid}.ffn_gate_inp.weight", ("E", "d")),
    # (the routed experts come here, see EXPERT_TENSORS)
    TensorSpec(_L + "mlp.shared_expert.gate_proj.weight", "blk.{bid}.ffn_gate_shexp.weight", ("Fs", "d")),
    TensorSpec(_L + "mlp.shared_expert.up_proj.weight", "blk.{bid}.ffn_up_shexp.weight", ("Fs", "d")),
    TensorSpec(_L + "mlp.shared_expert.down_proj.weight", "blk.{bid}.ffn_down_shexp.weight", ("d", "Fs")),
    TensorSpec(_L + "mlp.shared_expert_gate.weight", "blk.{bid}.ffn_gate_inp_shexp.weight", ("1", "d")),
)
EXPERTS_AFTER = _L + "mlp.gate.weight"  # spec order: the routed experts follow the router

# Routed experts. In GGUF (and in the reference model) they are stacked [E, rows, cols] per
# projection. Checkpoints hold them per expert or fused (gate rows first in gate_up_proj).
EXPERT_PROJS = ("gate", "up", "down")
EXPERT_TENSORS = {  # proj -> (GGUF name, per-expert shape)
    "gate": ("blk.{bid}.ffn_gate_exps.weight", ("Fe", "d")),
    "up": ("blk.{bid}.ffn_up_exps.weight", ("Fe", "d")),
    "down": ("blk.{bid}.ffn_down_exps.weight", ("d", "Fe")),
}
HF_EXPERT_PER = _L + "mlp.experts.{xid}.{proj}_proj.weight"  # [rows, cols] each
HF_EXPERT_FUSED_GATE_UP = _L + "mlp.experts.gate_up_proj"  # [E, 2*Fe, d]
HF_EXPERT_FUSED_DOWN = _L + "mlp.experts.down_proj"  # [E, d, Fe]
HF_EXPERT_FUSED_SHAPES = {HF_EXPERT_FUSED_GATE_UP: ("E", "2*Fe", "d"), HF_EXPERT_FUSED_DOWN: ("E", "d", "Fe")}

GGUF_EXPERT_NAME = {proj: gguf for proj, (gguf, _) in EXPERT_TENSORS.items()}
TENSOR_MAP_GLOBAL = {t.hf: t.gguf for t in GLOBAL_TENSORS_FIRST + GLOBAL_TENSORS_LAST}
TENSOR_MAP_LAYER = {t.hf: t.gguf for t in LAYER_TENSORS}


def dims(shape: tuple[str, ...], symbols: dict[str, int]) -> tuple[int, ...]:
    """A TensorSpec shape in numbers: ("H*D", "d") -> (H*D, d)."""
    out = []
    for dim in shape:
        n = 1
        for f in dim.split("*"):
            n *= int(f) if f.isdigit() else symbols[f]
        out.append(n)
    return tuple(out)


# Tensor groups, used by inspect / sensitivity / recipes. Regexes over GGUF names.
TENSOR_GROUPS: dict[str, str] = {
    "experts_gate_up": r"^blk\.\d+\.ffn_(gate|up)_exps\.weight$",
    "experts_down": r"^blk\.\d+\.ffn_down_exps\.weight$",
    "shared_expert": r"^blk\.\d+\.ffn_(gate|up|down)_shexp\.weight$",
    "router": r"^blk\.\d+\.ffn_gate_inp(_shexp)?\.weight$",
    "attention": r"^blk\.\d+\.attn_(q|k|v|output)\.weight$",
    "memory": r"^blk\.\d+\.(ssm_alpha|ssm_beta|ssm_a|ssm_dt|mem_key|mem_calib)",
    "conv": r"^blk\.\d+\.conv(1d|_scale)\.weight$",
    "norms": r"(norm\.weight$)",
    "embeddings": r"^token_embd\.weight$",
    "output": r"^output\.weight$",
}


# 2-D tensors the llama.cpp runtime uses as element-wise / ssm_conv operands: always F32
# (1-D tensors are always F32 too). The converter ignores --tensor-type for them.
RUNTIME_F32_TENSORS = r"^blk\.\d+\.(ssm_conv1d|mem_key)\.weight$"


def tensor_group(gguf_name: str) -> str:
    for group, pat in TENSOR_GROUPS.items():
        if re.search(pat, gguf_name):
            return group
    return "other"


def _template(name: str, prefix_re: str, prefix_tpl: str) -> tuple[str, str | None]:
    """("model.layers.3.conv.weight") -> ("model.layers.{bid}.conv.weight", "3")."""
    m = re.match(prefix_re, name)
    return (prefix_tpl + m.group(2), m.group(1)) if m else (name, None)


_HF_BY_TEMPLATE = {t.hf: t for t in GLOBAL_TENSORS_FIRST + LAYER_TENSORS + GLOBAL_TENSORS_LAST}
_GGUF_BY_TEMPLATE = {t.gguf: t for t in GLOBAL_TENSORS_FIRST + LAYER_TENSORS + GLOBAL_TENSORS_LAST}


def spec_for_hf(hf_name: str) -> TensorSpec | None:
    """The table row of a non-expert HF tensor name, or None."""
    return _HF_BY_TEMPLATE.get(_template(hf_name, r"^model\.layers\.(\d+)\.(.*)$", "model.layers.{bid}.")[0])


def hf_to_gguf_name(hf_name: str) -> str | None:
    """GGUF name of a non-expert HF tensor, or None if it is not one."""
    tpl, bid = _template(hf_name, r"^model\.layers\.(\d+)\.(.*)$", "model.layers.{bid}.")
    spec = _HF_BY_TEMPLATE.get(tpl)
    return spec.gguf.format(bid=bid) if spec else None


def gguf_to_hf_name(gguf_name: str) -> str | None:
    """Inverse of hf_to_gguf_name for non-expert tensors."""
    tpl, bid = _template(gguf_name, r"^blk\.(\d+)\.(.*)$", "blk.{bid}.")
    spec = _GGUF_BY_TEMPLATE.get(tpl)
    return spec.hf.format(bid=bid) if spec else None
