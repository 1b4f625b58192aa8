"""What the GGUF says besides its tensors: the vocabulary (tokenizer.json, or a byte-level
placeholder for model dirs without one) and the key/value metadata (docs/gguf-format.md)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from gguf import GGML_QUANT_VERSION, GGUFValueType
from gguf.utility import size_label as gguf_size_label

from .. import __version__
from ..config import CloverConfig
from ..constants import (
    DEFAULT_CONTEXT_LENGTH,
    EXPERT_GATING_FUNC_SOFTMAX,
    GENERAL_TYPE_MODEL,
    L2NORM_EPS,
    PLACEHOLDER_TOKEN,
    TOKENIZER_MODEL_NAME,
    TOKENIZER_PRE_NAME,
    Keys,
)
from . import ConvertError
from .tensor_plan import Plan

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_UNUSED = 1, 3, 5  # gguf.TokenType
S, U32, F32, B, A = (  # the value types of the metadata tables
    GGUFValueType.STRING,
    GGUFValueType.UINT32,
    GGUFValueType.FLOAT32,
    GGUFValueType.BOOL,
    GGUFValueType.ARRAY,
)


def K(key: str) -> str:
    return Keys.fmt(key)


def placeholder_vocab(c: CloverConfig):
    """Minimal byte-level vocabulary of size V for model dirs without a tokenizer: ids
    0..255 are the GPT-2 byte characters, special ids get their role's name, the rest are
    unused placeholders. Loads in llama.cpp; does not tokenize text meaningfully."""
    from ..tokenizer import GGUFVocab

    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_chr = {b: chr(ch) for b, ch in zip(bs, cs)}
    special = {}
    for role, tid in (
        ("<|endoftext|>", c.eos_token_id),
        ("<|bos|>", c.bos_token_id),
        ("<|pad|>", c.pad_token_id),
        ("<|mask|>", c.mask_token_id),
    ):
        special.setdefault(tid, role)
    tokens, types = [], []
    for i in range(c.vocab_size):
        if i in special:
            tokens.append(special[i])
            types.append(TOKEN_CONTROL)
        elif i < 256:
            tokens.append(byte_chr[i])
            types.append(TOKEN_NORMAL)
        else:
            tokens.append(PLACEHOLDER_TOKEN.format(i=i))
            types.append(TOKEN_UNUSED)
    # llama.cpp needs a merges array and gguf-py cannot write an empty one: one merge of the
    # first two byte tokens (its result is not a token, so it never fires)
    normal = [t for t, ty in zip(tokens, types) if ty == TOKEN_NORMAL][:2]
    merges = [" ".join(normal)] if len(normal) == 2 else []
    return GGUFVocab(
        tokens=tokens,
        token_types=types,
        merges=merges,
        bos_id=c.bos_token_id,
        eos_id=c.eos_token_id,
        pad_id=c.pad_token_id,
        mask_id=c.mask_token_id,
    )


def load_vocab(model_dir: Path, c: CloverConfig):
    """(GGUFVocab, placeholder?) from tokenizer.json or the placeholder; checked against config."""
    if not (model_dir / "tokenizer.json").exists():
        return placeholder_vocab(c), True
    from ..tokenizer import CloverTokenizer

    try:
        v = CloverTokenizer.from_dir(model_dir).to_gguf_vocab()
    except Exception as e:
        raise ConvertError(f"{model_dir}: cannot read the tokenizer ({e})") from None
    n = len(v.tokens)
    if n > c.vocab_size:
        raise ConvertError(f"{model_dir / 'tokenizer.json'}: {n} tokens, more than config vocab_size {c.vocab_size}")
    for key, tid in (
        ("bos_token_id", v.bos_id),
        ("eos_token_id", v.eos_id),
        ("pad_token_id", v.pad_id),
        ("mask_token_id", v.mask_id),
    ):
        if tid is not None and tid != getattr(c, key):
            raise ConvertError(
                f"{model_dir}: tokenizer's {key.replace('_id', '')} is {tid} but config.json "
                f"says {key}={getattr(c, key)}"
            )
    if v.mask_id is None:
        raise ConvertError(f"{model_dir / 'tokenizer_config.json'}: no mask_token")
    # pad the vocabulary to the embedding rows, as llama.cpp needs n_vocab == rows
    for i in range(n, c.vocab_size):
        v.tokens.append(PLACEHOLDER_TOKEN.format(i=i))
        v.token_types.append(TOKEN_UNUSED)
    return v, False


def _readme_license(model_dir: Path) -> str | None:
    p = model_dir / "README.md"
    if p.is_file():  # a regular file only: a FIFO would block
        txt = p.read_text(errors="replace")
        if txt.startswith("---"):
            fm = txt.split("---", 2)[1] if txt.count("---") >= 2 else ""
            m = re.search(r"^license:\s*(\S+)\s*$", fm, re.M)
            if m:
                return m.group(1).strip("'\"")
    try:
        d = json.loads((model_dir / "config.json").read_text())
        if isinstance(d.get("license"), str):
            return d["license"]
    except (OSError, json.JSONDecodeError):
        pass
    return None


def _raw_config(model_dir: Path) -> dict:
    try:
        return json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def metadata(
    plan: Plan, vocab, placeholder: bool, imatrix=None, name: str | None = None, weights_sha256: str | None = None
) -> list[tuple]:
    """[(key, value, GGUFValueType, subtype)] in writing order: general.*, the architecture's
    keys, tokenizer.*, quantize.imatrix.* (docs/gguf-format.md). ``weights_sha256``: the source
    weights' fingerprint (or its stand-in, patched when the data is written)."""
    kv: list[tuple] = []

    def add(k, v, t, sub=None):
        kv.append((k, v, t, sub))

    _general_keys(add, plan, name, weights_sha256)
    _architecture_keys(add, plan.config, _raw_config(plan.model_dir))
    _tokenizer_keys(add, vocab, plan.config, placeholder)
    if imatrix is not None:
        add(Keys.QUANTIZE_IMATRIX_FILE, str(imatrix.path), S)
        if imatrix.datasets:
            add(Keys.QUANTIZE_IMATRIX_DATASET, imatrix.datasets[0], S)
        add(Keys.QUANTIZE_IMATRIX_N_ENTRIES, len(imatrix.entries), GGUFValueType.INT32)
        add(Keys.QUANTIZE_IMATRIX_N_CHUNKS, int(imatrix.chunk_count), GGUFValueType.INT32)
    return kv


