"""The llama.cpp runtime (patched llama-cpp-python, clover.h) against the spec's test vectors and
the PyTorch reference. These tests need the built runtime (`clover-gguf runtime build`); without
it they FAIL (never skip) with the command to run.

Tolerances (the spec's): logits max |diff| < 1e-4 and mean KL < 1e-4 nats; states max |diff|
< 1e-4 (both sides compute in float32 from the same F32 GGUF / BF16 weights).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from testdata import REPO, TINY  # noqa: F401

from clover_gguf.reference.generate import GenerationConfig, TorchBackend, generate

LOGIT_TOL = 1e-4
KL_TOL = 1e-4
STATE_TOL = 1e-4


# ----------------------------------------------------------------------------- helpers


def _load_lib_or_fail():
    from clover_gguf.runtime import bindings

    try:
        return bindings.load()
    except bindings.RuntimeNotBuilt as e:
        pytest.fail(f"llama.cpp runtime not built: {e}", pytrace=False)


def convert_f32(model_dir: Path, out: Path) -> Path:
    """model_dir -> F32 GGUF (the experts F32 too when the converter allows it)."""
    from clover_gguf.convert.converter import convert

    kw = dict(outtype="f32", force=True, progress=False)
    last = None
    for extra in (dict(experts="f32"), dict(experts="bf16", tensor_types=[r"ffn_.*_exps=f32"]), dict(experts="bf16")):
        try:
            convert(model_dir, out, **kw, **extra)
            return out
        except Exception as e:  # noqa: BLE001 - try the next spelling
            last = e
    raise last


def kl_rows(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(ref.double(), -1)
    lq = torch.log_softmax(got.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def assert_logits_close(ref, got, what):
    ref = torch.as_tensor(np.asarray(ref, dtype=np.float32))
    got = torch.as_tensor(got).float()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    diff = (got - ref).abs().max().item()
    kl = kl_rows(ref, got).mean().item()
    assert diff < LOGIT_TOL and kl < KL_TOL, f"{what}: max|dlogit| {diff:.2e}, mean KL {kl:.2e}"
    return diff, kl


def assert_states_close(ref_states, rt, what):
    worst = 0.0
    for il, ref in enumerate(ref_states):
        got = rt.state(il)
        ref = np.asarray(ref, dtype=np.float32).reshape(got.shape)
        worst = max(worst, float(np.abs(got - ref).max()))
    assert worst < STATE_TOL, f"{what}: state max|diff| {worst:.2e}"
    return worst


def ref_states(state):
    return [s[0].detach().float().numpy() for s in state]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def lib():
    return _load_lib_or_fail()


@pytest.fixture(scope="session")
def vec_gguf(lib, vec_dir, tmp_path_factory):
    return convert_f32(vec_dir, tmp_path_factory.mktemp("rt") / "random-clover-f32.gguf")


@pytest.fixture(scope="session")
def vec_rt(vec_gguf):
    from clover_gguf.runtime.runtime import CloverRuntime

    # n_ubatch = 4 blocks of 8: clover_commit folds up to 4 prompt blocks per graph
    rt = CloverRuntime(vec_gguf, n_threads=1, n_ubatch=32, n_batch=32)
    yield rt
    rt.close()


@pytest.fixture(scope="session")
def vec_ref(vec_dir):
    from clover_gguf.reference.model import CloverModel

    return CloverModel.from_pretrained(vec_dir, dtype=torch.float32).eval()


# ----------------------------------------------------------------------------- spec vectors


def test_metadata(vec_rt, vec_ref):
    c = vec_ref.config
    assert vec_rt.n_vocab == c.vocab_size
    assert vec_rt.n_layer == c.num_hidden_layers
    assert vec_rt.mask_token_id == c.mask_token_id
    assert vec_rt.default_block_size == c.block_size


def test_vector_block_empty_memory(vec_rt, vectors):
    case = vectors["block_empty_memory"]
    vec_rt.reset()
    assert_logits_close(case["logits"], vec_rt.block_logits(case["tokens"]), "block_empty_memory")


def test_vector_denoise_after_prefill(vec_rt, vectors):
    case = vectors["denoise_after_prefill"]
    vec_rt.reset()
    vec_rt.commit(case["prompt"], case["block_size"])
    if vec_rt.n_committed is not None:
        assert vec_rt.n_committed == case["pos0"]
    assert_states_close(case["state_after_prefill"], vec_rt, "state after the 19-token prefill")
    assert_logits_close(case["logits"], vec_rt.block_logits(case["block"]), "denoise_after_prefill")


def test_vector_short_block(vec_rt, vectors):
    case = vectors["short_block"]
    vec_rt.reset()
    vec_rt.commit(case["prompt"], 8)
    assert_logits_close(case["logits"], vec_rt.block_logits(case["block"]), "short_block")


def test_vector_greedy_steps_one_call(vec_rt, vectors):
    case = vectors["greedy_steps"]
    cfg = GenerationConfig(
        max_new_tokens=case["max_new_tokens"], block_size=case["block_size"], steps=case["steps"], temperature=0.0
    )
    seen = []
    res = vec_rt.generate(case["prompt"], cfg, on_block=lambda toks, st: seen.append((toks, st)))
    assert res.tokens == case["tokens"]
    assert [b.steps for b in res.blocks] == [4, 4, 4]
    assert all(b.tokens_per_step == [2, 2, 2, 2] for b in res.blocks)
    assert [t for toks, _ in seen for t in toks] == case["tokens"]
    assert res.prompt_tokens == len(case["prompt"])


def test_vector_greedy_steps_python_loop(vec_rt, vectors):
    from clover_gguf.runtime.runtime import RuntimeBackend

    case = vectors["greedy_steps"]
    cfg = GenerationConfig(
        max_new_tokens=case["max_new_tokens"],
        block_size=case["block_size"],
        steps=case["steps"],
        temperature=0.0,
        mask_token_id=vec_rt.mask_token_id,
        eos_token_id=None,
    )
    res = generate(RuntimeBackend(vec_rt), case["prompt"], cfg)
    assert res.tokens == case["tokens"]


# ----------------------------------------------------------------------------- vs PyTorch reference


@pytest.mark.parametrize("hist", [0, 3, 8, 13, 16, 19, 40])
def test_block_logits_vs_reference(vec_rt, vec_ref, hist):
    """Clean and half-masked blocks after a history of `hist` tokens (blocks of 8)."""
    c = vec_ref.config
    rng = random.Random(hist)
    prompt = [rng.randrange(c.vocab_size - 3) for _ in range(hist)]
    vec_rt.reset()
    vec_rt.commit(prompt, 8)
    state = vec_ref.prefill(torch.tensor([prompt]), 8) if hist else vec_ref.init_state(1)
    assert_states_close(ref_states(state), vec_rt, f"state after {hist} tokens")
    for L in (8, 5, 1):
        clean = [rng.randrange(c.vocab_size - 3) for _ in range(L)]
        noisy = [c.mask_token_id if rng.random() < 0.5 else t for t in clean]
        for blk, what in ((clean, "clean"), (noisy, "masked")):
            ref = vec_ref.block_logits(torch.tensor([blk]), hist, state)[0]
            assert_logits_close(ref, vec_rt.block_logits(blk), f"hist {hist}, L {L}, {what}")


def test_commits_vs_reference(vec_rt, vec_ref):
    """Denoise / commit interleaved over several blocks, as generation does."""
    rng = random.Random(7)
    V = vec_ref.config.vocab_size
    vec_rt.reset()
    state, pos = vec_ref.init_state(1), 0
    for L in (8, 8, 3, 8, 6, 8):
        blk = [rng.randrange(V - 3) for _ in range(L)]
        ref = vec_ref.block_logits(torch.tensor([blk]), pos, state)[0]
        assert_logits_close(ref, vec_rt.block_logits(blk), f"block at {pos}")
        vec_rt.commit(blk, L)
        _, state = vec_ref.commit(torch.tensor([blk]), pos, state)
        pos += L
        assert_states_close(ref_states(state), vec_rt, f"state after commit at {pos}")


def test_greedy_generation_vs_reference(vec_rt, vec_ref):
    rng = random.Random(3)
    V = vec_ref.config.vocab_size
    for prompt_len, B, steps in ((5, 8, 4), (21, 8, 8), (16, 4, 2)):
        prompt = [rng.randrange(V - 3) for _ in range(prompt_len)]
        cfg = GenerationConfig(
            max_new_tokens=20,
            block_size=B,
            steps=steps,
            temperature=0.0,
            mask_token_id=vec_ref.config.mask_token_id,
            eos_token_id=vec_ref.config.eos_token_id,
        )  # the runtime stops at EOS
        ref = generate(TorchBackend(vec_ref, "blockwise"), prompt, cfg)
        got = vec_rt.generate(prompt, cfg)
        assert got.tokens == ref.tokens, f"prompt {prompt_len}, B {B}, steps {steps}"
        assert [b.tokens_per_step for b in got.blocks] == [b.tokens_per_step for b in ref.blocks]


def test_parallel_prefill_equals_blockwise(vec_rt):
    """One clover_commit of 5 blocks (several blocks per graph: n_ubatch = 32) vs 5 commits."""
    rng = random.Random(11)
    prompt = [rng.randrange(90) for _ in range(37)]
    vec_rt.reset()
    vec_rt.commit(prompt, 8)
    par = [vec_rt.state(i) for i in range(vec_rt.n_layer)]
    vec_rt.reset()
    for s in range(0, len(prompt), 8):
        vec_rt.commit(prompt[s : s + 8], 8)
    blk = [vec_rt.state(i) for i in range(vec_rt.n_layer)]
    worst = max(float(np.abs(a - b).max()) for a, b in zip(par, blk))
    assert worst < 1e-5, f"parallel vs block-by-block prefill: state max|diff| {worst:.2e}"


def test_denoise_leaves_state_unchanged(vec_rt):
    vec_rt.reset()
    vec_rt.commit(list(range(10, 29)), 8)
    before = [vec_rt.state(i).copy() for i in range(vec_rt.n_layer)]
    for blk in ([96] * 8, [5, 96, 7, 96, 9, 96, 11, 96], [1, 2, 3]):
        vec_rt.block_logits(blk)
    after = [vec_rt.state(i) for i in range(vec_rt.n_layer)]
    for a, b in zip(before, after):
        assert a.tobytes() == b.tobytes(), "a denoising step changed the memory state"


def test_reset_clears_state(vec_rt, vec_ref):
    """After commit A, reset, commit B the memory is B's alone (a reset that kept A's state
    would fold B into it)."""
    a, b = list(range(20, 36)), list(range(40, 51))
    vec_rt.reset()
    vec_rt.commit(a, 8)
    assert np.abs(vec_rt.state(0)).max() > 0
    vec_rt.reset()
    assert vec_rt.n_committed == 0
    vec_rt.commit(b, 8)
    assert vec_rt.n_committed == len(b)
    assert_states_close(ref_states(vec_ref.prefill(torch.tensor([b]), 8)), vec_rt, "state of B after a reset")


def test_graph_reuse_is_bit_identical(vec_gguf, monkeypatch):
    """Steps of the same shape reuse the graph: their logits equal a freshly built graph's bit
    for bit (LLAMA_GRAPH_REUSE_DISABLE=1 rebuilds every time)."""
    from clover_gguf.runtime.runtime import CloverRuntime

    prompt, blocks = list(range(5, 24)), ([96] * 8, [5, 96, 7, 96, 9, 96, 11, 96], [96] * 8, [3, 96, 96, 4, 5, 6, 7, 8])
    out = {}
    for reuse in (True, False):
        if not reuse:
            monkeypatch.setenv("LLAMA_GRAPH_REUSE_DISABLE", "1")
        with CloverRuntime(vec_gguf, n_threads=1, n_ubatch=32) as rt:
            rt.commit(prompt, 8)
            out[reuse] = [rt.block_logits(b).numpy() for b in blocks]
            # the same block twice in a row: the second step reuses the first one's graph
            out[reuse].append(rt.block_logits(blocks[0]).numpy())
    for a, b in zip(out[True], out[False]):
        assert a.tobytes() == b.tobytes()
    assert out[True][-1].tobytes() == out[True][0].tobytes()


@pytest.mark.parametrize("temperature", [0.0, 0.8, 1.7])
def test_device_candidates_equal_host_path(vec_rt, temperature):
    """The in-graph candidate/confidence (ggml_gumbel_argmax) equals the host computation on
    the same logits (reference/sampling.py): same tokens, confidences within 1e-5."""
    from clover_gguf.reference.sampling import candidates, row_key, step_key

    rng = random.Random(5)
    vec_rt.reset()
    vec_rt.commit([rng.randrange(90) for _ in range(13)], 8)
    pos0 = vec_rt.n_committed
    for trial in range(6):
        blk = [96 if rng.random() < 0.6 else rng.randrange(90) for _ in range(8)]
        blk[trial % 8] = 96
        masked = [i for i, t in enumerate(blk) if t == 96]
        skey = step_key(1234 + trial, trial, 2)
        tok, conf = vec_rt.block_candidates(blk, temperature, skey)
        want_tok, want_conf = candidates(
            vec_rt.block_logits(blk)[masked],
            [row_key(skey, pos0 + i) for i in masked],
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            mask_token_id=vec_rt.mask_token_id,
        )
        assert tok[masked].tolist() == want_tok.tolist()
        assert np.abs(conf[masked] - want_conf.numpy()).max() < 1e-5
        assert all(t == -1 for i, t in enumerate(tok) if i not in masked)


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=0.8), dict(temperature=1.3, top_k=5), dict(temperature=0.9, top_p=0.7)],
    ids=["device", "top-k", "top-p"],
)
def test_sampled_generation_vs_reference(vec_rt, vec_ref, sampling):
    """A seed gives the same sampled tokens in the runtime (device path, or host path with
    top-k/top-p) and in the PyTorch reference, with the steps and the threshold schedule."""
    rng = random.Random(9)
    V = vec_ref.config.vocab_size
    prompt = [rng.randrange(V - 3) for _ in range(11)]
    for sched in (dict(steps=4), dict(threshold=0.2)):
        cfg = GenerationConfig(
            max_new_tokens=24,
            block_size=8,
            seed=5,
            mask_token_id=vec_ref.config.mask_token_id,
            eos_token_id=vec_ref.config.eos_token_id,
            **sched,
            **sampling,
        )
        want = generate(TorchBackend(vec_ref, "blockwise"), prompt, cfg)
        got = vec_rt.generate(prompt, cfg)
        assert got.tokens == want.tokens, f"{sampling} {sched}"
        assert [b.tokens_per_step for b in got.blocks] == [b.tokens_per_step for b in want.blocks]
        perf = vec_rt.last_perf
        on_device = "top_k" not in sampling and "top_p" not in sampling
        assert perf["n_steps_device"] == (perf["n_steps"] if on_device else 0)
        other = vec_rt.generate(prompt, GenerationConfig(**{**cfg.__dict__, "seed": 6}))
        assert other.tokens != got.tokens, "another seed gave the same sample"


def test_batch_equals_alone(vec_gguf):
    """Sequences decoded together (one graph per step) give the tokens each gives alone."""
    from clover_gguf.runtime.runtime import CloverRuntime

    rng = random.Random(4)
    prompts = [[rng.randrange(90) for _ in range(n)] for n in (5, 16, 11, 0)]
    cfgs = [
        GenerationConfig(max_new_tokens=24, block_size=8, steps=4),
        GenerationConfig(max_new_tokens=16, block_size=8, threshold=0.3),
        GenerationConfig(max_new_tokens=21, block_size=8, steps=3, temperature=0.8, seed=3),
        GenerationConfig(max_new_tokens=8, block_size=8, temperature=1.1, top_k=4, seed=1),
    ]
    with CloverRuntime(vec_gguf, n_threads=1, n_seq_max=4, n_ubatch=32) as rt:
        together = rt.generate_batch(prompts, cfgs)
        perf = rt.last_perf
        alone = [rt.generate(p, c).tokens for p, c in zip(prompts, cfgs)]
    assert [r.tokens for r in together] == alone
    assert all(len(r.tokens) > 0 for r in together)
    # 3 blocks for the longest sequence: about 3 x 4 steps, far fewer than one step per sequence
    assert perf["n_steps"] < sum(b.steps for r in together for b in r.blocks)


def test_pick_samplers_stay_attached_across_generations(vec_gguf):
    """Each sampler attachment re-reserves the context, so a sequence's pick sampler is attached
    once and lent to every later batch (clover_batch_set_pick): the same sampler after three
    generations and a block_candidates call; a host-path generation (top probabilities) takes it
    off, and the tokens are the same either way."""
    from clover_gguf.runtime.runtime import CloverRuntime

    prompt = [3, 14, 15, 92, 65]
    greedy = GenerationConfig(max_new_tokens=16, block_size=8, threshold=0.5)
    with CloverRuntime(vec_gguf, n_threads=1, n_seq_max=2, n_ubatch=32) as rt:
        first = rt.generate(prompt, greedy).tokens
        smpl = rt._picks[0][1]
        rt.block_candidates([rt.mask_token_id] * 8, 0.0, 7)
        again = [rt.generate(prompt, greedy).tokens for _ in range(2)]
        assert rt._picks[0][1] == smpl
        hot = rt.generate(prompt, GenerationConfig(max_new_tokens=16, block_size=8, threshold=0.5, temperature=0.7))
        assert rt._picks[0][0] == pytest.approx(0.7) and rt._picks[0][1] != smpl
        probs = rt.generate(prompt, GenerationConfig(max_new_tokens=16, block_size=8, threshold=0.5, n_probs=2))
        assert 0 not in rt._picks
    assert again == [first, first] and probs.tokens == first and len(hot.tokens) > 0


def test_lent_pick_must_match_the_sequence(vec_gguf):
    """clover_batch_set_pick refuses a sampler the sequence would not use: a host-path sequence
    (top-k at a temperature > 0) or another temperature; clover_batch_on_host says which
    sequences are on the host path."""
    from clover_gguf.runtime import bindings as B
    from clover_gguf.runtime.runtime import CloverRuntime

    with CloverRuntime(vec_gguf, n_threads=1, n_seq_max=2, n_ubatch=32) as rt:
        lib = rt._lib
        batch = lib.clover_batch_init(rt.ctx)
        try:
            prompt = B.token_ptr([1, 2, 3])
            topk = GenerationConfig(max_new_tokens=8, block_size=8, temperature=0.7, top_k=4)
            assert lib.clover_batch_add(batch, 0, prompt, 3, rt.gen_params(topk), False) == 0
            assert lib.clover_batch_set_pick(batch, 0, rt._pick(0, 0.7)) == B.CLOVER_ERR_ARG
            plain = GenerationConfig(max_new_tokens=8, block_size=8, temperature=0.7)
            assert lib.clover_batch_add(batch, 1, prompt, 3, rt.gen_params(plain), False) == 0
            assert lib.clover_batch_set_pick(batch, 1, rt._pick(1, 0.5)) == B.CLOVER_ERR_ARG
            assert lib.clover_batch_set_pick(batch, 1, rt._pick(1, 0.7)) == 0
            assert [lib.clover_batch_on_host(batch, s) for s in (0, 1)] == [1, 0]
            assert lib.clover_batch_on_host(batch, 2) == B.CLOVER_ERR_ARG  # not active
        finally:
            lib.clover_batch_free(batch)


def test_batch_mixes_block_lengths(vec_gguf):
    """Greedy sequences whose current blocks differ in length (a short last block, another block
    size) in the same steps: each block stays whole in its graph, so each sequence gives the tokens
    it gives alone; on_finish reports each sequence once, with its result, as it ends."""
    from clover_gguf.runtime.runtime import CloverRuntime

    rng = random.Random(6)
    prompts = [[rng.randrange(90) for _ in range(n)] for n in (7, 12, 3, 9)]
    cfgs = [
        GenerationConfig(max_new_tokens=24, block_size=8, steps=4),
        GenerationConfig(max_new_tokens=13, block_size=8, steps=4),  # last block of 5
        GenerationConfig(max_new_tokens=18, block_size=6, threshold=0.3),
        GenerationConfig(max_new_tokens=0, block_size=8),  # nothing to generate
    ]
    finished = []
    with CloverRuntime(vec_gguf, n_threads=1, n_seq_max=4, n_ubatch=32) as rt:
        together = rt.generate_batch(prompts, cfgs, on_finish=lambda i, r: finished.append((i, r.tokens)))
        alone = [rt.generate(p, c).tokens for p, c in zip(prompts, cfgs)]
    assert [r.tokens for r in together] == alone
    assert alone[3] == [] and all(alone[:3])
    assert sorted(i for i, _ in finished) == [0, 1, 2, 3]
    assert dict(finished) == {i: r.tokens for i, r in enumerate(together)}
    assert finished[0][0] == 3  # ended before the first step


def test_batch_refill_joins_between_steps(vec_gguf):
    """A sequence started between steps on the sequence of one that ended (continuous batching)
    gives the tokens it gives alone; so do the others."""
    from clover_gguf.runtime.runtime import CloverRuntime

    rng = random.Random(7)
    prompts = [[rng.randrange(90) for _ in range(n)] for n in (5, 9, 6)]
    cfgs = [GenerationConfig(max_new_tokens=m, block_size=8, steps=4) for m in (8, 24, 16)]
    waiting, seen, ends = [2], [], []

    def refill(free):
        seen.append(list(free))
        if waiting and 0 in free:
            rt.reset(0)  # the ended sequence's memory: cleared, as the server restores or clears it
            return [(0, prompts[waiting.pop()], cfgs[2])]
        return []

    with CloverRuntime(vec_gguf, n_threads=1, n_seq_max=3, n_ubatch=32) as rt:
        res = rt.generate_batch(prompts[:2], cfgs[:2], refill=refill, on_finish=lambda i, r: ends.append((i, r.tokens)))
        alone = [rt.generate(p, c).tokens for p, c in zip(prompts, cfgs)]
    assert [r.tokens for r in res] == alone[:2]
    assert seen[0] == [2] and not waiting  # joined only once sequence 0 was free
    assert ends == [(0, alone[0]), (1, alone[1]), (0, alone[2])] or ends == [
        (0, alone[0]),
        (0, alone[2]),
        (1, alone[1]),
    ]


def test_batch_after_step_stops_a_sequence_mid_block(vec_gguf):
    """after_step runs once per sequence per denoising step; False stops that sequence at once,
    inside its block: it keeps the tokens of its finished blocks, and the other one is unchanged."""
    from clover_gguf.runtime.runtime import CloverRuntime

    rng = random.Random(9)
    prompts = [[rng.randrange(90) for _ in range(n)] for n in (6, 10)]
    cfgs = [GenerationConfig(max_new_tokens=24, block_size=8, steps=8) for _ in prompts]
    steps = {0: 0, 1: 0}

    def after_step(i):
        steps[i] += 1
        return not (i == 0 and steps[0] == 11)  # sequence 0: stop 3 steps into its second block

    with CloverRuntime(vec_gguf, n_threads=1, n_seq_max=2, n_ubatch=32) as rt:
        res = rt.generate_batch(prompts, cfgs, after_step=after_step)
        alone = [rt.generate(p, c).tokens for p, c in zip(prompts, cfgs)]
    assert steps == {0: 11, 1: sum(b.steps for b in res[1].blocks)} and steps[1] == 24
    assert [b.steps for b in res[0].blocks] == [8] and res[0].tokens == alone[0][:8]
    assert res[1].tokens == alone[1]


def test_sequences_commit_and_snapshot_like_sequence_0(vec_gguf):
    """commit / save_state / load_state / reset on sequence k act on k only, and a snapshot of
    one sequence restores into another bit for bit (the server restores snapshots anywhere)."""
    from clover_gguf.runtime.runtime import CloverRuntime

    rng = random.Random(8)
    toks = [rng.randrange(90) for _ in range(16)]  # full blocks: a restored run continues a fresh one
    mem = lambda blob: blob[8:]  # noqa: E731 - llama.cpp's 8-byte header names the sequence saved
    with CloverRuntime(vec_gguf, n_threads=1, n_seq_max=3, n_ubatch=32) as rt:
        rt.reset()
        rt.commit(toks, 8)
        want = rt.save_state()
        rt.reset()
        rt.commit(toks[:8], 8, seq=2)
        rt.commit(toks[8:], 8, seq=2)
        assert mem(rt.save_state(2)) == mem(want)
        assert rt.n_committed == 0  # sequence 0 untouched
        rt.load_state(want, 1)
        assert mem(rt.save_state(1)) == mem(want)
        rt.reset(2)
        assert mem(rt.save_state(2)) != mem(want) and mem(rt.save_state(1)) == mem(want)
        cfg = GenerationConfig(max_new_tokens=16, block_size=8, steps=4)
        fresh = rt.generate(toks + [5, 6], cfg).tokens
        rt.reset()
        rt.load_state(want, 1)
        got = rt.generate_batch([[], [5, 6]], [GenerationConfig(max_new_tokens=0, block_size=8), cfg], reset=False)
        assert got[1].tokens == fresh
        with pytest.raises(ValueError, match="sequence 3 outside"):
            rt.save_state(3)


# ----------------------------------------------------------------------------- clover-tiny


def _tiny_present():
    return (TINY / "config.json").exists() and any(TINY.glob("*.safetensors"))


@pytest.fixture(scope="session")
def tiny_f32(lib, tmp_path_factory):
    assert _tiny_present(), f"{TINY} has no trained checkpoint"
    return convert_f32(TINY, tmp_path_factory.mktemp("tiny") / "clover-tiny-f32.gguf")


@pytest.fixture(scope="session")
def tiny(tiny_f32):
    from clover_gguf.reference.model import CloverModel
    from clover_gguf.runtime.runtime import CloverRuntime

    gguf = tiny_f32
    ref = CloverModel.from_pretrained(TINY, dtype=torch.float32).eval()
    rt = CloverRuntime(gguf, n_threads=2, n_ubatch=128, n_batch=128)
    yield rt, ref
    rt.close()


def test_tiny_parity(tiny):
    rt, ref = tiny
    B = ref.config.block_size
    prompt = rt.tokenize('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n')
    rt.reset()
    rt.commit(prompt, B)
    state = ref.prefill(torch.tensor([prompt]), B)
    assert_states_close(ref_states(state), rt, "clover-tiny state after the prompt")
    blk = [ref.config.mask_token_id] * B
    assert_logits_close(
        ref.block_logits(torch.tensor([blk]), len(prompt), state)[0], rt.block_logits(blk), "clover-tiny masked block"
    )
    cfg = GenerationConfig(
        max_new_tokens=2 * B,
        block_size=B,
        steps=B // 2,
        temperature=0.0,
        mask_token_id=ref.config.mask_token_id,
        eos_token_id=rt.eos_token_id,
    )
    want = generate(TorchBackend(ref, "blockwise"), prompt, cfg).tokens
    assert rt.generate(prompt, cfg).tokens == want


@pytest.mark.parametrize("outtype", ["f32", "bf16"])
def test_loader_backends_agree(tiny_f32, converted, outtype):
    """generation/loader.py's one interface: clover-tiny's folder (PyTorch reference) and its F32
    and BF16 GGUFs (llama.cpp; the checkpoint is BF16, so all three hold the same weights) give
    the same facts, prompt ids (BOS/EOS rule included), chat prompt and config. F32: the same
    logits and greedy tokens and text. BF16: ggml's BF16 matmul rounds the activations to BF16
    too, so its logits are close (mean KL 3.3e-3 nats measured on this block), not equal, and
    greedy decoding parts from the reference's at the second token (as `clover-gguf run` does)."""
    from clover_gguf.generation.loader import RuntimeGenerator, TorchGenerator, load

    gguf = tiny_f32 if outtype == "f32" else converted(TINY, "bf16")
    ref, rt = load(TINY, threads=2), load(gguf, threads=2)
    try:
        assert isinstance(ref, TorchGenerator) and isinstance(rt, RuntimeGenerator)
        assert (ref.backend, rt.backend) == ("pytorch-float32", "llama.cpp")
        facts = ("n_vocab", "n_ctx", "block_size", "mask_token_id", "eos_token_id", "placement")
        assert {k: getattr(ref, k) for k in facts} == {k: getattr(rt, k) for k in facts}
        msgs = [{"role": "user", "content": "Sort a list."}]
        for think in (False, True):
            assert ref.chat_prompt(msgs, enable_thinking=think) == rt.chat_prompt(msgs, enable_thinking=think)
        text = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
        ids = ref.tokenize(text, add_special=True)
        assert ids == rt.tokenize(text, add_special=True) and ref.token_id("<|im_end|>") == rt.token_id("<|im_end|>")
        B = ref.block_size
        cfg = ref.config(max_new_tokens=3 * B, steps=B // 2)
        assert cfg == rt.config(max_new_tokens=3 * B, steps=B // 2) and cfg.block_size == B
        ra, rb = ref.logits_backend(), rt.logits_backend()
        ra.prefill(ids, B)
        rb.prefill(ids, B)
        blk = [ref.mask_token_id] * B
        la, lb = ra.block_logits(blk), rb.block_logits(blk)
        if outtype == "bf16":
            kl = kl_rows(la, torch.as_tensor(lb).float()).mean().item()
            assert kl < 2e-2, f"BF16 GGUF: mean KL {kl:.2e} on the first masked block"
            return
        assert_logits_close(la, lb, "loader: clover-tiny's first masked block")
        a, b = ref.generate(ids, cfg), rt.generate(ids, cfg)
        assert len(a.tokens) > 0 and a.tokens == b.tokens
        assert ref.detokenize(a.tokens) == rt.detokenize(b.tokens)
    finally:
        rt.close()


# ----------------------------------------------------------------------------- tokenizer, template, overrides
# clover-tiny shapes (2 layers, random weights) with the project's BPE tokenizer: the GGUF
# vocabulary, chat template and expert buffer overrides, and parity at D = 64.


@pytest.fixture(scope="session")
def tok_model(lib, tmp_path_factory):
    import shutil

    from clover_gguf.config import preset
    from clover_gguf.synthetic import write_synthetic
    from clover_gguf.tokenizer import CloverTokenizer

    assert (TINY / "tokenizer.json").exists(), f"no tokenizer in {TINY}"
    tok = CloverTokenizer.from_dir(TINY)
    d = tmp_path_factory.mktemp("tiny-shapes")
    cfg = preset(
        "clover-tiny",
        vocab_size=max(tok.vocab_size, 256),
        mask_token_id=tok.mask_id,
        bos_token_id=tok.bos_id if tok.bos_id is not None else tok.eos_id,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id if tok.pad_id is not None else tok.eos_id,
    )
    write_synthetic(d / "hf", cfg, layers=2, progress=False)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / f, d / "hf" / f)
    gguf = convert_f32(d / "hf", d / "tiny-shapes-f32.gguf")
    return d / "hf", gguf, tok


def test_tokenizer_matches_reference(tok_model):
    from clover_gguf.runtime.runtime import CloverRuntime

    _, gguf, tok = tok_model
    with CloverRuntime(gguf, n_threads=1) as rt:
        for text in (
            "def f(x):\n    return x + 1\n",
            "import os, sys  # héllo\n\tpass",
            "<|im_start|>user\nhi<|im_end|>\n",
            "   spaces   and\n\n\nnewlines",
        ):
            ids = rt.tokenize(text)
            assert ids == tok.encode(text), repr(text)
            assert rt.detokenize(ids) == tok.decode(ids), repr(text)


def test_chat_prompt_matches_reference(tok_model):
    from clover_gguf.runtime.runtime import CloverRuntime

    _, gguf, tok = tok_model
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
    with CloverRuntime(gguf, n_threads=1) as rt:
        assert rt.chat_template == tok.chat_template
        for think in (False, True):
            assert rt.chat_prompt(msgs, enable_thinking=think) == tok.apply_chat_template(msgs, enable_thinking=think)


def test_tiny_shapes_parity_and_experts_on_cpu(tok_model):
    """Parity with and without experts_on_cpu. On a CPU build every tensor is in CPU memory
    either way, so what experts_on_cpu changes there is checked from llama.cpp's loader: its
    override places exactly the routed experts, in a CPU buffer type."""
    from clover_gguf.constants import GGUF_EXPERT_NAME
    from clover_gguf.reference.model import CloverModel
    from clover_gguf.runtime.runtime import CloverRuntime

    hf, gguf, tok = tok_model
    ref = CloverModel.from_pretrained(hf, dtype=torch.float32).eval()
    B = ref.config.block_size
    prompt = tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
    state = ref.prefill(torch.tensor([prompt]), B)
    blk = [ref.config.mask_token_id] * B
    want = ref.block_logits(torch.tensor([blk]), len(prompt), state)[0]
    for eoc in (False, True):
        with CloverRuntime(gguf, n_threads=2, experts_on_cpu=eoc, n_ubatch=4 * B) as rt:
            experts = {GGUF_EXPERT_NAME[p].format(bid=i) for i in range(rt.n_layer) for p in ("gate", "up", "down")}
            assert set(rt.buffer_overrides) == (experts if eoc else set()), rt.buffer_overrides
            assert all(b.startswith("CPU") for b in rt.buffer_overrides.values()), rt.buffer_overrides
            rt.reset()
            rt.commit(prompt, B)
            assert_states_close(ref_states(state), rt, f"tiny shapes, experts_on_cpu={eoc}")
            assert_logits_close(want, rt.block_logits(blk), f"tiny shapes, experts_on_cpu={eoc}")
            cfg = GenerationConfig(
                max_new_tokens=2 * B,
                block_size=B,
                steps=B // 4,
                temperature=0.0,
                mask_token_id=ref.config.mask_token_id,
                eos_token_id=rt.eos_token_id,
            )
            assert rt.generate(prompt, cfg).tokens == generate(TorchBackend(ref, "blockwise"), prompt, cfg).tokens


# ----------------------------------------------------------------------------- native test programs


def _bin(name):
    from clover_gguf.runtime.build import runtime_paths

    p = runtime_paths()["bin_dir"] / name
    if not p.exists():
        pytest.fail(f"{p} missing: build the runtime with `clover-gguf runtime build`", pytrace=False)
    return p


def test_native_test_clover(vec_gguf, vec_dir):
    import subprocess

    r = subprocess.run(
        [str(_bin("test-clover")), str(vec_gguf), str(vec_dir.parent / "vectors.json")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0 and "ALL OK" in r.stdout, (r.stdout + r.stderr)[-3000:]


def test_native_backend_ops_gated_delta_net(lib):
    import subprocess

    r = subprocess.run(
        [str(_bin("test-backend-ops")), "test", "-b", "CPU", "-o", "GATED_DELTA_NET"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
