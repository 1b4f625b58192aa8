"""Block-diffusion training for clover-tiny (spec section 6) and the held-out evaluation.

Objective (Arriola et al., "Block Diffusion", ICLR 2025): a window of the token stream is
cut into blocks; the clean blocks are committed layer-parallel (the model's chunked delta
rule gives the memory state at each block start) and every noisy copy of a block, masked
independently with probability t ~ U(eps, 1] drawn per block, is run against the clean
state at its start. Loss = sum over masked positions of CE / t, divided by the number of
real tokens (the NELBO per token, in nats).

Batches: N sequences, each a window of the train stream laid out as nb blocks of B slots.
Block 0 holds r ~ U{1..B} tokens followed by padding (so block boundaries fall at a random
offset); block b > 0 holds tokens r + (b-1)B ... r + bB - 1; positions are contiguous from
0 at the window start. B is drawn per batch (block_sizes / block_probs).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..config import CloverConfig
from ..outputs import output_file, write_bytes, write_json
from ..reference.model import CloverModel

LN2 = math.log(2.0)


# --- initialisation ----------------------------------------------------------------------


def init_weights(model: CloverModel, seed: int = 0, std: float = 0.02) -> CloverModel:
    """Initialise every parameter of a freshly built CloverModel (deterministic for a seed).

    Linears, embeddings, expert stacks: N(0, std); the residual-output projections (o_proj,
    expert/shared down) scaled by 1/sqrt(2 n_layer) (GPT-2). Norms = 1. Memory gate like
    Mamba2 / Gated DeltaNet: A_log = log U(1, 16), dt_bias = softplus^-1(dt), dt log-uniform
    in [1e-3, 0.1]. Memory key N(0, std), calibration 1. Conv weight N(0, std), scale 1."""
    g = torch.Generator().manual_seed(seed)
    c = model.config
    out_std = std / math.sqrt(2 * c.num_hidden_layers)

    def normal_(p, s):
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * s)

    def fill_(p, v):
        with torch.no_grad():
            p.fill_(v)

    normal_(model.model.embed_tokens.weight, std)
    normal_(model.lm_head.weight, std)
    fill_(model.model.norm.weight, 1.0)
    for layer in model.layers:
        a, m, mlp = layer.self_attn, layer.self_attn.memory, layer.mlp
        fill_(layer.input_layernorm.weight, 1.0)
        fill_(layer.post_attention_layernorm.weight, 1.0)
        for lin in (a.q_proj, a.k_proj, a.v_proj):
            normal_(lin.weight, std)
        normal_(a.o_proj.weight, out_std)
        fill_(a.q_norm.weight, 1.0)
        fill_(a.k_norm.weight, 1.0)
        normal_(m.a_proj.weight, std)
        normal_(m.b_proj.weight, std)
        with torch.no_grad():
            Hkv = m.A_log.shape[0]
            m.A_log.copy_(torch.log(torch.empty(Hkv).uniform_(1.0, 16.0, generator=g)))
            lo, hi = math.log(1e-3), math.log(0.1)
            dt = torch.exp(torch.empty(Hkv).uniform_(lo, hi, generator=g)).clamp(min=1e-4)
            m.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        normal_(m.key, std)
        fill_(m.calibration, 1.0)
        normal_(layer.conv.weight, std)
        fill_(layer.conv.scale, 1.0)
        normal_(mlp.gate.weight, std)
        gate, up = mlp.experts.gate_up_proj.chunk(2, dim=1)
        normal_(gate, std)
        normal_(up, std)
        normal_(mlp.experts.down_proj, out_std)
        normal_(mlp.shared_expert.gate_proj.weight, std)
        normal_(mlp.shared_expert.up_proj.weight, std)
        normal_(mlp.shared_expert.down_proj.weight, out_std)
        normal_(mlp.shared_expert_gate.weight, std)
    return model


def new_model(config: CloverConfig, seed: int = 0) -> CloverModel:
    torch.manual_seed(seed)
    return init_weights(CloverModel(config), seed)


# --- batches -----------------------------------------------------------------------------


@dataclass
class Batch:
    clean: torch.Tensor  # [N, nb, B] int64
    noisy: torch.Tensor  # [N, nb, B] int64 (mask_token_id at masked positions)
    pos: torch.Tensor  # [N, nb, B] int64
    valid: torch.Tensor  # [N, nb, B] bool
    masked: torch.Tensor  # [N, nb, B] bool (masked and valid)
    t: torch.Tensor  # [N, nb] float32, the mask probability of each block
    scored: torch.Tensor | None = None  # [N, nb, B] bool: the tokens noised and scored (None: every valid one)

    @property
    def n_tokens(self) -> int:
        return int(self.valid.sum())

    @property
    def n_scored(self) -> int:
        return self.n_tokens if self.scored is None else int(self.scored.sum())

    def to(self, device) -> Batch:
        return Batch(*(None if (v := getattr(self, f.name)) is None else v.to(device) for f in fields(self)))


def layout_windows(stream: torch.Tensor, starts: torch.Tensor, offsets: torch.Tensor, nb: int, B: int, pad_id: int):
    """Clean blocks for windows of `stream` starting at `starts` [N] with first-block
    lengths `offsets` [N] in [1, B]. Returns clean, pos, valid, each [N, nb, B]."""
    N = starts.shape[0]
    slot = torch.arange(nb * B).view(1, nb, B)  # slot index
    b = slot // B
    j = slot % B
    r = offsets.view(N, 1, 1)
    # token index inside the window: block 0 -> j (valid if j < r); block b>0 -> r+(b-1)B+j
    idx = torch.where(b == 0, j, r + (b - 1) * B + j)  # [N, nb, B]
    valid = (b > 0) | (j < r)
    src = (starts.view(N, 1, 1) + idx).clamp(max=stream.shape[0] - 1)
    clean = torch.where(valid, stream[src], torch.full_like(src, pad_id))
    pos = idx
    return clean, pos, valid.expand(N, nb, B).contiguous()


def apply_noise(clean: torch.Tensor, valid: torch.Tensor, t: torch.Tensor, mask_id: int, gen: torch.Generator):
    """Mask each valid token independently with its block's probability t [N, nb]."""
    u = torch.rand(clean.shape, generator=gen)
    masked = (u < t[..., None]) & valid
    noisy = torch.where(masked, torch.full_like(clean, mask_id), clean)
    return noisy, masked


