"""Block-diffusion training (clover_gguf/train/trainer.py): batch layout, the NELBO, a few steps."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch
import torch.nn.functional as F

from clover_gguf.config import preset
from clover_gguf.reference.model import CloverModel
from clover_gguf.train import trainer as T
from clover_gguf.train.distill import distill_stream


def tiny_config(**kw):
    d = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        block_size=4,
    )
    d.update(kw)
    return preset("clover-tiny", **d)


def test_layout_random_offset():
    stream = torch.arange(100, 200)
    clean, pos, valid = T.layout_windows(stream, torch.tensor([10, 50]), torch.tensor([3, 4]), nb=3, B=4, pad_id=0)
    # sequence 0: block 0 = 3 tokens + 1 pad, then contiguous blocks of 4
    assert clean[0].tolist() == [[110, 111, 112, 0], [113, 114, 115, 116], [117, 118, 119, 120]]
    assert valid[0].tolist() == [[True, True, True, False], [True] * 4, [True] * 4]
    assert pos[0, 1:].flatten().tolist() == list(range(3, 11))
    assert pos[0, 0, :3].tolist() == [0, 1, 2]
    # sequence 1: r = B, no padding
    assert clean[1].flatten().tolist() == list(range(150, 162))
    assert valid[1].all()


def test_sample_batch_masks_only_valid_and_t_range():
    g = torch.Generator().manual_seed(0)
    stream = torch.randint(2, 64, (5000,))
    b = T.sample_batch(stream, 8, 4, 5, g, mask_id=1, pad_id=0, eps=1e-3)
    assert b.t.shape == (8, 5) and (b.t > 1e-3).all() and (b.t <= 1).all()
    assert not (b.masked & ~b.valid).any()
    assert (b.noisy[b.masked] == 1).all() and (b.noisy[~b.masked] == b.clean[~b.masked]).all()
    assert ((b.clean == 0) == ~b.valid).all()  # stream has no 0s: pads are exactly the invalid slots
    # each sequence holds r + (nb-1)B real tokens, r in [1, B]
    n = b.valid.sum((1, 2))
    assert ((n >= 1 + 16) & (n <= 4 + 16)).all()


def test_nelbo_is_weighted_masked_ce_hand_case():
    """Two sequences, 2 blocks of 2 slots, V = 3: check the loss against a hand computation."""
    clean = torch.tensor([[[2, 0], [1, 2]], [[0, 1], [2, 2]]])
    valid = torch.tensor([[[True, False], [True, True]], [[True, True], [True, True]]])
    masked = torch.tensor([[[True, False], [False, True]], [[True, True], [False, False]]])
    t = torch.tensor([[0.5, 0.25], [1.0, 0.8]])
    b = T.Batch(clean=clean, noisy=clean, pos=torch.zeros_like(clean), valid=valid, masked=masked, t=t)
    # logits at the 4 masked positions, in row-major order of `masked`
    logits = torch.tensor(
        [
            [0.0, 0.0, 0.0],  # seq0 blk0 slot0, target 2, t=0.5
            [1.0, 0.0, 2.0],  # seq0 blk1 slot1, target 2, t=0.25
            [0.0, math.log(3), 0.0],  # seq1 blk0 slot0, target 0, t=1
            [0.0, 0.0, 5.0],
        ]
    )  # seq1 blk0 slot1, target 1, t=1
    ce = [
        math.log(3),
        -(2.0 - math.log(math.exp(1) + 1 + math.exp(2))),
        -(0.0 - math.log(1 + 3 + 1)),
        -(0.0 - math.log(2 + math.exp(5))),
    ]
    want = (ce[0] / 0.5 + ce[1] / 0.25 + ce[2] / 1.0 + ce[3] / 1.0) / 7  # 7 real tokens
    loss, ce_got, ent = T.nelbo_from_logits(logits, b)
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert ce_got.tolist() == pytest.approx(ce, rel=1e-6)
    # certainty forcing: + weight * entropy of the rows whose argmax is the target (row 1 only:
    # row 0's argmax is a tie resolved to 0, row 2's is 1, row 3's is 2), over the 7 real tokens
    H = lambda r: -sum(p * math.log(p) for p in torch.softmax(torch.tensor(r), 0).tolist())  # noqa: E731
    assert ent.tolist() == pytest.approx([H(r) for r in logits.tolist()], rel=1e-6)
    forced, _, _ = T.nelbo_from_logits(logits, b, certainty=0.5)
    assert forced.item() == pytest.approx(want + 0.5 * H(logits[1].tolist()) / 7, rel=1e-6)


def test_certainty_term_sharpens_right_rows_only():
    """A gradient step on the certainty term alone raises the top probability of a row whose
    argmax is right and leaves a wrong row's logits untouched."""
    b = types.SimpleNamespace(
        clean=torch.tensor([[[0, 1]]]), masked=torch.tensor([[[True, True]]]), t=torch.tensor([[1.0]]), n_scored=2
    )
    logits = torch.tensor([[2.0, 1.0, 1.0], [2.0, 1.0, 1.0]], requires_grad=True)  # right, wrong
    full, _, _ = T.nelbo_from_logits(logits, b, certainty=1.0)
    plain, _, _ = T.nelbo_from_logits(logits, b)
    (full - plain).backward()
    with torch.no_grad():
        after = logits - 1.0 * logits.grad
    assert torch.softmax(after[0], 0)[0] > torch.softmax(logits[0], 0)[0]
    assert logits.grad[1].abs().max() == 0


