"""What state reuse stands on, in the runtime the server uses: a snapshot restores the memory
bit for bit, and committing a history in two calls split at a block boundary gives the same
memory as one call (so a restored prefix + the rest equals a fresh prefill)."""

from __future__ import annotations

import random


def _memory(rt) -> bytes:
    return b"".join(rt.state(i).tobytes() for i in range(rt.n_layer))


def test_snapshot_restores_bit_exactly(rt):
    B = rt.default_block_size
    rng = random.Random(1)
    toks = [rng.randrange(10, rt.n_vocab) for _ in range(5 * B + 3)]
    rt.reset()
    rt.commit(toks[: 3 * B], B)
    snap, want, pos = rt.save_state(), _memory(rt), rt.n_committed
    rt.commit(toks[3 * B :], B)  # move on, then back
    assert _memory(rt) != want
    rt.load_state(snap)
    assert rt.n_committed == pos == 3 * B
    assert _memory(rt) == want
    rt.reset()
    rt.load_state(snap)  # also into an empty memory
    assert _memory(rt) == want and rt.n_committed == pos


def test_commit_split_at_block_boundaries_equals_one_commit(rt):
    """The server commits a prompt as [restored prefix] + [up to the last full block] + [the
    short tail]; every split at a multiple of B must give the memory of one commit."""
    B = rt.default_block_size
    rng = random.Random(2)
    toks = [rng.randrange(10, rt.n_vocab) for _ in range(20 * B + 5)]  # more blocks than one graph folds
    rt.reset()
    rt.commit(toks, B)
    want = _memory(rt)
    for k in (1, 3, 16, 17, 20):
        rt.reset()
        rt.commit(toks[: k * B], B)
        snap = rt.save_state()
        rt.reset()
        rt.load_state(snap)
        rt.commit(toks[k * B : 20 * B], B)
        rt.commit(toks[20 * B :], B)
        assert _memory(rt) == want, f"split after {k} blocks"


def test_continue_without_reset_equals_fresh_run(rt):
    """generate(reset=False) after a restored prefix = the same prompt generated from scratch."""
    from clover_gguf.reference.generate import GenerationConfig

    B = rt.default_block_size
    ids = rt.tokenize("import os\n\n\ndef walk(top):\n    for root, dirs, files in os.walk(top):\n")
    cfg = GenerationConfig(max_new_tokens=2 * B, block_size=B)
    rt.reset()
    fresh = rt.generate(ids, cfg, reset=False).tokens
    n = len(ids) // B * B
    rt.reset()
    rt.commit(ids[:n], B)
    snap = rt.save_state()
    rt.reset()
    rt.load_state(snap)
    res = rt.generate(ids[n:], cfg, reset=False)
    assert res.tokens == fresh and res.prompt_tokens == len(ids) - n
    # and the step-level loop agrees with the native one-call generation on this prompt
    assert rt.generate(ids, cfg).tokens == fresh