def sample_t(shape, eps: float, gen: torch.Generator, stratified: bool = True) -> torch.Tensor:
    """t ~ U(eps, 1] per block; stratified over the batch (low-discrepancy, as MDLM) when
    `stratified`: one uniform shift plus evenly spaced points, shuffled."""
    n = int(np.prod(shape))
    if stratified:
        u = (torch.rand(1, generator=gen) + torch.arange(n) / n) % 1.0
        u = u[torch.randperm(n, generator=gen)]
    else:
        u = torch.rand(n, generator=gen)
    t = 1.0 - (1.0 - eps) * u  # u in [0,1) -> t in (eps, 1]
    return t.view(shape).float()


def sample_batch(
    stream: torch.Tensor,
    n_seq: int,
    B: int,
    n_blocks: int,
    gen: torch.Generator,
    mask_id: int,
    pad_id: int,
    eps: float = 1e-3,
    random_offset: bool = True,
    start_points: torch.Tensor | None = None,
    score_mask: torch.Tensor | None = None,
) -> Batch:
    """N windows of the stream, each r + (n_blocks-1)B tokens, r ~ U{1..B} per sequence. With
    `start_points` (sorted positions, e.g. where each chat transcript begins) every window starts
    at one of them, else anywhere. With `score_mask` (bool per stream token) only those tokens are
    noised and scored (Batch.scored; the others stay clean context, as a prompt at inference)."""
    if random_offset:
        r = torch.randint(1, B + 1, (n_seq,), generator=gen)
    else:
        r = torch.full((n_seq,), B)
    need = int(r.max()) + (n_blocks - 1) * B
    if stream.shape[0] < need + 1:
        raise ValueError(f"token stream of {stream.shape[0]} tokens is shorter than a window ({need})")
    if start_points is None:
        starts = torch.randint(0, stream.shape[0] - need, (n_seq,), generator=gen)
    else:
        n_ok = int(torch.searchsorted(start_points, stream.shape[0] - need))  # windows that fit
        if n_ok == 0:
            raise ValueError(f"no start point leaves a window of {need} tokens in a stream of {stream.shape[0]}")
        starts = start_points[torch.randint(0, n_ok, (n_seq,), generator=gen)]
    clean, pos, valid = layout_windows(stream, starts, r, n_blocks, B, pad_id)
    scored = None
    if score_mask is not None:
        scored = layout_windows(score_mask.long(), starts, r, n_blocks, B, 0)[0].bool() & valid
    t = sample_t((n_seq, n_blocks), eps, gen)
    noisy, masked = apply_noise(clean, valid if scored is None else scored, t, mask_id, gen)
    return Batch(clean, noisy, pos, valid, masked, t, scored)


