"""Which module went non-finite first, on the PyTorch reference: the commits of a sequence and
one denoising step replayed with a forward hook on every module, which records the first
module (in the order they finish, so the innermost) whose output holds a NaN or an infinity,
e.g. ``model.layers.0.input_layernorm (RMSNorm, in the prompt commit)``. The runtime's
counterpart is clover_gguf/runtime/nonfinite.py."""

from __future__ import annotations

import torch


def _finite(x) -> bool:
    if isinstance(x, torch.Tensor):
        return not x.is_floating_point() or bool(torch.isfinite(x).all())
    if isinstance(x, tuple | list):
        return all(_finite(v) for v in x)
    if isinstance(x, dict):
        return all(_finite(v) for v in x.values())
    return True


def first_nonfinite_module(model, commits: list[tuple[list[int], int]], block: list[int]) -> tuple[str | None, int]:
    """(the first non-finite module described, or None; the module outputs checked)."""
    found: list[str] = []
    checked = [0]
    stage = ["prompt commit"]

    def hook(name):
        def f(module, args, output):
            if found:
                return
            checked[0] += 1
            if not _finite(output):
                found.append(f"{name} ({type(module).__name__}, in the {stage[0]})")

        return f

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    try:
        with torch.no_grad():
            state, pos = model.init_state(1), 0
            for toks, bs in commits:
                if toks and not found:
                    state = model.prefill(torch.tensor([toks]), bs, state, pos)
                pos += len(toks)
            if not found:
                stage[0] = "denoising step"
                model.block_logits(torch.tensor([block]), pos, state)
    finally:
        for h in handles:
            h.remove()
    return (found[0] if found else None), checked[0]