def test_diffusion_loss_matches_full_logits():
    """diffusion_loss (select=masked) equals the 1/t-weighted CE read off the full logits."""
    torch.manual_seed(0)
    c = tiny_config()
    m = T.new_model(c, 0)
    g = torch.Generator().manual_seed(1)
    b = T.sample_batch(torch.randint(2, 64, (500,)), 3, 4, 4, g, mask_id=1, pad_id=0)
    loss, _ = T.diffusion_loss(m, b)
    with torch.no_grad():
        full = m.forward_train(b.clean, b.noisy, b.pos, b.valid)  # [N, nb, B, V]
    tot = 0.0
    for n, k, j in b.masked.nonzero().tolist():
        tot += F.cross_entropy(full[n, k, j][None], b.clean[n, k, j][None]).item() / b.t[n, k].item()
    assert loss.item() == pytest.approx(tot / int(b.valid.sum()), rel=1e-4)


def test_init_weights():
    c = tiny_config()
    m = T.new_model(c, 0)
    for layer in m.layers:
        mem = layer.self_attn.memory
        assert ((mem.A_log >= 0) & (mem.A_log <= math.log(16) + 1e-6)).all()
        dt = F.softplus(mem.dt_bias)
        assert ((dt > 0.9e-3) & (dt < 0.11)).all()
        assert (layer.input_layernorm.weight == 1).all() and (mem.calibration == 1).all()
        assert 0.01 < layer.mlp.experts.gate_up_proj.std().item() < 0.03
    assert all(torch.isfinite(p).all() for p in m.parameters())
    m2 = T.new_model(c, 0)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters()))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_few_steps_decrease_loss_on_fixed_batch(precision):
    c = tiny_config()
    m = T.new_model(c, 0)
    tc = T.TrainConfig(lr=3e-3, warmup_steps=1, precision=precision, grad_clip=1.0)
    ms = T.MasterWeights(m) if precision == "bf16" else None
    opt = T.make_optimizer(m, tc, ms)
    g = torch.Generator().manual_seed(0)
    b = T.sample_batch(torch.randint(2, 64, (2000,)), 8, 4, 6, g, mask_id=1, pad_id=0)
    with torch.no_grad():
        before = T.diffusion_loss(m, b)[0].item()
    for _ in range(15):
        st = T.train_step(m, opt, b, tc, tc.lr, ms)
        assert math.isfinite(st["loss"])
    with torch.no_grad():
        after = T.diffusion_loss(m, b)[0].item()
    assert after < before - 0.3, (before, after)
    if ms is not None:  # the model holds the bf16-rounded master weights
        assert all(torch.equal(p, q.to(torch.bfloat16)) for p, q in zip(ms.params, ms.master))


def small_tc(**kw) -> T.TrainConfig:
    """A few steps of tiny batches, one thread."""
    d = dict(threads=1, tokens_per_batch=64, seq_tokens=8, block_sizes=(4, 8), block_probs=(0.5, 0.5))
    return T.TrainConfig(**{**d, **kw})


