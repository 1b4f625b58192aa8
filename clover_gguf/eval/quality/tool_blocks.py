"""The parts of a generated tools turn (tools.py, stability.py): which block class a
token is in (a tool call, thinking, prose), the steps each class took, and a turn's
generation config."""

from __future__ import annotations

from ...reference.generate import GenerationConfig
from ...tokenizer import END_TOOL_CALL, tool_call_sections

IM_END = "<|im_end|>"
BLOCK_CLASSES = ("call", "prose", "think")


def token_labels(pieces: list[str], thinking: bool) -> list[str]:
    """call / think / prose / end for each generated token (by where its text starts): inside a
    `<tool_call>` section, inside the think block, elsewhere, or after the end of the turn."""
    text = "".join(pieces)
    spans = [(i, len(text) if j is None else j + len(END_TOOL_CALL), "call") for i, _, j in tool_call_sections(text)]
    if thinking and text.lstrip().startswith("<think>"):
        spans.append((0, text.find("</think>") + len("</think>") if "</think>" in text else len(text), "think"))
    end = text.find(IM_END)
    out, pos = [], 0
    for p in pieces:
        lab = "end" if 0 <= end < pos + 1 else next((k for a, b, k in spans if a <= pos < b), "prose")
        out.append(lab)
        pos += len(p)
    return out


def block_steps(result, labels: list[str]) -> dict:
    """Per block class: (tokens, steps) summed over the blocks whose tokens are mostly of it."""
    out = {k: [0, 0] for k in BLOCK_CLASSES}
    i = 0
    for b in result.blocks:
        labs = labels[i : i + b.n_tokens]
        i += b.n_tokens
        kinds = [x for x in labs if x != "end"]
        if not kinds:
            continue
        k = max(BLOCK_CLASSES, key=kinds.count)
        out[k][0] += b.n_tokens
        out[k][1] += b.steps
    return out


def gen_config(
    dec, cfg, seed: int, max_new_tokens: int | None = None, block_size: int | None = None
) -> GenerationConfig:
    """The eval's generation settings (cfg: a ToolsConfig or MemoryConfig); block_size, when
    given, instead of cfg's (eval memory sweeps it)."""
    return GenerationConfig(
        max_new_tokens=max_new_tokens or cfg.max_new_tokens,
        block_size=block_size or cfg.block_size or dec.block_size,
        steps=cfg.steps,
        threshold=None if cfg.steps else cfg.threshold,
        temperature=cfg.temperature,
        seed=seed,
        mask_token_id=dec.mask,
        eos_token_id=dec.eos,
    )