def size_label(plan: Plan) -> str:
    """general.size_label (e.g. "8x1.2M"): gguf-py's label from the plan's parameter counts."""
    total, shared, expert, n_exp = 0, 0, 0, 0
    for e in plan.entries:
        total += e.n_elements
        if e.group.startswith("experts"):
            expert += e.n_elements // e.shape[0]
            n_exp = e.shape[0]
        else:
            shared += e.n_elements
    return gguf_size_label(total, shared, expert, n_exp)


def _general_keys(add, plan: Plan, name: str | None, weights_sha256: str | None) -> None:
    c = plan.config
    add(Keys.GENERAL_TYPE, GENERAL_TYPE_MODEL, S)
    add(Keys.GENERAL_NAME, name or plan.model_dir.resolve().name, S)
    add(Keys.GENERAL_SIZE_LABEL, size_label(plan), S)
    lic = _readme_license(plan.model_dir)
    if lic:
        add(Keys.GENERAL_LICENSE, lic, S)
    add(Keys.GENERAL_FILE_TYPE, plan.rules.file_type(), U32)
    add(Keys.GENERAL_QUANT_VERSION, GGML_QUANT_VERSION, U32)
    add(Keys.RECIPE, plan.rules.describe(), S)
    add(Keys.SOURCE_CONFIG_SHA256, c.sha256(), S)
    add(Keys.TOOL_VERSION, __version__, S)
    add(Keys.SOURCE_LAYOUT, plan.layout, S)
    if weights_sha256 is not None:
        add(Keys.SOURCE_WEIGHTS_SHA256, weights_sha256, S)