def test_train_loop_checkpoint_and_save(tmp_path):
    c = tiny_config()
    m = T.new_model(c, 0)
    tc = small_tc(max_steps=4, warmup_steps=1, ckpt_dir=str(tmp_path / "ck"), log_every=2)
    log = T.train(m, torch.randint(2, 64, (3000,)), tc, log_fn=lambda s: None)
    assert log["step"] == 4 and log["tokens"] > 0 and len(log["steps"]) == 4
    assert (tmp_path / "ck" / "ckpt-last.pt").is_file()
    assert m.lm_head.weight.dtype == torch.float32
    T.save_hf(m, tmp_path / "model")
    m2 = CloverModel.from_pretrained(tmp_path / "model")
    assert torch.equal(m2.lm_head.weight, m.lm_head.weight.to(torch.bfloat16).float())
    # resume continues the step count
    tc2 = T.TrainConfig(**{**tc.__dict__, "max_steps": 6})
    log2 = T.train(
        T.new_model(c, 1),
        torch.randint(2, 64, (3000,)),
        tc2,
        log_fn=lambda s: None,
        resume=tmp_path / "ck" / "ckpt-last.pt",
    )
    assert log2["step"] == 6


def test_evaluate_heldout_bits():
    c = tiny_config()
    m = T.new_model(c, 0)
    ids = torch.randint(2, 64, (203,))
    ev = T.evaluate_heldout(m, ids, block_size=4, mask_ratio=0.5, seq_blocks=8, batch_size=4, seed=0)
    # 203 tokens in blocks of 4 -> 50 full blocks (2 masked each) + one block of 3 (2 masked)
    assert ev["n_masked"] == 50 * 2 + 2 and ev["n_tokens"] == 203
    # an untrained model is close to uniform over V = 64 (6 bits)
    assert 5.5 < ev["bits_per_token"] < 6.5
    ev2 = T.evaluate_heldout(m, ids, block_size=4, mask_ratio=0.5, seq_blocks=8, batch_size=4, seed=0)
    assert ev2["bits_per_token"] == ev["bits_per_token"]


def test_stopped_and_resumed_run_equals_one_run(tmp_path):
    """should_stop ends a run with a checkpoint; resuming it gives the very weights of one
    uninterrupted run (optimizer state, RNG / data position and schedule all restored)."""
    c = tiny_config()
    stream = torch.randint(2, 64, (3000,))

    def tc(d):
        return small_tc(max_steps=6, warmup_steps=2, ckpt_dir=str(tmp_path / d))

    whole = T.new_model(c, 0)
    T.train(whole, stream, tc("a"), log_fn=lambda s: None)
    part = T.new_model(c, 0)
    log = T.train(part, stream, tc("b"), log_fn=lambda s: None, should_stop=lambda step: step >= 3)
    assert log["step"] == 3 and log["finished"] is False
    resumed = T.new_model(c, 7)  # other init: everything must come from the checkpoint
    log = T.train(
        resumed, stream, tc("b"), log_fn=lambda s: None, resume=tmp_path / "b" / "ckpt-last.pt", command="part 2"
    )
    assert log["step"] == 6 and log["finished"] is True
    assert [(r["step"], r["command"]) for r in log["runs"]] == [(0, None), (3, "part 2")]
    for (n, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), n
    other = T.new_model(tiny_config(hidden_size=64), 0)
    with pytest.raises(ValueError, match="another model shape"):
        T.train(other, stream, tc("c"), log_fn=lambda s: None, resume=tmp_path / "b" / "ckpt-last.pt")


