"""Read a Clover GGUF back into HF-named float tensors (dequantized with gguf-py).

Inverts the converter's layout transforms: ``ssm_a`` -> ``A_log = log(-ssm_a)``, conv
``[d, K]`` -> ``[d, 1, K]``, expert stacks -> per-expert tensors (or kept stacked under
the fused names with ``experts="fused"``). The config is rebuilt from the GGUF metadata.
This is what the eval uses to run the PyTorch reference on the quantized weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader

from ..config import CloverConfig
from ..constants import (
    ARCH,
    EXPERT_PROJS,
    GGUF_EXPERT_NAME,
    HF_EXPERT_FUSED_DOWN,
    HF_EXPERT_FUSED_GATE_UP,
    HF_EXPERT_PER,
    Keys,
    gguf_to_hf_name,
    spec_for_hf,
)
from ..convert import quants


class GGUFReadError(ValueError):
    pass


def _field(r: GGUFReader, key: str, default=None):
    f = r.fields.get(key)
    if f is None:
        if default is not None:
            return default
        raise GGUFReadError(f"{r.data.filename if hasattr(r.data, 'filename') else ''}: missing key {key}")
    return f.contents()


def metadata(path) -> dict:
    """All key/value pairs (arrays shortened to their length for tokens/merges)."""
    r = GGUFReader(path)
    out = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        v = f.contents()
        out[k] = v
    return out


def config_from_reader(r: GGUFReader) -> CloverConfig:
    arch = _field(r, Keys.GENERAL_ARCHITECTURE)
    if arch != ARCH:
        raise GGUFReadError(f"general.architecture is {arch!r}, expected {ARCH!r}")

    def k(key):
        return _field(r, Keys.fmt(key))

    vocab = r.fields.get(Keys.fmt(Keys.VOCAB_SIZE))
    d = dict(
        vocab_size=int(vocab.contents()) if vocab is not None else len(_field(r, Keys.TOKENIZER_TOKENS)),
        hidden_size=int(k(Keys.EMBEDDING_LENGTH)),
        num_hidden_layers=int(k(Keys.BLOCK_COUNT)),
        num_attention_heads=int(k(Keys.HEAD_COUNT)),
        num_key_value_heads=int(k(Keys.HEAD_COUNT_KV)),
        head_dim=int(k(Keys.KEY_LENGTH)),
        num_experts=int(k(Keys.EXPERT_COUNT)),
        num_experts_per_tok=int(k(Keys.EXPERT_USED_COUNT)),
        moe_intermediate_size=int(k(Keys.EXPERT_FEED_FORWARD_LENGTH)),
        shared_expert_intermediate_size=int(k(Keys.EXPERT_SHARED_FEED_FORWARD_LENGTH)),
        conv_kernel_size=int(k(Keys.CONV_KERNEL)),
        block_size=int(k(Keys.DIFFUSION_BLOCK_SIZE)),
        rms_norm_eps=float(np.float32(k(Keys.RMS_EPS))),
        rope_theta=float(np.float32(k(Keys.ROPE_FREQ_BASE))),
        mask_token_id=int(_field(r, Keys.MASK_ID)),
        bos_token_id=int(_field(r, Keys.BOS_ID)),
        eos_token_id=int(_field(r, Keys.EOS_ID)),
        pad_token_id=int(_field(r, Keys.PAD_ID)),
        norm_topk_prob=bool(k(Keys.EXPERT_WEIGHTS_NORM)),
        tie_word_embeddings=False,
    )
    # float32 metadata: restore the usual decimal values (1e-06 rather than 9.99999997e-07)
    for key in ("rms_norm_eps", "rope_theta"):
        d[key] = float(f"{d[key]:.7g}")
    return CloverConfig.from_dict(d, source="GGUF metadata")


def dequantize_tensor(t) -> np.ndarray:
    """gguf-py ReaderTensor -> float32 array in the stored (torch) shape."""
    shape = tuple(int(s) for s in reversed(t.shape.tolist()))
    return quants.dequantize(t.data, t.tensor_type, shape)


def load_gguf_as_hf_tensors(
    path, experts: str = "per_expert", dtype=torch.float32
) -> tuple[CloverConfig, dict[str, torch.Tensor]]:
    """(config, {HF name: tensor}) from a Clover GGUF; experts 'per_expert' | 'fused'."""
    r = GGUFReader(path)
    cfg = config_from_reader(r)
    out: dict[str, torch.Tensor] = {}
    exp_names = {}
    for bid in range(cfg.num_hidden_layers):
        for proj in EXPERT_PROJS:
            exp_names[GGUF_EXPERT_NAME[proj].format(bid=bid)] = (bid, proj)
    stacks: dict[int, dict[str, torch.Tensor]] = {}
    for t in r.tensors:
        x = torch.from_numpy(np.array(dequantize_tensor(t), dtype=np.float32, copy=True))
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
            raise GGUFReadError(f"{path}: unknown tensor {t.name}")
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
    r = GGUFReader(Path(path))
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