def _architecture_keys(add, c: CloverConfig, raw: dict) -> None:
    add(K(Keys.VOCAB_SIZE), c.vocab_size, U32)
    add(K(Keys.CONTEXT_LENGTH), int(raw.get("max_position_embeddings", DEFAULT_CONTEXT_LENGTH)), U32)
    add(K(Keys.EMBEDDING_LENGTH), c.hidden_size, U32)
    add(K(Keys.BLOCK_COUNT), c.num_hidden_layers, U32)
    add(K(Keys.FEED_FORWARD_LENGTH), c.moe_intermediate_size, U32)
    add(K(Keys.HEAD_COUNT), c.num_attention_heads, U32)
    add(K(Keys.HEAD_COUNT_KV), c.num_key_value_heads, U32)
    add(K(Keys.KEY_LENGTH), c.head_dim, U32)
    add(K(Keys.VALUE_LENGTH), c.head_dim, U32)
    add(K(Keys.RMS_EPS), float(c.rms_norm_eps), F32)
    add(K(Keys.ROPE_FREQ_BASE), float(c.rope_theta), F32)
    add(K(Keys.ROPE_DIMENSION_COUNT), c.head_dim, U32)
    add(K(Keys.EXPERT_COUNT), c.num_experts, U32)
    add(K(Keys.EXPERT_USED_COUNT), c.num_experts_per_tok, U32)
    add(K(Keys.EXPERT_FEED_FORWARD_LENGTH), c.moe_intermediate_size, U32)
    add(K(Keys.EXPERT_SHARED_FEED_FORWARD_LENGTH), c.shared_expert_intermediate_size, U32)
    add(K(Keys.EXPERT_WEIGHTS_NORM), bool(c.norm_topk_prob), B)
    add(K(Keys.EXPERT_GATING_FUNC), EXPERT_GATING_FUNC_SOFTMAX, U32)
    add(K(Keys.DIFFUSION_BLOCK_SIZE), c.block_size, U32)
    add(K(Keys.CONV_KERNEL), c.conv_kernel_size, U32)
    add(K(Keys.MEMORY_L2NORM_EPS), float(L2NORM_EPS), F32)


def _tokenizer_keys(add, vocab, c: CloverConfig, placeholder: bool) -> None:
    add(Keys.TOKENIZER_MODEL, vocab.model or TOKENIZER_MODEL_NAME, S)
    add(Keys.TOKENIZER_PRE, vocab.pre or TOKENIZER_PRE_NAME, S)
    add(Keys.TOKENIZER_TOKENS, list(vocab.tokens), A, S)
    add(Keys.TOKENIZER_TOKEN_TYPE, [int(t) for t in vocab.token_types], A, GGUFValueType.INT32)
    if vocab.merges:
        add(Keys.TOKENIZER_MERGES, list(vocab.merges), A, S)
    add(Keys.BOS_ID, int(vocab.bos_id if vocab.bos_id is not None else c.bos_token_id), U32)
    add(Keys.EOS_ID, int(vocab.eos_id if vocab.eos_id is not None else c.eos_token_id), U32)
    add(Keys.PAD_ID, int(vocab.pad_id if vocab.pad_id is not None else c.pad_token_id), U32)
    add(Keys.MASK_ID, int(vocab.mask_id), U32)
    add(Keys.ADD_BOS, bool(vocab.add_bos), B)
    add(Keys.ADD_EOS, bool(vocab.add_eos), B)
    if vocab.chat_template:
        add(Keys.CHAT_TEMPLATE, vocab.chat_template, S)
    add(Keys.TOKENIZER_PLACEHOLDER, bool(placeholder), B)