def test_warm_restart_from_a_model_folder(tmp_path):
    """--resume on a saved model folder (its checkpoint gone): the saved weights and log go on,
    the step count continues and the LR warms up again for the fresh optimizer."""
    c = tiny_config()
    stream = torch.randint(2, 64, (3000,))
    first = T.new_model(c, 0)
    log = T.train(
        first, stream, small_tc(max_steps=3, warmup_steps=1, ckpt_dir=str(tmp_path / "a")), log_fn=lambda s: None
    )
    T.save_hf(first, tmp_path / "model")
    (tmp_path / "model" / "train_log.json").write_text(json.dumps(log))
    saved = CloverModel.from_pretrained(tmp_path / "model").state_dict()
    warm = T.new_model(c, 7)
    tc = small_tc(max_steps=6, warmup_steps=2, ckpt_dir=str(tmp_path / "b"))
    log = T.train(warm, stream, tc, log_fn=lambda s: None, resume=tmp_path / "model", should_stop=lambda s: s >= 3)
    assert log["step"] == 3 and log["warm_start_step"] == 3  # stopped before any step: the saved weights
    for n, w in warm.state_dict().items():
        assert torch.equal(w, saved[n]), n
    log = T.train(warm, stream, tc, log_fn=lambda s: None, resume=tmp_path / "model", command="part 2")
    assert log["step"] == 6 and [r["step"] for r in log["runs"]] == [0, 3]
    lrs = [s["lr"] for s in log["steps"][3:6]]  # warmup from the restart, to the cosine's value
    cosine = [T.lr_at(k, k / 6, tc) for k in (3, 4, 5)]
    assert lrs == pytest.approx([cosine[0] / 2, *cosine[1:]], rel=1e-3)
    other = T.new_model(tiny_config(hidden_size=64), 0)
    with pytest.raises(ValueError, match="another shape"):
        T.train(other, stream, tc, log_fn=lambda s: None, resume=tmp_path / "model")


def test_max_tokens_budget_ends_the_run(tmp_path):
    m = T.new_model(tiny_config(), 0)
    tc = T.TrainConfig(
        max_tokens=300, warmup_steps=1, threads=1, tokens_per_batch=64, seq_tokens=8, ckpt_dir=str(tmp_path)
    )
    log = T.train(m, torch.randint(2, 64, (3000,)), tc, log_fn=lambda s: None)
    assert log["finished"] and 300 <= log["tokens"] < 300 + 3 * 64


def test_evaluate_heldout_unigram_on_the_same_tokens():
    m = T.new_model(tiny_config(), 0)
    ids = torch.randint(2, 64, (203,))
    logp = torch.log2(torch.softmax(torch.randn(64), 0)).numpy()
    ev = T.evaluate_heldout(m, ids, block_size=4, mask_ratio=0.5, seq_blocks=8, seed=0, unigram_log2p=logp)
    # the masked positions, rebuilt: the fixed seed draws the same scores
    g = torch.Generator().manual_seed(0)
    score = torch.rand((1, 64, 4), generator=g)
    valid = (torch.arange(256) < 203).view(1, 64, 4)
    score = score.masked_fill(~valid, 2.0)
    k = (valid.sum(-1, keepdim=True).float() * 0.5).round().clamp(min=1)
    masked = (score.argsort(-1).argsort(-1) < k) & valid
    padded = torch.zeros(256, dtype=torch.long)
    padded[:203] = ids
    want = -float(torch.as_tensor(logp, dtype=torch.float64)[padded.view(1, 64, 4)[masked]].mean())
    assert ev["unigram_bits_per_token"] == pytest.approx(want, rel=1e-12)


def test_windows_start_at_the_given_start_points():
    stream = torch.arange(1000)
    points = torch.tensor([0, 100, 250, 400, 990])
    g = torch.Generator().manual_seed(0)
    b = T.sample_batch(stream, 64, 4, 5, g, mask_id=1, pad_id=0, start_points=points)
    first = b.clean[:, 0, 0]  # block 0 holds the window's first r tokens
    assert set(first.tolist()) <= {0, 100, 250, 400}  # 990 leaves no room for a window
    assert len(set(first.tolist())) > 1
    # every window is contiguous from its start point
    assert torch.equal(b.clean[:, 1, 0] - first, b.valid[:, 0].sum(-1))
    with pytest.raises(ValueError, match="no start point"):
        T.sample_batch(stream, 2, 4, 5, g, 1, 0, start_points=torch.tensor([995]))


