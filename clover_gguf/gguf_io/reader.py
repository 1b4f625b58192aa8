"""Read a Clover GGUF back into HF-named float tensors (dequantized with gguf-py).

Inverts the converter's layout transforms: ``ssm_a`` -> ``A_log = log(-ssm_a)``, conv
``[d, K]`` -> ``[d, 1, K]``, expert stacks -> per-expert tensors (or kept stacked under
the fused names with ``experts="fused"``). The config is rebuilt from the GGUF metadata.
This is what the eval uses to run the PyTorch reference on the quantized weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField

from ..config import CloverConfig
from ..constants import (
    ARCH,
    EXPERT_GATING_FUNC_SOFTMAX,
    EXPERT_PROJS,
    GGUF_EXPERT_NAME,
    HF_EXPERT_FUSED_DOWN,
    HF_EXPERT_FUSED_GATE_UP,
    HF_EXPERT_PER,
    TOKENIZER_MODEL_NAME,
    Keys,
    gguf_to_hf_name,
    hf_to_gguf_name,
    spec_for_hf,
)
from ..convert import quants
from ..errors import CloverError
from ..limits import BY_GGUF, LIMITS, LimitError, check_config_values, check_token_id, fmt_value


class GGUFReadError(CloverError, ValueError):
    """A file that is not a (valid Clover) GGUF; the message names the file and the key or tensor."""


_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
_STRING, _ARRAY = 8, 9


def shown_name(b: bytes, n: int = 60) -> str:
    """A name from a damaged file, printable on one line."""
    return repr(b[:n].decode("utf-8", "replace"))[1:-1] + ("..." if len(b) > n else "")


class _Walk:
    """A cursor over a mapped GGUF whose every read is checked against the file's size."""

    def __init__(self, path, mm, size: int):
        import struct

        self.path, self.mm, self.size, self.pos = path, mm, size, 0
        self.struct, self.u64 = struct, struct.Struct("<Q").unpack_from

    def fail(self, why: str) -> GGUFReadError:
        return GGUFReadError(f"{self.path}: not a valid GGUF file ({why})")

    def take(self, fmt: str, what: str):
        n = self.struct.calcsize(fmt)
        if self.pos + n > self.size:
            raise self.fail(f"{what} runs past the end of the file")
        v = self.struct.unpack_from(fmt, self.mm, self.pos)[0]
        self.pos += n
        return v

    def string(self, what: str) -> bytes:
        n = self.take("<Q", what)
        if n > self.size - self.pos:
            raise self.fail(f"{what}: a string of {n} bytes runs past the end")
        self.pos += n
        return bytes(self.mm[self.pos - n : self.pos])

    def skip_strings(self, key: str, count: int) -> None:
        """string() count times, inlined: a 152k-token vocabulary and its merges."""
        p, size, mm, u64 = self.pos, self.size, self.mm, self.u64
        for j in range(count):
            if p + 8 > size:
                raise self.fail(f"{key}[{j}] runs past the end of the file")
            n = u64(mm, p)[0]
            p += 8
            if n > size - p:
                raise self.fail(f"{key}[{j}]: a string of {n} bytes runs past the end")
            p += n
        self.pos = p

    def key_values(self, n_kv: int) -> int | None:
        """Walk the key/values; the data alignment (None: general.alignment is no power of 2 in
        a u32, which ggml refuses in its own words)."""
        keys: set[bytes] = set()
        alignment = 32  # GGUF_DEFAULT_ALIGNMENT
        for i in range(n_kv):
            raw_key = self.string(f"key #{i}")
            key = shown_name(raw_key)
            if raw_key in keys:  # gguf-py would keep both under other names
                raise GGUFReadError(f"{self.path}: duplicate key '{key}' for KV pair {i}")
            keys.add(raw_key)
            t = self.take("<I", f"the type of {key}")
            if raw_key == b"general.alignment":
                alignment = None
            if t == _ARRAY:
                sub, count = self.take("<I", f"the array type of {key}"), self.take("<Q", f"the length of {key}")
                if sub == _STRING:
                    if count > (self.size - self.pos) // 8:
                        raise self.fail(f"{key}: {count} strings do not fit")
                    self.skip_strings(key, count)
                elif sub in _SCALAR_BYTES:
                    if count * _SCALAR_BYTES[sub] > self.size - self.pos:
                        raise self.fail(f"{key}: {count} values do not fit")
                    self.pos += count * _SCALAR_BYTES[sub]
                else:
                    raise self.fail(f"{key}: array of type {sub}")
            elif t == _STRING:
                self.string(key)
            elif t in _SCALAR_BYTES:
                v = self.take({1: "<B", 2: "<H", 4: "<I", 8: "<Q"}[_SCALAR_BYTES[t]], key)
                if raw_key == b"general.alignment" and t == 4 and v and not v & (v - 1):
                    alignment = v
            else:
                raise self.fail(f"key {key} has type {t}")
        return alignment

    def tensor_infos(self, n_tensors: int) -> list[tuple[str, list[int], int, int]]:
        """(name, dims, type, offset) of each tensor info, in file order."""
        infos, names = [], set()
        for i in range(n_tensors):
            raw_name = self.string(f"tensor info #{i}")
            name = shown_name(raw_name)
            if raw_name in names:
                raise GGUFReadError(f"{self.path}: duplicate tensor name '{name}' for tensor {i}")
            names.add(raw_name)
            nd = self.take("<I", f"the dimensions of {name}")
            if nd > 4:
                raise self.fail(f"tensor {name} has {nd} dimensions")
            dims = [self.take("<Q", f"the shape of {name}") for _ in range(nd)]
            ttype = self.take("<I", f"the type of {name}")
            infos.append((name, dims, ttype, self.take("<Q", f"the offset of {name}")))
        return infos