def recall_windows(stream: torch.Tensor, n_seq: int, W: int, gen: torch.Generator, spans: tuple = (4, 16)):
    """In-context recall windows: ([n_seq, W] tokens, [n_seq, W] bool scored). Half are
    associative recall (multi-query, as in the linear-attention literature): pairs "k v" of
    stream tokens, then queries "k v" of them, each value scored; half are span copies: a few
    spans of the stream, then the spans again, every token after a span's first scored. Every
    scored token is predictable only by looking up the token before it in the window's earlier
    part, through the memory when that part lies in earlier blocks: what copying a name of the
    request into a tool call's arguments needs, and what code and chat alone did not teach
    (evaldata/train-copy/). Keys are distinct within a window so that each lookup has one answer."""
    rows, scores = [], []
    n = stream.shape[0]
    for _ in range(n_seq):
        tok = torch.empty(W, dtype=torch.long)
        sc = torch.zeros(W, dtype=torch.bool)
        if float(torch.rand(1, generator=gen)) < 0.5:
            k_pairs = int(torch.randint(2, max(3, W // 8) + 1, (1,), generator=gen))
            picks = stream[torch.randint(0, n, (4 * k_pairs,), generator=gen)].tolist()
            keys = list(dict.fromkeys(picks))[:k_pairs]
            vals = stream[torch.randint(0, n, (len(keys),), generator=gen)].tolist()
            seq = [x for kv in zip(keys, vals) for x in kv]
            first = len(seq)
            while len(seq) < W:
                j = int(torch.randint(0, len(keys), (1,), generator=gen))
                seq += [keys[j], vals[j]]
            tok[:] = torch.tensor(seq[:W])
            sc[first + 1 :: 2] = True
        else:
            parts, pos = [], 0
            while pos < W // 2:
                k = int(torch.randint(spans[0], spans[1] + 1, (1,), generator=gen))
                k = min(k, max(2, W // 2 - pos))  # the spans take half the window
                a = int(torch.randint(0, n - k, (1,), generator=gen))
                parts.append(stream[a : a + k])
                pos += k
            seq = torch.cat(parts).tolist()
            mask = [False] * len(seq)
            while len(seq) < W:
                piece = parts[int(torch.randint(0, len(parts), (1,), generator=gen))].tolist()
                seq += piece
                mask += [False] + [True] * (len(piece) - 1)
            tok[:] = torch.tensor(seq[:W])
            sc[:] = torch.tensor(mask[:W])
        rows.append(tok)
        scores.append(sc)
    return torch.stack(rows), torch.stack(scores)


def sample_recall_batch(
    stream: torch.Tensor, n_seq: int, B: int, n_blocks: int, gen: torch.Generator, mask_id: int, pad_id: int, eps: float
) -> Batch:
    """A batch of recall_windows, laid out as sample_batch's (first block r ~ U{1..B} long, so a
    window keeps its row's start and drops up to B - 1 tokens of its end); only the recalled
    tokens are noised and scored, the rest is clean context."""
    W = n_blocks * B
    rows, scored_rows = recall_windows(stream, n_seq, W, gen)
    r = torch.randint(1, B + 1, (n_seq,), generator=gen)
    starts = torch.arange(n_seq) * W  # a window of r + (n_blocks - 1) B <= W tokens: its row's start
    clean, pos, valid = layout_windows(rows.reshape(-1), starts, r, n_blocks, B, pad_id)
    scored = layout_windows(scored_rows.reshape(-1).long(), starts, r, n_blocks, B, 0)[0].bool() & valid
    t = sample_t((n_seq, n_blocks), eps, gen)
    noisy, masked = apply_noise(clean, scored, t, mask_id, gen)
    return Batch(clean, noisy, pos, valid, masked, t, scored)


# --- loss ----------------------------------------------------------------------------------


def nelbo_from_logits(logits_sel: torch.Tensor, batch: Batch, certainty: float = 0.0):
    """logits at the masked positions (in `batch.masked` order) -> (loss, masked CE, entropy).

    loss = sum_masked CE(logits, clean) / t_block, divided by the number of real tokens (of the
    scored ones when the batch says which). certainty > 0 adds certainty * the entropy of each
    masked position whose argmax is already the clean token (dParallel's certainty forcing,
    arXiv 2509.26488): the threshold schedule unmasks a position once its top probability passes
    the threshold, so confidence where the model is right is what lets a step unmask several."""
    target = batch.clean[batch.masked]
    w = (1.0 / batch.t)[..., None].expand_as(batch.masked)[batch.masked]
    logp = F.log_softmax(logits_sel.float(), -1)  # once, for the CE and the entropy
    ce = F.nll_loss(logp, target, reduction="none")
    loss = (ce * w).sum() / max(batch.n_scored, 1)
    with torch.set_grad_enabled(certainty > 0 and torch.is_grad_enabled()):  # else a statistic only
        ent = -(logp.exp() * logp).sum(-1)
    if certainty > 0:
        right = (logp.argmax(-1) == target).float()
        loss = loss + certainty * (ent * right).sum() / max(batch.n_scored, 1)
    return loss, ce.detach(), ent.detach()


def diffusion_loss(model: CloverModel, batch: Batch, autocast: bool = False, certainty: float = 0.0):
    """NELBO of a batch (nats/token), plus the certainty term when asked, and stats: unweighted
    masked CE and entropy means (nats)."""
    with torch.autocast(batch.clean.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model.forward_train(batch.clean, batch.noisy, batch.pos, batch.valid, select=batch.masked)
    loss, ce, ent = nelbo_from_logits(logits, batch, certainty)
    return loss, {
        "masked_ce": float(ce.mean()) if ce.numel() else float("nan"),
        "masked_entropy": float(ent.mean()) if ent.numel() else float("nan"),
        "n_masked": int(ce.numel()),
        "n_tokens": batch.n_tokens,
    }


# --- held-out evaluation ---------------------------------------------------------------------


@torch.no_grad()
def evaluate_heldout(
    model: CloverModel,
    ids,
    block_size: int = 16,
    mask_ratio: float = 0.5,
    seq_blocks: int = 64,
    batch_size: int = 8,
    seed: int = 0,
    max_tokens: int | None = None,
    autocast: bool = False,
    unigram_log2p=None,
) -> dict:
    """Masked-token loss on a held-out token stream, in bits/token.

    The stream is cut into sequences of seq_blocks * block_size tokens (the last one padded
    at the end); blocks start at position 0 of each sequence. In every block, round(L *
    mask_ratio) (at least 1) of its L real tokens are masked (positions drawn with a fixed
    seed); the noisy block is scored against the state of the clean earlier blocks (the
    committed history). Returns bits/token = mean CE over all masked tokens / ln 2; with
    `unigram_log2p` ([V] log2 probabilities) also that unigram's bits/token on the same
    masked tokens."""
    was_training = model.training
    model.eval()
    ids = torch.as_tensor(np.asarray(ids), dtype=torch.long).flatten()
    if max_tokens is not None:
        ids = ids[:max_tokens]
    B, S = block_size, seq_blocks * block_size
    n_seq = -(-ids.numel() // S)
    padded = torch.full((n_seq * S,), model.config.pad_token_id, dtype=torch.long)
    padded[: ids.numel()] = ids
    valid_all = torch.zeros(n_seq * S, dtype=torch.bool)
    valid_all[: ids.numel()] = True
    clean_all = padded.view(n_seq, seq_blocks, B)
    valid_all = valid_all.view(n_seq, seq_blocks, B)
    gen = torch.Generator().manual_seed(seed)
    # exactly round(L * ratio) masked per block, at random positions among the real tokens
    score = torch.rand(clean_all.shape, generator=gen).masked_fill(~valid_all, 2.0)
    rank = score.argsort(-1).argsort(-1)
    L = valid_all.sum(-1, keepdim=True)
    k = torch.where(L > 0, (L.float() * mask_ratio).round().clamp(min=1).long(), torch.zeros_like(L))
    masked_all = (rank < k) & valid_all
    pos_all = torch.arange(S).view(1, seq_blocks, B).expand(n_seq, -1, -1)
    dev = model.lm_head.weight.device
    total, count = 0.0, 0
    if unigram_log2p is not None:
        uni = -float(torch.as_tensor(np.asarray(unigram_log2p), dtype=torch.float64)[clean_all[masked_all]].sum())
    for s in range(0, n_seq, batch_size):
        sl = slice(s, s + batch_size)
        clean, valid, masked = (t[sl].to(dev) for t in (clean_all, valid_all, masked_all))
        noisy = torch.where(masked, torch.full_like(clean, model.config.mask_token_id), clean)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            # the class method, not a compiled instance override (no compile for eval shapes)
            logits = CloverModel.forward_train(model, clean, noisy, pos_all[sl].to(dev), valid, select=masked)
        ce = F.cross_entropy(logits.float(), clean[masked], reduction="sum")
        total += float(ce)
        count += int(masked.sum())
    model.train(was_training)
    nats = total / max(count, 1)
    extra = {} if unigram_log2p is None else {"unigram_bits_per_token": uni / max(count, 1)}
    return {
        "bits_per_token": nats / LN2,
        "nats_per_token": nats,
        "n_masked": count,
        "n_tokens": int(ids.numel()),
        "block_size": block_size,
        "mask_ratio": mask_ratio,
        "seq_tokens": S,
        "seed": seed,
        **extra,
    }


# --- saving --------------------------------------------------------------------------------


def save_hf(model: CloverModel, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """model.safetensors (HF names, per-expert layout, BF16) + config.json in out_dir."""
    from safetensors.torch import save

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.to("cpu", dtype).contiguous() for k, v in model.hf_state_dict().items()}
    write_bytes(out / "model.safetensors", save(sd, metadata={"format": "pt"}))
    model.config.save(out / "config.json")
    return out / "model.safetensors"


# --- training loop -------------------------------------------------------------------------


@dataclass
class TrainConfig:
    seed: int = 0
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    warmup_steps: int = 100
    max_steps: int = 100000
    time_budget_min: float | None = None  # the cosine follows max(step, token, time) progress
    max_tokens: int | None = None  # a token budget, reached across as many runs as it takes
    grad_clip: float = 1.0
    tokens_per_batch: int = 4096  # real tokens, about
    seq_tokens: int = 256  # tokens per window, about (n_blocks = seq/B + 1)
    block_sizes: tuple = (16, 32, 8)
    block_probs: tuple = (0.45, 0.45, 0.10)
    eps: float = 1e-3
    precision: str = "bf16"  # "bf16" (bf16 weights + fp32 master), "autocast", "fp32"
    compile: bool = False  # torch.compile the training forward
    threads: int = 2
    device: str = "cpu"  # or "cuda": batches are drawn on the CPU (same RNG stream), then moved
    log_every: int = 10
    ckpt_every_min: float = 4.0
    eval_every_min: float = 0.0  # 0: only at the end
    ckpt_dir: str = "out/clover-tiny-train"
    out_dir: str = "models/clover-tiny"
    eval_tokens: int = 16384  # held-out tokens for the periodic eval
    chat_ratio: float = 0.0  # fraction of batches drawn from the chat transcripts (train(chat=...))
    chat_seq_tokens: int = 1280  # tokens per chat window, about (each starts where a transcript does)
    export_every_min: float = 0.0  # call train(export=...) this often (0: never)
    certainty: float = 0.0  # weight of the entropy of masked positions already right (nelbo_from_logits)
    copy_ratio: float = (
        0.0  # fraction of batches that are in-context recall windows of the stream (sample_recall_batch)
    )
    # per stream of train(distill=[...]), the model's own continuations: the fraction of batches
    # drawn from it, and its tokens per window, about (each window starts where a row does)
    distill_ratio: tuple = ()
    distill_seq_tokens: tuple = ()
    distill_certainty: float = 0.0  # the certainty weight in distill batches (tc.certainty in the others)
    extra: dict = field(default_factory=dict)


def native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """The CPU multiplies BF16 natively (AVX512_BF16 or AMX); without it PyTorch emulates BF16
    matmuls and a BF16 step takes about twice an fp32 one."""
    try:
        flags = cpuinfo.read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_precision(device: str = "cpu", cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    return "bf16" if device.startswith("cuda") or native_bf16(cpuinfo) else "fp32"


def lr_at(step: int, progress: float, tc: TrainConfig, warm_start: int = 0) -> float:
    """Linear warmup to tc.lr, then cosine by progress down to min_lr_frac. After a warm
    restart at step `warm_start` the warmup climbs to the cosine's value there instead."""
    if not warm_start and step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    p = min(max(progress, 0.0), 1.0)
    lr = tc.lr * (tc.min_lr_frac + (1 - tc.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))
    return lr * min(1.0, (step - warm_start + 1) / tc.warmup_steps)


def make_optimizer(model: CloverModel, tc: TrainConfig, master: MasterWeights | None = None) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices (linears, embeddings, experts), none on norms,
    gates' scalars, memory key/calibration, conv. With `master`, it steps the fp32 copies."""
    decay, no_decay = [], []
    named = zip(master.names, master.master) if master is not None else model.named_parameters()
    for name, p in named:
        is_matrix = p.ndim >= 2 and not name.endswith(("memory.key", "conv.weight"))
        (decay if is_matrix else no_decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tc.lr,
        betas=tc.betas,
        eps=1e-8,
        fused=True,  # one kernel over all parameters, not ~100 small loops per step
    )


def choose_block(gen: torch.Generator, tc: TrainConfig) -> int:
    p = torch.tensor(tc.block_probs, dtype=torch.float64)
    return int(tc.block_sizes[int(torch.multinomial(p, 1, generator=gen))])


def batch_shape(B: int, tc: TrainConfig, seq_tokens: int | None = None) -> tuple[int, int]:
    """(n_seq, n_blocks) for block size B: windows of ~seq_tokens (default tc.seq_tokens),
    ~tokens_per_batch tokens."""
    n_blocks = max(2, round((seq_tokens or tc.seq_tokens) / B)) + 1
    per_seq = (n_blocks - 1) * B + (B + 1) / 2
    n_seq = max(1, round(tc.tokens_per_batch / per_seq))
    return n_seq, n_blocks


class MasterWeights:
    """Pure-BF16 training: the model's parameters are BF16 (no per-op casts), the optimizer
    steps float32 master copies, which are copied back after each step."""

    def __init__(self, model: CloverModel):
        self.names = [n for n, _ in model.named_parameters()]
        self.master = [torch.nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
        model.to(torch.bfloat16)
        self.params = list(model.parameters())

    def grads_to_master(self):
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    def master_to_model(self):
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m)

    def state_dict(self) -> dict:
        return {n: m.detach() for n, m in zip(self.names, self.master)}

    def load_state_dict(self, sd: dict):
        with torch.no_grad():
            for n, m in zip(self.names, self.master):
                m.copy_(sd[n])
        self.master_to_model()


def train_step(
    model, opt, batch: Batch, tc: TrainConfig, lr: float, master: MasterWeights | None = None, certainty=None
):
    for g in opt.param_groups:
        g["lr"] = lr
    certainty = tc.certainty if certainty is None else certainty
    loss, st = diffusion_loss(model, batch, autocast=tc.precision == "autocast", certainty=certainty)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if master is not None:
        master.grads_to_master()
        params = master.master
    else:
        params = list(model.parameters())
    gn = torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
    opt.step()
    if master is not None:
        master.master_to_model()
    st.update(loss=float(loss.detach()), grad_norm=float(gn))
    return st


def compile_model(model: CloverModel) -> CloverModel:
    """torch.compile the training forward (an instance override of forward_train; the
    weights and every other method are untouched). Static shapes: one graph per batch shape
    (a handful: one per block size); graph breaks at the MoE's data-dependent routing."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    model.forward_train = torch.compile(CloverModel.forward_train.__get__(model), dynamic=False)
    return model


def uncompile_model(model: CloverModel) -> CloverModel:
    model.__dict__.pop("forward_train", None)
    return model


def _atomic_torch_save(obj, path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with output_file(path, force=True) as f:
        torch.save(obj, f)


def load_init(init_from: str | Path, c: CloverConfig, load_weights) -> dict:
    """Load a model folder's weights for a new run (train(init_from=...)); returns what the
    run's log records of its parent."""
    src = Path(init_from)
    parent = CloverModel.from_pretrained(src)
    if parent.config.to_dict() != c.to_dict():
        raise ValueError(f"{src}: model of another shape ({parent.config.to_dict()})")
    load_weights(parent.state_dict())
    plog = json.loads((src / "train_log.json").read_text()) if (src / "train_log.json").is_file() else {}
    keep = ("step", "tokens", "elapsed_s", "runs", "model_config", "train_config", "final", "data")
    return {"path": str(src), **{k: plog.get(k) for k in keep}, "tokens": plog.get("tokens", 0)}


class _Run:
    """One call of train(): the model and what a checkpoint holds (the weights, the master
    copies' under bf16; the optimizer; the batch RNG; the log), the run's clock and the
    clocks of its periodic evals, checkpoints and exports."""

    def __init__(self, model: CloverModel, tc: TrainConfig):
        self.model, self.tc = model, tc
        model.to(tc.device).train()
        self.master = MasterWeights(model) if tc.precision == "bf16" else None
        self.opt = make_optimizer(model, tc, self.master)
        if tc.compile:
            compile_model(model)
        self.gen = torch.Generator().manual_seed(tc.seed)
        self.train_config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(tc).items()}
        self.log = {
            "train_config": self.train_config,
            "model_config": model.config.to_dict(),
            "n_params": sum(p.numel() for p in model.parameters()),
            "steps": [],
            "evals": [],
            "tokens": 0,
            "step": 0,
            "elapsed_s": 0.0,
        }
        self.ckpt_dir = Path(tc.ckpt_dir)

    def weights(self) -> dict:
        if self.master is not None:
            return self.master.state_dict()
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def load_weights(self, sd: dict):
        if self.master is not None:
            self.master.load_state_dict(sd)
        else:
            self.model.load_state_dict(sd)

    def start(self, resume, init_from, command: str | None, log_fn) -> None:
        """Take the weights, log and RNG from `init_from` or `resume` (see train()), record
        this part in log["runs"] and start the clocks."""
        c = self.model.config
        warm = bool(resume) and Path(resume).is_dir()
        if init_from and not resume:
            self.log["init_from"] = load_init(init_from, c, self.load_weights)
            log_fn(
                f"new run from the weights of {init_from} ({self.log['init_from']['tokens']:,} tokens trained there)"
            )
        if warm:
            self._warm_restart(resume, log_fn)
        elif resume:
            ck = torch.load(resume, weights_only=False, map_location=self.tc.device)
            if ck["log"]["model_config"] != c.to_dict():
                raise ValueError(f"{resume}: checkpoint of another model shape ({ck['log']['model_config']})")
            self.load_weights(ck["model"])
            self.opt.load_state_dict(ck["opt"])
            self.gen.set_state(ck["gen"].cpu())
            self.log = ck["log"]
            self.log["train_config"] = self.train_config
            log_fn(f"resumed from {resume} at step {self.log['step']}, {self.log['tokens']} tokens")
        log = self.log
        self.elapsed0, self.warm_start = log["elapsed_s"], log.get("warm_start_step", 0)
        log.setdefault("runs", []).append(
            {
                "step": log["step"],
                "tokens": log["tokens"],
                "elapsed_s": round(self.elapsed0, 1),
                "command": command,
                "warm_restart": warm,
            }
        )
        self.t_start = time.time()
        self.last_ckpt = self.last_eval = self.last_export = time.time()

    def _warm_restart(self, folder, log_fn) -> None:
        """A released model folder (model.safetensors + train_log.json), for when the checkpoint
        is gone: its weights and log; the optimizer moments restart at zero, so the LR warms up again."""
        log = json.loads((Path(folder) / "train_log.json").read_text())
        if log["model_config"] != self.model.config.to_dict():
            raise ValueError(f"{folder}: model of another shape ({log['model_config']})")
        self.load_weights(CloverModel.from_pretrained(folder).state_dict())
        for k in ("final", "unigram", "command", "data", "finished"):
            log.pop(k, None)
        log["warm_start_step"] = log["step"]
        self.gen.manual_seed(self.tc.seed + log["step"])  # not the batches the run began with
        log["train_config"] = self.train_config
        self.log = log
        log_fn(f"warm restart from {folder} at step {log['step']}, {log['tokens']} tokens (new optimizer state)")

    def elapsed(self) -> float:
        """Seconds trained, this part and the earlier ones."""
        return self.elapsed0 + time.time() - self.t_start

    def progress(self, step: int, tokens: int) -> float:
        """How far the run is, by steps, time or tokens, whichever is furthest (1: done)."""
        tc = self.tc
        progress = step / tc.max_steps
        if tc.time_budget_min:
            progress = max(progress, self.elapsed() / (tc.time_budget_min * 60))
        if tc.max_tokens:
            progress = max(progress, tokens / tc.max_tokens)
        return progress

    def draw_batch(
        self, stream: torch.Tensor, chat: tuple | None, B: int, copy: bool = False, seq_tokens: int | None = None
    ) -> Batch:
        """A batch of block size B from the stream (copy windows of it with `copy`), or from
        chat = (ids, starts, scored) (a chat or distill stream) in windows of ~seq_tokens."""
        tc, c, gen = self.tc, self.model.config, self.gen
        if copy:
            n_seq, nb = batch_shape(B, tc)
            return sample_recall_batch(stream, n_seq, B, nb, gen, c.mask_token_id, c.pad_token_id, tc.eps)
        if chat is None:
            n_seq, nb = batch_shape(B, tc)
            return sample_batch(stream, n_seq, B, nb, gen, c.mask_token_id, c.pad_token_id, tc.eps)
        ids, starts, scored = chat
        n_seq, nb = batch_shape(B, tc, seq_tokens or tc.chat_seq_tokens)
        return sample_batch(
            ids, n_seq, B, nb, gen, c.mask_token_id, c.pad_token_id, tc.eps, start_points=starts, score_mask=scored
        )

    def step(self, stream: torch.Tensor, chat: tuple | None, distill: list, B: int, lr: float):
        """One train step on a batch of the kind a draw picks: "chat", "copy", "distill" (one of
        the distill streams; by their ratios) or "code". Returns (kind, stats)."""
        tc = self.tc
        mixed = (chat is not None and tc.chat_ratio > 0) or tc.copy_ratio > 0 or (distill and sum(tc.distill_ratio) > 0)
        # (a run without chat, copy or distill draws no extra random number: its batches stay as before)
        u = float(torch.rand(1, generator=self.gen)) if mixed else 1.0
        kind, source, seq, lo = "code", None, None, 0.0
        parts = [("chat", tc.chat_ratio, chat, None), ("copy", tc.copy_ratio, True, None)]
        parts += [("distill", r, d, n) for d, r, n in zip(distill, tc.distill_ratio, tc.distill_seq_tokens)]
        for name, ratio, there, n in parts:
            if lo <= u < lo + ratio:
                if there is not None:
                    kind, source, seq = name, there, n
                break
            lo += ratio
        if kind == "distill":
            batch = self.draw_batch(stream, source, B, seq_tokens=seq).to(tc.device)
            return kind, train_step(self.model, self.opt, batch, tc, lr, self.master, certainty=tc.distill_certainty)
        batch = self.draw_batch(stream, chat if kind == "chat" else None, B, copy=kind == "copy").to(tc.device)
        return kind, train_step(self.model, self.opt, batch, tc, lr, self.master)

    def save_ckpt(self) -> None:
        log = self.log
        log["elapsed_s"] = self.elapsed()
        ck = {"model": self.weights(), "opt": self.opt.state_dict(), "gen": self.gen.get_state(), "log": log}
        _atomic_torch_save(ck, self.ckpt_dir / "ckpt-last.pt")
        write_json(self.ckpt_dir / "train_log.json", log, indent=None)
        save_hf(self.model, self.ckpt_dir / "hf")

    def periodic(self, step: int, tokens: int, rec: dict, heldout, export, log_fn) -> None:
        """The held-out eval, checkpoint and export that are due after this step."""
        tc, log = self.tc, self.log
        if heldout is not None and tc.eval_every_min and time.time() - self.last_eval > tc.eval_every_min * 60:
            ev = evaluate_heldout(self.model, heldout[: tc.eval_tokens], autocast=tc.precision == "autocast")
            ev.update(step=step, tokens=tokens, time_s=rec["time_s"])
            log["evals"].append(ev)
            log_fn(f"eval step {step}: held-out {ev['bits_per_token']:.3f} bits/token (first {ev['n_tokens']} tokens)")
            self.last_eval = time.time()
        if time.time() - self.last_ckpt > tc.ckpt_every_min * 60:
            self.save_ckpt()
            log_fn(f"checkpoint step {step} -> {self.ckpt_dir}")
            self.last_ckpt = time.time()
        if export is not None and tc.export_every_min and time.time() - self.last_export > tc.export_every_min * 60:
            log["elapsed_s"] = self.elapsed()
            log_fn(f"exported step {step} -> {export(self.model, log)}")
            self.last_export = time.time()

    def finish(self) -> dict:
        """The last checkpoint; the model back to float32 (the master weights), eval mode."""
        self.save_ckpt()
        model = uncompile_model(self.model)
        if self.master is not None:  # hand back a float32 model holding the master weights
            model.to(torch.float32)
            model.load_state_dict(self.master.state_dict())
        model.eval()
        return self.log


def _step_record(step: int, tokens: int, time_s: float, st: dict, lr: float, B: int) -> dict:
    """One step's entry of log["steps"]."""
    return {
        "step": step,
        "tokens": tokens,
        "time_s": round(time_s, 2),
        "loss": round(st["loss"], 4),
        "masked_ce": round(st["masked_ce"], 4),
        "masked_entropy": round(st["masked_entropy"], 4),
        "lr": float(f"{lr:.4g}"),
        "B": B,
        "grad_norm": round(st["grad_norm"], 3),
    }


def _progress_line(recent: list[dict], rec: dict, st: dict, lr: float, B: int, tps: float) -> str:
    """The log line of every log_every steps: means over `recent`, tok/s of compute."""
    return (
        f"step {rec['step']} tok {rec['tokens']} t {rec['time_s']:.0f}s loss {np.mean([r['loss'] for r in recent]):.4f} "
        f"mce {np.mean([r['masked_ce'] for r in recent]):.4f} ent {np.mean([r.get('masked_entropy', np.nan) for r in recent]):.4f} "
        f"lr {lr:.2e} gn {st['grad_norm']:.2f} "
        f"B {B} tok/s {tps:.0f}"
    )


def train(
    model: CloverModel,
    stream: torch.Tensor,
    tc: TrainConfig,
    heldout=None,
    log_fn=print,
    resume: str | Path | None = None,
    should_stop=None,
    command: str | None = None,
    chat: tuple | None = None,
    init_from: str | Path | None = None,
    export=None,
    distill: list | None = None,
) -> dict:
    """Train `model` (float32 on entry and on return) in place on the token stream.
    Checkpoints (fp32 weights, optimizer, RNG, log) go to {ckpt_dir}/ckpt-last.pt every
    ckpt_every_min minutes, with a BF16 HF copy in {ckpt_dir}/hf. `should_stop(step)` true
    ends this run early with a checkpoint (log["finished"] false): `resume` continues it,
    batches and schedule exactly as one uninterrupted run. `resume` may also be a saved model
    folder: a warm restart (same weights and log, fresh optimizer and batches). log["runs"]
    records where each part started and with what `command`.

    `chat` = (ids, starts[, scored]): a second stream (chat transcripts, each beginning at a
    position of `starts`); a tc.chat_ratio share of the batches are windows of ~tc.chat_seq_tokens
    of it, each starting where a transcript does; with `scored` (bool per token) only those tokens
    are noised and scored in them. `init_from`: a model folder whose weights start a
    new run (step 0, its own schedule; log["init_from"] records the parent). `distill` = a list
    of (ids, starts, scored): the model's own continuations (distill.py), each a
    tc.distill_ratio[i] share of the batches in windows of ~tc.distill_seq_tokens[i], with
    tc.distill_certainty as their certainty weight. `export(model,
    log)` is called every tc.export_every_min minutes. Returns the log dict."""
    torch.set_num_threads(tc.threads)
    run = _Run(model, tc)
    run.start(resume, init_from, command, log_fn)
    log, gen = run.log, run.gen
    step, tokens = log["step"], log["tokens"]
    chat_parts = (tuple(chat) + (None,))[:3] if chat is not None else None
    win_tok, win_t = 0, 0.0

    while True:
        progress = run.progress(step, tokens)
        if step >= tc.max_steps or progress >= 1.0:
            log["finished"] = True
            break
        if should_stop is not None and should_stop(step):
            log["finished"] = False
            log_fn(f"stopping at step {step}, {tokens} tokens; --resume {run.ckpt_dir / 'ckpt-last.pt'} continues")
            break
        lr = lr_at(step, progress, tc, run.warm_start)
        B = choose_block(gen, tc)
        # (a run without chat or copy draws no extra random number: its batches stay as before)
        t0 = time.time()
        kind, st = run.step(stream, chat_parts, distill or [], B, lr)
        win_t += time.time() - t0
        if not math.isfinite(st["loss"]):
            raise FloatingPointError(f"non-finite loss at step {step}")
        step += 1
        tokens += st["n_tokens"]
        win_tok += st["n_tokens"]
        rec = _step_record(step, tokens, run.elapsed(), st, lr, B)
        if chat is not None:
            rec["chat"] = int(kind == "chat")
        if tc.copy_ratio > 0:
            rec["copy"] = int(kind == "copy")
        if distill:
            rec["distill"] = int(kind == "distill")
        log["steps"].append(rec)
        log["step"], log["tokens"] = step, tokens
        if step % tc.log_every == 0:
            tps = win_tok / max(win_t, 1e-9)  # compute time only (evals/checkpoints excluded)
            win_tok, win_t = 0, 0.0
            log_fn(_progress_line(log["steps"][-tc.log_every :], rec, st, lr, B, tps))
            rec["tok_per_s"] = round(tps, 1)
        run.periodic(step, tokens, rec, heldout, export, log_fn)
    return run.finish()