def test_new_run_from_a_model_folder_with_chat_and_exports(tmp_path):
    """init_from starts a run at step 0 from a folder's weights (the parent recorded in the log);
    a chat_ratio share of the batches come from the chat stream; export runs on its clock."""
    c = tiny_config()
    stream = torch.randint(2, 64, (3000,))
    parent = T.new_model(c, 3)
    plog = T.train(parent, stream, small_tc(max_steps=2, ckpt_dir=str(tmp_path / "p")), log_fn=lambda s: None)
    T.save_hf(parent, tmp_path / "parent")
    (tmp_path / "parent" / "train_log.json").write_text(json.dumps(plog))
    saved = CloverModel.from_pretrained(tmp_path / "parent").state_dict()

    chat_ids = torch.randint(2, 64, (2000,))
    chat = (chat_ids, torch.arange(0, 2000, 50))
    tc = small_tc(max_steps=12, chat_ratio=0.5, chat_seq_tokens=16, export_every_min=1e-9, ckpt_dir=str(tmp_path / "c"))
    m = T.new_model(c, 9)
    log = T.train(m, stream, tc, log_fn=lambda s: None, init_from=tmp_path / "parent", should_stop=lambda s: s >= 0)
    assert log["step"] == 0 and log["init_from"]["step"] == 2 and log["init_from"]["path"] == str(tmp_path / "parent")
    for n, w in m.state_dict().items():
        assert torch.equal(w, saved[n]), n

    exports = []
    m = T.new_model(c, 9)
    log = T.train(
        m,
        stream,
        tc,
        log_fn=lambda s: None,
        chat=chat,
        init_from=tmp_path / "parent",
        export=lambda *a: exports.append(1),
    )
    kinds = [r["chat"] for r in log["steps"]]
    assert log["step"] == 12 and 0 < sum(kinds) < 12
    assert len(exports) == 12
    other = T.new_model(tiny_config(hidden_size=64), 0)
    with pytest.raises(ValueError, match="another shape"):
        T.train(other, stream, tc, log_fn=lambda s: None, init_from=tmp_path / "parent")


def test_score_mask_keeps_the_rest_clean_and_unscored(tmp_path):
    stream = torch.randint(2, 64, (400,))
    score = torch.zeros(400, dtype=torch.bool)
    score[100:200] = True
    g = torch.Generator().manual_seed(0)
    b = T.sample_batch(stream, 8, 4, 6, g, 1, 0, start_points=torch.tensor([90, 120]), score_mask=score)
    assert b.scored is not None and b.scored.any() and (~b.scored & b.valid).any()
    assert not (b.masked & ~b.scored).any()  # only scored tokens are noised
    assert torch.equal(b.noisy[~b.scored & b.valid], b.clean[~b.scored & b.valid])
    assert b.n_scored == int(b.scored.sum()) < b.n_tokens
    c = tiny_config()
    loss, st = T.diffusion_loss(T.new_model(c, 0), b)
    assert torch.isfinite(loss) and st["n_masked"] == int(b.masked.sum())
    # a run whose chat stream says which tokens are scored
    chat = (torch.randint(2, 64, (2000,)), torch.arange(0, 2000, 50), torch.rand(2000) < 0.3)
    tc = small_tc(max_steps=4, chat_ratio=1.0, chat_seq_tokens=16, ckpt_dir=str(tmp_path))
    log = T.train(T.new_model(c, 0), torch.randint(2, 64, (3000,)), tc, log_fn=lambda s: None, chat=chat)
    assert log["step"] == 4 and all(r["chat"] for r in log["steps"])


def test_recall_windows_score_only_what_the_window_has_said_before():
    g = torch.Generator().manual_seed(0)
    stream = torch.arange(1000, 6000)  # distinct tokens: every lookup has one answer
    rows, scored = T.recall_windows(stream, 16, 64, g, spans=(4, 8))
    assert rows.shape == scored.shape == (16, 64)
    kinds = set()
    for r, s in zip(rows.tolist(), scored.tolist()):
        first = s.index(True)
        before = {(r[j], r[j + 1]) for j in range(first - 1)}
        # every scored token is the one that followed the token before it earlier in the window
        assert all((r[i - 1], r[i]) in before for i, x in enumerate(s) if x)
        spans = r[1] == r[0] + 1  # a span of the stream; pairs are unrelated tokens
        kinds.add("spans" if spans else "pairs")
        if not spans:
            assert all(s[first::2]) and not any(s[first + 1 :: 2])  # each query's value, not its key
    assert kinds == {"pairs", "spans"}