def check_structure(path) -> None:
    """Walk the header, key/values and tensor infos checking that every length and count fits
    in the file, before gguf-py parses it (gguf-py loops for ever on an array whose count runs
    past the end of the file); then that the tensors' data tile the data section as their types
    and shapes say (check_data_layout). Where ggml's GGUF parser or llama.cpp's loader refuses
    the same thing, the words are theirs."""
    import mmap

    from ..inputs import InputError, open_input

    try:
        f = open_input(path)  # a FIFO would block, a device never end
    except InputError as e:
        raise GGUFReadError(str(e)) from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise GGUFReadError(f"{path}: not a valid GGUF file ({size} bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            w = _Walk(path, mm, size)
            if w.take("<I", "the magic") != 0x46554747:
                raise w.fail("no GGUF magic")
            version = w.take("<I", "the version")
            if version not in (2, 3):
                raise w.fail(f"version {version}")
            n_tensors, n_kv = w.take("<Q", "the tensor count"), w.take("<Q", "the key count")
            if n_kv > size // 13 or n_tensors > size // 25:  # smallest possible entries
                raise w.fail(f"{n_kv} keys, {n_tensors} tensors in {size} bytes")
            alignment = w.key_values(n_kv)
            infos = w.tensor_infos(n_tensors)
    if infos and alignment:
        check_data_layout(path, infos, w.pos + (-w.pos % alignment), alignment, size)


def _tensor_nbytes(dims: list[int], ttype: int) -> int | None:
    """ggml_nbytes of a tensor of a type gguf-py knows whose rows hold whole blocks; None for
    anything else (an unknown type, a zero or huge dimension: other checks refuse those)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, bsize = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
    except (ValueError, KeyError):
        return None
    n = 1
    for d in dims:
        n *= d
    if n == 0 or n >= 2**63 or (dims[0] if dims else 1) % block:
        return None
    return n // block * bsize


def check_data_layout(path, infos, data_start: int, alignment: int, size: int) -> None:
    """The tensors' data tile the data section as their types and shapes say: each begins where
    the one before ends, padded to the alignment (ggml's GGUF parser's rule), the last ends
    within the file (llama.cpp's loader's rule) and no more than its padding follows it. The
    last rule is the one ggml and llama.cpp do not make: a last tensor retyped to a smaller type
    loaded and generated garbage (issue 47). ``infos``: (name, dims, type, offset) in file order."""
    sizes = [_tensor_nbytes(dims, t) for _, dims, t, _ in infos]
    if None in sizes:
        return
    expect = 0
    for (name, _, _, offset), nbytes in zip(infos, sizes):
        if offset != expect:
            raise GGUFReadError(f"{path}: tensor '{name}' has offset {offset}, expected {expect}")
        expect += nbytes + (-nbytes % alignment)
    name, dims, ttype, offset = infos[-1]
    end = data_start + offset + sizes[-1]
    if end > size:
        raise GGUFReadError(
            f"{path}: tensor '{name}' data is not within the file bounds, model is corrupted or incomplete"
        )
    if size > data_start + expect:
        from gguf import GGMLQuantizationType

        tname = GGMLQuantizationType(ttype).name.lower()
        raise GGUFReadError(
            f"{path}: tensor '{name}' of type {tname} and shape {dims} takes {sizes[-1]} bytes, but {size - offset - data_start} "
            "follow its offset to the end of the file: its type does not match its data"
        )


def open_gguf(path) -> GGUFReader:
    """gguf-py's reader on ``path``; any failure to parse it is one GGUFReadError."""
    try:
        check_structure(path)
        return GGUFReader(path)
    except GGUFReadError:
        raise
    except OSError as e:
        raise GGUFReadError(f"{path}: cannot read ({e.strerror or e})") from None
    except Exception as e:  # gguf-py raises whatever the damaged bytes lead to
        why = " ".join(str(e).split())[:300]
        raise GGUFReadError(f"{path}: not a valid GGUF file ({type(e).__name__}: {why})") from None


def metadata(path) -> dict:
    """All key/value pairs."""
    r = open_gguf(path)
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


# --- the checks the patched llama.cpp makes at load (src/clover-validate.cpp), same wording ---

# gguf_type_name() of ggml's gguf.cpp, so that both sides name types alike
_TYPE_NAMES = ("u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "str", "arr", "u64", "i64", "f64")
# keys the reference needs to rebuild the config; the rest of LIMITS are checked when present
_REQUIRED = {
    "context_length",
    "embedding_length",
    "block_count",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.layer_norm_rms_epsilon",
    "rope.freq_base",
    "expert_count",
    "expert_used_count",
    "expert_feed_forward_length",
    "expert_shared_feed_forward_length",
    "diffusion.block_size",
    "ssm.conv_kernel",
}


def _type_name(t) -> str:
    return _TYPE_NAMES[int(t)] if 0 <= int(t) < len(_TYPE_NAMES) else "unknown"


def _scalar(r: GGUFReader, key: str, vtype: GGUFValueType, required: bool):
    f = r.fields.get(key)
    if f is None:
        if required:
            raise LimitError(f"{key}: missing")
        return None
    if f.types[0] != vtype:
        raise LimitError(f"{key} has type {_type_name(f.types[0])}, expected {_type_name(vtype)}")
    if vtype == GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8", "replace")
    v = f.parts[f.data[0]][0]
    return float(v) if vtype == GGUFValueType.FLOAT32 else int(v)


def _array(r: GGUFReader, key: str, sub: GGUFValueType) -> ReaderField:
    f = r.fields.get(key)
    if f is None:
        raise LimitError(f"{key}: missing")
    if f.types[0] != GGUFValueType.ARRAY or f.types[-1] != sub:
        got = f"array of {_type_name(f.types[-1])}" if f.types[0] == GGUFValueType.ARRAY else _type_name(f.types[0])
        raise LimitError(f"{key} has type {got}, expected array of {_type_name(sub)}")
    return f


def token_strings(r: GGUFReader) -> list[bytes]:
    f = _array(r, Keys.TOKENIZER_TOKENS, GGUFValueType.STRING)
    return [bytes(f.parts[i]) for i in f.data]


def check_metadata(r: GGUFReader) -> dict:
    """What the patched llama.cpp checks at load (src/clover-validate.cpp, same order and
    wording): every limit and rule of limits.py on the file's keys, the tokenizer keys and the
    token strings. Returns {limit key suffix: value, "tokens": n, token id key: id}; raises
    LimitError."""
    arch = _scalar(r, Keys.GENERAL_ARCHITECTURE, GGUFValueType.STRING, True)
    if arch != ARCH:
        raise LimitError(f"{Keys.GENERAL_ARCHITECTURE} = {fmt_value(arch)}: must be {ARCH!r}")
    vals = {}
    for lim in LIMITS:
        vt = GGUFValueType.UINT32 if lim.integer else GGUFValueType.FLOAT32
        vals[lim.gguf] = _scalar(r, lim.gguf_key, vt, lim.gguf in _REQUIRED)
    check_config_values(lambda lim: vals[lim.gguf])
    gating = Keys.fmt(Keys.EXPERT_GATING_FUNC)
    g = _scalar(r, gating, GGUFValueType.UINT32, False)
    if g is not None and g != EXPERT_GATING_FUNC_SOFTMAX:
        raise LimitError(f"{gating} = {g}: must be 1 (softmax)")
    _scalar(r, Keys.fmt(Keys.EXPERT_WEIGHTS_NORM), GGUFValueType.BOOL, False)
    model = _scalar(r, Keys.TOKENIZER_MODEL, GGUFValueType.STRING, True)
    if model != TOKENIZER_MODEL_NAME:
        raise LimitError(f"{Keys.TOKENIZER_MODEL} = {fmt_value(model)}: must be {TOKENIZER_MODEL_NAME!r}")
    _scalar(r, Keys.TOKENIZER_PRE, GGUFValueType.STRING, False)
    tokens = token_strings(r)
    n = len(tokens)
    BY_GGUF["vocab_size"].check(n, f"number of tokens in {Keys.TOKENIZER_TOKENS}")
    if vals["vocab_size"] is not None and vals["vocab_size"] != n:
        key = BY_GGUF["vocab_size"].gguf_key
        raise LimitError(
            f"{key} = {vals['vocab_size']}: must equal the number of tokens in {Keys.TOKENIZER_TOKENS} ({n})"
        )
    seen: dict[bytes, int] = {}
    for i, t in enumerate(tokens):
        j = seen.setdefault(t, i)
        if j != i:
            raise LimitError(f"{Keys.TOKENIZER_TOKENS}: token {i} repeats token {j}")
    if Keys.TOKENIZER_TOKEN_TYPE in r.fields:
        m = len(_array(r, Keys.TOKENIZER_TOKEN_TYPE, GGUFValueType.INT32).data)
        if m != n:
            raise LimitError(f"{Keys.TOKENIZER_TOKEN_TYPE} has {m} entries, {Keys.TOKENIZER_TOKENS} has {n}")
    if Keys.TOKENIZER_MERGES in r.fields:
        _array(r, Keys.TOKENIZER_MERGES, GGUFValueType.STRING)
    for key in r.fields:  # every special token id llama.cpp may read is a u32
        if (
            key.startswith("tokenizer.ggml.")
            and key.endswith("_token_id")
            and len(key) > len("tokenizer.ggml._token_id")
        ):
            _scalar(r, key, GGUFValueType.UINT32, True)
    vals["tokens"] = n
    for key, required in ((Keys.MASK_ID, True), (Keys.BOS_ID, False), (Keys.EOS_ID, False), (Keys.PAD_ID, False)):
        v = _scalar(r, key, GGUFValueType.UINT32, required)
        if v is not None:
            check_token_id(key, v, n)
        vals[key] = v
    return vals


def config_from_reader(r: GGUFReader, path="GGUF") -> CloverConfig:
    try:
        v = check_metadata(r)
    except LimitError as e:
        raise GGUFReadError(f"{path}: {e}") from None
    d = dict(
        vocab_size=v["tokens"],
        hidden_size=v["embedding_length"],
        num_hidden_layers=v["block_count"],
        num_attention_heads=v["attention.head_count"],
        num_key_value_heads=v["attention.head_count_kv"],
        head_dim=v["attention.key_length"],
        num_experts=v["expert_count"],
        num_experts_per_tok=v["expert_used_count"],
        moe_intermediate_size=v["expert_feed_forward_length"],
        shared_expert_intermediate_size=v["expert_shared_feed_forward_length"],
        conv_kernel_size=v["ssm.conv_kernel"],
        block_size=v["diffusion.block_size"],
        # float32 metadata: restore the usual decimal values (1e-06 rather than 9.99999997e-07)
        rms_norm_eps=float(f"{v['attention.layer_norm_rms_epsilon']:.7g}"),
        rope_theta=float(f"{v['rope.freq_base']:.7g}"),
        mask_token_id=v[Keys.MASK_ID],
        bos_token_id=v[Keys.BOS_ID] if v[Keys.BOS_ID] is not None else v[Keys.MASK_ID],
        eos_token_id=v[Keys.EOS_ID] if v[Keys.EOS_ID] is not None else v[Keys.MASK_ID],
        pad_token_id=v[Keys.PAD_ID] if v[Keys.PAD_ID] is not None else v[Keys.MASK_ID],
        norm_topk_prob=bool(r.fields[Keys.fmt(Keys.EXPERT_WEIGHTS_NORM)].contents())
        if Keys.fmt(Keys.EXPERT_WEIGHTS_NORM) in r.fields
        else True,
        tie_word_embeddings=False,
    )
    return CloverConfig.from_dict(d, source=f"{path}: metadata")


def dequantize_tensor(t) -> np.ndarray:
    """gguf-py ReaderTensor -> float32 array in the stored (torch) shape."""
    shape = tuple(int(s) for s in reversed(t.shape.tolist()))
    return quants.dequantize(t.data, t.tensor_type, shape)


def gguf_shapes(cfg: CloverConfig) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> the (torch-order) shape the converter writes for this config."""
    out = {}
    for hf, shape in cfg.expected_tensors(fused=True).items():
        name = hf_to_gguf_name(hf)
        if name is not None:
            out[name] = (shape[0], shape[2]) if spec_for_hf(hf).transform == "conv" else shape
    E, Fe, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    for bid in range(cfg.num_hidden_layers):
        for proj in EXPERT_PROJS:
            out[GGUF_EXPERT_NAME[proj].format(bid=bid)] = (E, d, Fe) if proj == "down" else (E, Fe, d)
    return out


def load_gguf_as_hf_tensors(
    path, experts: str = "per_expert", dtype=torch.float32
) -> tuple[CloverConfig, dict[str, torch.Tensor]]:
    """(config, {HF name: tensor}) from a Clover GGUF; experts 'per_expert' | 'fused'."""
    r = open_gguf(path)
    cfg = config_from_reader(r, path)
    out: dict[str, torch.Tensor] = {}
    exp_names = {}
    for bid in range(cfg.num_hidden_layers):
        for proj in EXPERT_PROJS:
            exp_names[GGUF_EXPERT_NAME[proj].format(bid=bid)] = (bid, proj)
    stacks: dict[int, dict[str, torch.Tensor]] = {}
    want = gguf_shapes(cfg)
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        if t.name not in want:
            raise GGUFReadError(f"{path}: unknown tensor {shown_name(t.name.encode())}")
        if shape != want[t.name]:
            raise GGUFReadError(
                f"{path}: tensor {t.name} has shape {list(shape)}, the metadata implies {list(want[t.name])}"
            )
        try:
            x = torch.from_numpy(np.array(dequantize_tensor(t), dtype=np.float32, copy=True))
        except Exception as e:
            raise GGUFReadError(f"{path}: tensor {t.name} cannot be read ({type(e).__name__}: {e})") from None
        if not torch.isfinite(x).all():
            raise GGUFReadError(f"{path}: tensor {t.name} has non-finite values (NaN/Inf)")
        if t.name in exp_names:
            bid, proj = exp_names[t.name]
            if experts == "fused":
                stacks.setdefault(bid, {})[proj] = x
            else:
                for e in range(x.shape[0]):
                    out[HF_EXPERT_PER.format(bid=bid, xid=e, proj=proj)] = x[e].to(dtype)
            continue
        hf = gguf_to_hf_name(t.name)
        if hf is None:
            raise GGUFReadError(f"{path}: unknown tensor {shown_name(t.name.encode())}")
        transform = spec_for_hf(hf).transform
        if transform == "a_log":
            x = torch.log(-x.double()).float()
        elif transform == "conv":
            x = x.reshape(x.shape[0], 1, x.shape[1])
        out[hf] = x.to(dtype)
    for bid, s in stacks.items():
        out[HF_EXPERT_FUSED_GATE_UP.format(bid=bid)] = torch.cat([s["gate"], s["up"]], 1).to(dtype)
        out[HF_EXPERT_FUSED_DOWN.format(bid=bid)] = s["down"].to(dtype)
    expected = cfg.expected_tensors(fused=experts == "fused")
    missing = [n for n in expected if n not in out]
    if missing:
        raise GGUFReadError(f"{path}: missing tensor(s) for {missing[0]} ({len(missing)} in all)")
    for n, shape in expected.items():
        if tuple(out[n].shape) != shape:
            raise GGUFReadError(f"{path}: tensor {n} has shape {list(out[n].shape)}, expected {list(shape)}")
    return cfg, {n: out[n] for n in expected}


def tensor_types(path) -> dict[str, str]:
    r = open_gguf(Path(path))
    return {t.name: t.tensor_type.name.lower() for t in r.tensors}


@torch.no_grad()
def logit_agreement(
    model_dir,
    gguf_path,
    token_ids,
    block_size: int | None = None,
    mask_ratio: float = 0.5,
    seq_len: int = 256,
    seed: int = 0,
) -> dict:
    """Run the PyTorch reference on the source weights and on the weights dequantized from
    ``gguf_path``, on the same token sequences (clean blocks committed, each block also
    denoised with ``mask_ratio`` of its tokens masked), and compare the denoising logits:
    mean KL(ref || gguf) per position (nats) and top-1 agreement, over all positions and
    over the masked ones."""
    from ..reference.model import CloverModel

    ref = CloverModel.from_pretrained(model_dir)
    cfg, t = load_gguf_as_hf_tensors(gguf_path)
    q = CloverModel.from_tensors(cfg, t)
    B = block_size or cfg.block_size
    seq_len = max(B, seq_len // B * B)
    ids = torch.as_tensor(np.asarray(token_ids), dtype=torch.long)
    n = len(ids) // seq_len
    if n < 1:
        raise ValueError(f"need at least {seq_len} tokens, got {len(ids)}")
    clean = ids[: n * seq_len].view(n, -1, B)
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(clean.shape, generator=g) < mask_ratio
    noisy = torch.where(m, torch.full_like(clean, cfg.mask_token_id), clean)
    pos = torch.arange(seq_len).view(1, -1, B).expand(n, -1, -1)
    valid = torch.ones_like(clean, dtype=torch.bool)
    kl_sum = kl_m = 0.0
    top = top_m = 0
    cnt = cnt_m = 0
    for i in range(n):
        a = ref.forward_train(clean[i : i + 1], noisy[i : i + 1], pos[i : i + 1], valid[i : i + 1]).float()
        b = q.forward_train(clean[i : i + 1], noisy[i : i + 1], pos[i : i + 1], valid[i : i + 1]).float()
        la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        kl = (la.exp() * (la - lb)).sum(-1).reshape(-1)
        agree = (a.argmax(-1) == b.argmax(-1)).reshape(-1)
        mm = m[i : i + 1].reshape(-1)
        kl_sum += kl.sum().item()
        top += int(agree.sum())
        cnt += kl.numel()
        kl_m += kl[mm].sum().item()
        top_m += int(agree[mm].sum())
        cnt_m += int(mm.sum())
    return {
        "positions": cnt,
        "mean_kl": kl_sum / cnt,
        "top1_agreement": top / cnt,
        "masked_positions": cnt_m,
        "mean_kl_masked": kl_m / max(1, cnt_m),
        "top1_agreement_masked": top_m / max(1, cnt_m),
    }
