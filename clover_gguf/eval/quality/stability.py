"""Formatting stability inside a block (issue 23, part 3): how often a block's early decisions
would be taken back once the block is finished.

A block is denoised as usual (greedy) while every step's input is recorded, so each position's
unmasking step is known. When the block is finished, every position unmasked before the last
step is masked again on its own, the rest of the finished block visible, and the model's argmax
there is compared with the token it committed to: a different argmax is a revision the schedule
did not allow (the finished block contradicts an earlier choice). Reported per schedule (steps 4,
steps 8, the threshold schedule): the fraction of blocks with at least one revision, the fraction
of checked positions revised, and both for blocks inside tool calls, thinking and prose.
"""

from __future__ import annotations

import torch

from ...reference.generate import generate
from .tool_blocks import BLOCK_CLASSES, IM_END, gen_config, token_labels

STABILITY_TOKENS = 64


class RecordingBackend:
    """A LogitsBackend that remembers the inputs of the current block's denoising steps."""

    def __init__(self, inner):
        self.inner, self.inputs = inner, []

    def prefill(self, tokens, block_size):
        self.inner.prefill(tokens, block_size)

    def block_logits(self, block):
        self.inputs.append(list(block))
        return self.inner.block_logits(block)

    def commit(self, block):
        self.inner.commit(block)


def revisions(backend: RecordingBackend, final: list[int], mask_id: int) -> tuple[int, int]:
    """(positions checked, positions whose leave-one-out argmax differs from the committed token)
    for the block just finished; uses the inner backend (the state is the block's start)."""
    last_masked = {i for i, t in enumerate(backend.inputs[-1]) if t == mask_id} if backend.inputs else set()
    checked = [i for i in range(len(final)) if i not in last_masked]
    n_rev = 0
    for i in checked:
        probe = list(final)
        probe[i] = mask_id
        logits = torch.as_tensor(backend.inner.block_logits(probe)).float()[i]
        logits[mask_id] = float("-inf")
        n_rev += int(int(torch.argmax(logits)) != final[i])
    return len(checked), n_rev


def schedules(cfg) -> list[tuple[str, dict]]:
    return [("steps 4", {"steps": 4}), ("steps 8", {"steps": 8}), (f"threshold {cfg.threshold}", {"steps": None})]


def block_records(dec, turn: dict, cfg, sched: dict) -> list[dict]:
    """Generate one turn under a schedule (greedy, Python-driven) and check every block."""
    g = gen_config(dec, cfg, cfg.seed, min(cfg.max_new_tokens, STABILITY_TOKENS))
    g.temperature = 0.0
    g.steps = sched["steps"]
    g.threshold = None if g.steps else cfg.threshold
    if g.steps is not None:
        g.steps = min(g.steps, g.block_size)
    be = RecordingBackend(dec.backend())
    end_id = dec.token_id(IM_END)
    recs = []

    def on_block(toks, st):
        n, r = revisions(be, toks, dec.mask)
        recs.append({"n_tokens": len(toks), "checked": n, "revised": r})
        be.inputs = []
        return end_id not in toks

    res = generate(be, dec.prompt(turn), g, on_block)
    labels = token_labels([dec.text([t]) for t in res.tokens], turn["thinking"])
    i = 0
    for r in recs:
        kinds = [x for x in labels[i : i + r["n_tokens"]] if x != "end"]
        i += r["n_tokens"]
        r["class"] = max(BLOCK_CLASSES, key=kinds.count) if kinds else "end"
    return [r for r in recs if r["class"] != "end"]


def stability_of(dec, turns: list[dict], cfg, log=print) -> dict:
    """Per schedule: blocks, blocks revised, positions checked / revised, by block class, on the
    first cfg.stability_turns turns that expect a call."""
    picked = [t for t in turns if t["expected"]][: cfg.stability_turns]
    out = {}
    for name, sched in schedules(cfg):
        recs = [r for t in picked for r in block_records(dec, t, cfg, sched)]

        def agg(rs):
            return {
                "blocks": len(rs),
                "blocks_revised": sum(r["revised"] > 0 for r in rs),
                "positions_checked": sum(r["checked"] for r in rs),
                "positions_revised": sum(r["revised"] for r in rs),
            }

        out[name] = {**agg(recs), "by_class": {k: agg([r for r in recs if r["class"] == k]) for k in BLOCK_CLASSES}}
        log(f"stability {dec.name} {name}: {out[name]['blocks_revised']}/{out[name]['blocks']} blocks revised")
    return {"turns": len(picked), "schedules": out}