def test_recall_batch_scores_only_recalled_tokens(tmp_path):
    g = torch.Generator().manual_seed(1)
    stream = torch.arange(100, 4000)
    b = T.sample_recall_batch(stream, 6, 4, 8, g, mask_id=1, pad_id=0, eps=1e-3)
    assert b.clean.shape == (6, 8, 4) and b.scored is not None
    assert not (b.masked & ~b.scored).any() and b.scored.any()
    # each window starts at its row's start: the first scored token follows its first occurrence
    for clean, sc, v in zip(
        b.clean.reshape(6, -1).tolist(), b.scored.reshape(6, -1).tolist(), b.valid.reshape(6, -1).tolist()
    ):
        toks = [t for t, ok in zip(clean, v) if ok]
        flags = [x for x, ok in zip(sc, v) if ok]
        i = flags.index(True)
        assert (toks[i - 1], toks[i]) in {(toks[j], toks[j + 1]) for j in range(i - 1)}
    # a run with chat and copy batches: each step is one kind
    chat = (torch.randint(2, 64, (2000,)), torch.arange(0, 2000, 50))
    tc = small_tc(max_steps=20, chat_ratio=0.3, copy_ratio=0.4, chat_seq_tokens=16, ckpt_dir=str(tmp_path))
    stream = torch.randint(2, 64, (3000,))  # tiny_config's vocabulary
    log = T.train(T.new_model(tiny_config(), 0), stream, tc, log_fn=lambda s: None, chat=chat)
    kinds = [(r["chat"], r["copy"]) for r in log["steps"]]
    assert (1, 1) not in kinds and {(1, 0), (0, 1), (0, 0)} <= set(kinds)


def test_distill_batches_are_their_own_kind_and_score_only_continuations(tmp_path, monkeypatch):
    stream = torch.randint(2, 64, (3000,))
    rows = [{"prompt": "p", "prompt_ids": [3, 4, 5, 6], "ids": [20 + i % 30 for i in range(24)], "parses": True}] * 60
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    distill = [distill_stream(tmp_path / "t.jsonl")] * 2
    chat = (torch.randint(2, 64, (2000,)), torch.arange(0, 2000, 50))
    tc = small_tc(
        max_steps=24,
        chat_ratio=0.3,
        distill_ratio=(0.25, 0.15),
        distill_seq_tokens=(16, 32),
        chat_seq_tokens=16,
        ckpt_dir=str(tmp_path),
    )
    seen = []
    orig = T.train_step

    def spy(model, opt, batch, tc, lr, master=None, certainty=None):
        seen.append((batch, certainty))
        return orig(model, opt, batch, tc, lr, master, certainty)

    monkeypatch.setattr(T, "train_step", spy)
    log = T.train(T.new_model(tiny_config(), 0), stream, tc, log_fn=lambda s: None, chat=chat, distill=distill)
    kinds = [(r["chat"], r["distill"]) for r in log["steps"]]
    assert (1, 1) not in kinds and {(1, 0), (0, 1), (0, 0)} <= set(kinds)
    for (batch, certainty), (_, is_distill) in zip(seen, kinds):
        if is_distill:
            assert certainty == tc.distill_certainty and batch.scored is not None
            # a prompt token (3..6) is never noised: it is the context, as at inference
            assert not (batch.masked & (batch.clean >= 3) & (batch.clean <= 6)).any()
            assert batch.masked.any()
        else:
            assert certainty is None


@pytest.mark.parametrize(
    "flags, device, want",
    [
        ("avx512f avx512_bf16", "cpu", "bf16"),
        ("avx512f amx_bf16", "cpu", "bf16"),
        ("avx512f avx2", "cpu", "fp32"),
        ("avx2", "cuda", "bf16"),
    ],
)
def test_the_default_precision_is_bf16_only_where_it_is_native(tmp_path, flags, device, want):
    (tmp_path / "cpuinfo").write_text(f"flags\t\t: fpu {flags}\n")
    assert T.default_precision(device, tmp_path / "cpuinfo") == want
    assert T.default_precision("cpu", tmp_path / "missing") == "fp32"
