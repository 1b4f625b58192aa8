"""The gated delta rule of spec section 3, in float32.

State layout: S[..., k, v] (D_k x D_v), readout r = S^T q.
    S <- alpha_t (I - beta_t k_t k_t^T) S + beta_t k_t v_t^T,   alpha_t = exp(g_t)
"""

from __future__ import annotations

import torch


def recurrent_update(
    S: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """Fold tokens t = 0..L-1 into S in order, exactly as the spec writes it.

    S: [..., Dk, Dv]; k: [..., L, Dk]; v: [..., L, Dv]; g, beta: [..., L]."""
    S = S.float()
    for t in range(k.shape[-2]):
        kt, vt = k[..., t, :].float(), v[..., t, :].float()
        a, b = torch.exp(g[..., t].float())[..., None, None], beta[..., t].float()[..., None, None]
        kS = torch.einsum("...k,...kv->...v", kt, S)
        S = a * (S - b * kt[..., :, None] * kS[..., None, :]) + b * kt[..., :, None] * vt[..., None, :]
    return S


def chunk_transition(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
    """One block as an affine map of the state: S_end = M @ S_start + C.

    Chunked (WY / UT-transform) form of the delta rule, the block being the chunk. With
    G = cumsum(g) and delta_t = beta_t (v_t - alpha_t S_{t-1}^T k_t):
        S_t = e^{G_t} S_0 + sum_{s<=t} e^{G_t - G_s} k_s delta_s^T
        (I + A) Delta = beta (V - e^{G} K S_0),  A_ts = beta_t e^{G_t - G_s} k_t.k_s  (s < t)
    Tokens with beta = 0 and g = 0 are no-ops (used for padding).
    k: [..., L, Dk]; v: [..., L, Dv]; g, beta: [..., L]. Returns M [..., Dk, Dk], C [..., Dk, Dv]."""
    k, v, g, beta = k.float(), v.float(), g.float(), beta.float()
    L = k.shape[-2]
    G = torch.cumsum(g, dim=-1)
    diff = G[..., :, None] - G[..., None, :]
    lower = torch.ones(L, L, dtype=torch.bool, device=k.device).tril(-1)
    decay = torch.exp(torch.where(lower, diff, torch.full_like(diff, -torch.inf)))
    A = beta[..., :, None] * decay * (k @ k.transpose(-1, -2))
    eye = torch.eye(L, dtype=k.dtype, device=k.device)
    IA = eye + A
    rhs = torch.cat([beta[..., None] * v, (beta * torch.exp(G))[..., None] * k], dim=-1)
    X = torch.linalg.solve_triangular(IA, rhs, upper=False, unitriangular=True)
    X1, X2 = X[..., : v.shape[-1]], X[..., v.shape[-1] :]
    Kw = k * torch.exp(G[..., -1:] - G)[..., None]
    C = Kw.transpose(-1, -2) @ X1
    M = (
        torch.exp(G[..., -1])[..., None, None] * torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
        - Kw.transpose(-1, -2) @ X2
    )
    return M, C


def chunked_scan(S0: torch.Tensor, k, v, g, beta):
    """Commit nb blocks in a row. k, v: [N, nb, Hkv, L, D]; g, beta: [N, nb, Hkv, L];
    S0: [N, Hkv, Dk, Dv]. Returns (states at each block start [N, nb, Hkv, Dk, Dv], final state)."""
    M, C = chunk_transition(k, v, g, beta)
    S = S0.float()
    starts = []
    for Mb, Cb in zip(M.unbind(1), C.unbind(1)):  # unbind: one grad stack, not nb full-size adds
        starts.append(S)
        S = Mb @ S + Cb
    return torch.stack(starts, dim=1), S
