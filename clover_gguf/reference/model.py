"""PyTorch reference implementation of Clover (spec sections 2 and 3).

Blocks are processed as tensors [N, nb, L]: N sequences, nb blocks each of L slots. Every
block reads the memory state at its own start; `valid` marks real tokens (padding sits at
the end of a block and is invisible: no attention, zero conv input, no state update).
"""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..config import CloverConfig
from ..constants import EXPERT_PROJS, HF_EXPERT_FUSED_DOWN, HF_EXPERT_FUSED_GATE_UP, HF_EXPERT_PER, L2NORM_EPS
from .delta_rule import chunked_scan, recurrent_update


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * w.float()).to(x.dtype)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)


def rope_neox(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [..., L, heads, D], pos [..., L]: dim j < D/2 paired with j + D/2."""
    D = x.shape[-1]
    inv = theta ** (-torch.arange(0, D // 2, dtype=torch.float64, device=pos.device) * 2 / D)
    ang = (pos.double()[..., None] * inv).float()[..., None, :]  # [..., L, 1, D/2]
    cos, sin = ang.cos(), ang.sin()
    xf = x.float()
    x1, x2 = xf[..., : D // 2], xf[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def memory_readout(qh: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """r_{i,h} = S_g^T q̂_{i,h}, g = floor(h H_kv / H). qh [..., L, H, D], S [..., H_kv, Dk, Dv]."""
    grp = qh.shape[-2] // S.shape[-3]
    return torch.einsum("...lhk,...hkv->...lhv", qh.float(), S.float().repeat_interleave(grp, dim=-3))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Memory(nn.Module):
    def __init__(self, c: CloverConfig):
        super().__init__()
        d, H, Hkv, D = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.a_proj = nn.Linear(d, Hkv, bias=False)
        self.b_proj = nn.Linear(d, Hkv, bias=False)
        self.A_log = nn.Parameter(torch.zeros(Hkv))
        self.dt_bias = nn.Parameter(torch.zeros(Hkv))
        self.key = nn.Parameter(torch.zeros(H, D))
        self.calibration = nn.Parameter(torch.ones(H))


class Attention(nn.Module):
    def __init__(self, c: CloverConfig):
        super().__init__()
        d, H, Hkv, D = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(d, H * D, bias=False)
        self.k_proj = nn.Linear(d, Hkv * D, bias=False)
        self.v_proj = nn.Linear(d, Hkv * D, bias=False)
        self.o_proj = nn.Linear(H * D, d, bias=False)
        self.q_norm = RMSNorm(D, c.rms_norm_eps)
        self.k_norm = RMSNorm(D, c.rms_norm_eps)
        self.memory = Memory(c)


class Conv(nn.Module):
    def __init__(self, c: CloverConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(c.hidden_size, 1, c.conv_kernel_size))
        self.scale = nn.Parameter(torch.ones(c.hidden_size))


class SwiGLU(nn.Module):
    """down(SiLU(gate(v)) * up(v)): the shared expert."""

    def __init__(self, d: int, f: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(v)) * self.up_proj(v))


class GatedActivation(nn.Module):
    """SiLU(gate) * up of the routed experts' [n, 2F] projections, rows grouped by expert.
    Its own module so that a forward hook sees the down projections' inputs (imatrix)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class Experts(nn.Module):
    """The routed experts, stacked as the fused checkpoint layout stores them:
    gate_up_proj [E, 2F, d] (gate rows first), down_proj [E, d, F]."""

    def __init__(self, c: CloverConfig):
        super().__init__()
        E, Fe, d = c.num_experts, c.moe_intermediate_size, c.hidden_size
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * Fe, d))
        self.down_proj = nn.Parameter(torch.zeros(E, d, Fe))
        self.act = GatedActivation()

    def forward(self, v: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """v [T, d], top-k ids and weights [T, k] -> sum_e w_e expert_e(v), float32 [T, d]."""
        order = torch.argsort(ids.reshape(-1), stable=True)  # routed rows grouped by expert
        counts = torch.bincount(ids.reshape(-1), minlength=self.gate_up_proj.shape[0]).tolist()
        tok = order // ids.shape[-1]
        x = v[tok]
        bounds = [(e, a, a + n) for e, (a, n) in enumerate(zip(itertools.accumulate([0] + counts), counts)) if n]
        # unbind (not [e]): its backward stacks the grads once instead of E full-size adds
        wgu, wd = self.gate_up_proj.unbind(0), self.down_proj.unbind(0)
        h = self.act(torch.cat([x[a:b] @ wgu[e].T for e, a, b in bounds]))
        y = torch.cat([h[a:b] @ wd[e].T for e, a, b in bounds]).float() * w.reshape(-1)[order, None]
        return torch.zeros(v.shape[0], v.shape[1], dtype=torch.float32, device=v.device).index_add_(0, tok, y)


class MoE(nn.Module):
    def __init__(self, c: CloverConfig):
        super().__init__()
        d, E = c.hidden_size, c.num_experts
        self.gate = nn.Linear(d, E, bias=False)
        self.experts = Experts(c)
        self.shared_expert = SwiGLU(d, c.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(d, 1, bias=False)
        self.top_k, self.norm_topk = c.num_experts_per_tok, c.norm_topk_prob

    def route(self, v: torch.Tensor):
        """Router in float32: (top-k ids [T, k], weights [T, k] float32)."""
        probs = torch.softmax(v.float() @ self.gate.weight.float().T, dim=-1)
        w, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            w = w / w.sum(-1, keepdim=True)
        return ids, w

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        shape = v.shape
        v = v.reshape(-1, shape[-1])
        ids, w = self.route(v)
        moe = self.experts(v, ids, w)
        sh = self.shared_expert(v).float() * torch.sigmoid(self.shared_expert_gate(v).float())
        return (moe + sh).to(v.dtype).reshape(shape)


class DecoderLayer(nn.Module):
    def __init__(self, c: CloverConfig):
        super().__init__()
        self.c = c
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.conv = Conv(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MoE(c)

    def project(self, x: torch.Tensor, valid: torch.Tensor | None):
        """u, Q, K, V for blocks x [N, nb, L, d]. Q [.., L, H, D], K/V [.., L, Hkv, D]."""
        c, a = self.c, self.self_attn
        u = self.input_layernorm(x)
        if valid is not None:
            u = u * valid[..., None].to(u.dtype)
        sh = u.shape[:-1]
        Q = a.q_norm(a.q_proj(u).view(*sh, c.num_attention_heads, c.head_dim))
        K = a.k_norm(a.k_proj(u).view(*sh, c.num_key_value_heads, c.head_dim))
        V = a.v_proj(u).view(*sh, c.num_key_value_heads, c.head_dim)
        return u, Q, K, V

    def memory_inputs(self, u, K, V, valid):
        """Delta-rule inputs, float32, heads first: k̂, V [.., Hkv, L, D]; g, beta [.., Hkv, L]."""
        m = self.self_attn.memory
        uf = u.float()
        g = -torch.exp(m.A_log.float()) * F.softplus(uf @ m.a_proj.weight.float().T + m.dt_bias.float())
        beta = torch.sigmoid(uf @ m.b_proj.weight.float().T)
        if valid is not None:
            g, beta = g * valid[..., None], beta * valid[..., None]
        k = l2norm(K).movedim(-2, -3)
        return k, V.float().movedim(-2, -3), g.movedim(-1, -2), beta.movedim(-1, -2)

    def conv_branch(self, u: torch.Tensor) -> torch.Tensor:
        """C = SiLU(sum_t w[:, t] * u_{i+t}) * scale, zeros past the block end. u [..., L, d]."""
        K_c, L = self.c.conv_kernel_size, u.shape[-2]
        up = F.pad(u, (0, 0, 0, K_c - 1))
        w = self.conv.weight[:, 0, :]
        return F.silu(sum(up[..., t : t + L, :] * w[:, t] for t in range(K_c))) * self.conv.scale

    def mix(self, x, u, Q, K, V, pos, valid, S):
        """Section 2 steps 3-7 given the state S [N, nb, Hkv, D, D] at each block start."""
        c, a = self.c, self.self_attn
        H, Hkv, D, L = c.num_attention_heads, c.num_key_value_heads, c.head_dim, x.shape[-2]
        grp = H // Hkv
        r = memory_readout(l2norm(Q), S)
        # block attention with the memory slot
        Qr = rope_neox(Q, pos, c.rope_theta)
        Kr = rope_neox(K, pos, c.rope_theta).repeat_interleave(grp, dim=-2)
        Vf = V.float().repeat_interleave(grp, dim=-2)
        s = torch.einsum("nblhd,nbjhd->nbhlj", Qr, Kr) / math.sqrt(D)
        if valid is not None:
            s = s.masked_fill(~valid[:, :, None, None, :], -torch.inf)
            nvalid = valid.sum(-1).clamp(min=1).float()
        else:
            nvalid = torch.full(x.shape[:2], float(L), device=x.device)
        smem = torch.einsum("nblhd,hd->nbhl", Q.float(), a.memory.key.float()) / math.sqrt(D)
        smem = smem + a.memory.calibration.float()[:, None] * torch.log(nvalid)[:, :, None, None]
        p = torch.softmax(torch.cat([s, smem[..., None]], dim=-1), dim=-1)
        o = torch.einsum("nbhlj,nbjhd->nblhd", p[..., :L], Vf) + p[..., L].permute(0, 1, 3, 2)[..., None] * r
        A = a.o_proj(o.reshape(*o.shape[:-2], H * D).to(x.dtype))
        x1 = x + A + self.conv_branch(u).to(x.dtype)
        v = self.post_attention_layernorm(x1)
        return x1 + self.mlp(v)


class CloverBackbone(nn.Module):
    def __init__(self, c: CloverConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class CloverModel(nn.Module):
    """Modules carry the checkpoint's names (mlx-lm style): state_dict() is the fused-experts
    checkpoint, name for name; `sanitize` stacks a per-expert checkpoint into that form."""

    def __init__(self, config: CloverConfig):
        super().__init__()
        self.config = config
        self.model = CloverBackbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32) -> CloverModel:
        from ..checkpoint import load_tensors

        config, tensors = load_tensors(model_dir)
        return cls.from_tensors(config, tensors, dtype)

    @classmethod
    def from_tensors(cls, config: CloverConfig, tensors: dict, dtype: torch.dtype = torch.float32) -> CloverModel:
        with torch.device("meta"):
            m = cls(config)
        sd = {k: v.to(dtype) for k, v in sanitize(config, tensors).items()}
        m.load_state_dict(sd, strict=True, assign=True)
        return m.eval()

    def hf_state_dict(self, fused: bool = False) -> dict[str, torch.Tensor]:
        """Weights under the checkpoint's names, experts fused or per expert."""
        sd = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        return sd if fused else unsanitize(self.config, sd)

    # ---- state ---------------------------------------------------------------------------
    def init_state(self, batch: int = 1) -> list[torch.Tensor]:
        c = self.config
        dev = self.lm_head.weight.device
        return [
            torch.zeros(batch, c.num_key_value_heads, c.head_dim, c.head_dim, device=dev)
            for _ in range(c.num_hidden_layers)
        ]

    # ---- core ----------------------------------------------------------------------------
    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(h)).float()

    def _run(self, tokens, pos, valid, *, starts=None, init=None, n_clean=None):
        """tokens/pos/valid [N, nb, L]. Either `starts` (per layer [N, nb, Hkv, D, D], read
        only) or `init` (per layer [n_clean, Hkv, D, D]): then rows [0, n_clean) are clean
        blocks committed layer-parallel and every row r reads the states of clean row
        r % n_clean. Returns (hidden [N, nb, L, d], final states or None); with `init` the
        hidden holds rows [n_clean, N) only: the clean rows' last-layer outputs feed nothing,
        so that layer mixes only the other rows (an eighth of the work at 4 layers)."""
        x = self.model.embed_tokens(tokens)
        finals = []
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            u, Q, K, V = layer.project(x, valid)
            if init is not None:
                k, v, g, beta = layer.memory_inputs(
                    u[:n_clean], K[:n_clean], V[:n_clean], None if valid is None else valid[:n_clean]
                )
                S, final = chunked_scan(init[i], k, v, g, beta)
                finals.append(final)
                S = S.repeat(tokens.shape[0] // n_clean, 1, 1, 1, 1)
                if i == last:
                    rest = slice(n_clean, None)
                    x, u, Q, K, V, pos, S = (t[rest] for t in (x, u, Q, K, V, pos, S))
                    valid = None if valid is None else valid[rest]
                    if x.shape[0] == 0:
                        break
            else:
                S = starts[i]
            x = layer.mix(x, u, Q, K, V, pos, valid, S)
        return x, (finals if init is not None else None)

    # ---- inference API ---------------------------------------------------------------------
    @torch.no_grad()
    def block_logits(self, tokens: torch.Tensor, pos0: int, state: list[torch.Tensor]) -> torch.Tensor:
        """Denoising step: logits [N, L, V] of one block; the state is only read."""
        tokens = tokens.reshape(tokens.shape[0], 1, -1)
        pos = (pos0 + torch.arange(tokens.shape[-1])).expand_as(tokens)
        h, _ = self._run(tokens, pos, None, starts=[s[:, None] for s in state])
        return self._logits(h)[:, 0]

    @torch.no_grad()
    def commit(self, tokens: torch.Tensor, pos0: int, state: list[torch.Tensor]):
        """Commit one clean block: outputs from the old state, then the delta rule token by
        token (spec order). Returns (logits [N, L, V], new state)."""
        tokens = tokens.reshape(tokens.shape[0], 1, -1)
        pos = (pos0 + torch.arange(tokens.shape[-1])).expand_as(tokens)
        x = self.model.embed_tokens(tokens)
        new = []
        for layer, S in zip(self.layers, state):
            u, Q, K, V = layer.project(x, None)
            k, v, g, beta = layer.memory_inputs(u, K, V, None)
            new.append(recurrent_update(S, k[:, 0], v[:, 0], g[:, 0], beta[:, 0]))
            x = layer.mix(x, u, Q, K, V, pos, None, S[:, None])
        return self._logits(x)[:, 0], new

    @torch.no_grad()
    def prefill(
        self, tokens: torch.Tensor, block_size: int, state=None, pos0: int = 0, mode: str = "parallel"
    ) -> list[torch.Tensor]:
        """Commit a prompt [N, T] in blocks of block_size (the last may be shorter)."""
        N, T = tokens.shape
        state = state if state is not None else self.init_state(N)
        if T == 0:
            return state
        if mode == "blockwise":
            for s in range(0, T, block_size):
                _, state = self.commit(tokens[:, s : s + block_size], pos0 + s, state)
            return state
        if mode != "parallel":
            raise ValueError(f"prefill mode must be 'parallel' or 'blockwise', not {mode!r}")
        nb = -(-T // block_size)
        pad = nb * block_size - T
        tok = F.pad(tokens, (0, pad)).view(N, nb, block_size)
        pos = (pos0 + torch.arange(nb * block_size)).view(1, nb, block_size).expand(N, -1, -1)
        valid = (torch.arange(nb * block_size) < T).view(1, nb, block_size).expand(N, -1, -1)
        _, finals = self._run(tok, pos, valid, init=state, n_clean=N)
        return finals

    # ---- training ----------------------------------------------------------------------------
    def forward_train(self, clean, noisy, pos, valid, select=None) -> torch.Tensor:
        """Two streams (spec section 6): clean blocks [N, nb, B] are committed layer-parallel;
        noisy blocks [R*N, nb, B] (R noisy copies; row i reads clean row i % N) read the clean
        state at their start. pos/valid describe the clean rows; valid=None means all real.
        Returns the noisy stream's logits, [R*N, nb, B, V], or [n, V] where `select` is true."""
        N = clean.shape[0]
        if noisy.shape[0] % N:
            raise ValueError(f"noisy rows ({noisy.shape[0]}) must be a multiple of clean rows ({N})")
        rep = 1 + noisy.shape[0] // N
        tok = torch.cat([clean, noisy])
        h, _ = self._run(
            tok,
            pos.repeat(rep, 1, 1),
            None if valid is None else valid.repeat(rep, 1, 1),
            init=self.init_state(N),
            n_clean=N,
        )
        if select is not None:
            h = h[select]
        return self._logits(h)


def sanitize(config: CloverConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors in the model's own naming: per-expert experts stacked into the
    fused layout; everything else passes through under its own name."""
    out = dict(tensors)
    for i in range(config.num_hidden_layers):
        if HF_EXPERT_FUSED_DOWN.format(bid=i) in out:
            continue
        st = {
            p: torch.stack([out.pop(HF_EXPERT_PER.format(bid=i, xid=x, proj=p)) for x in range(config.num_experts)])
            for p in EXPERT_PROJS
        }
        out[HF_EXPERT_FUSED_GATE_UP.format(bid=i)] = torch.cat([st["gate"], st["up"]], 1)
        out[HF_EXPERT_FUSED_DOWN.format(bid=i)] = st["down"]
    return out


def unsanitize(config: CloverConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of sanitize: the fused experts split per expert, in spec order."""
    Fe = config.moe_intermediate_size
    out = {}
    for name in config.expected_tensors(fused=False):
        m = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$", name)
        if m is None:
            out[name] = sd[name]
            continue
        i, x, p = int(m.group(1)), int(m.group(2)), m.group(3)
        if p == "down":
            out[name] = sd[HF_EXPERT_FUSED_DOWN.format(bid=i)][x].contiguous()
        else:
            gu = sd[HF_EXPERT_FUSED_GATE_UP.format(bid=i)][x]
            out[name] = (gu[:Fe] if p == "gate" else gu[Fe:]).contiguous()
    return out
