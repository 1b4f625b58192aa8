"""Runtime parity at Clover-35B-A3B's real widths with quantized experts.

One layer with the full model's shapes where they set the kernels' sizes: d = 2048, 16 query
and 4 kv heads of D = 256 (the memory state is 4 x 256 x 256 per layer), F_e = F_s = 512,
top-8 routing, rope_theta 1e7, B = 32. Kept small to stay fast on CI: the vocabulary (512 for
248320) and the expert count (16 for 256), which change only the sizes of the embedding, the
output and the router. Experts Q4_K, the rest F32. The reference is the PyTorch model on the
GGUF's own weights dequantized by gguf-py, so the only difference left is ggml's arithmetic
(its Q4_K matmuls quantize the activations to Q8_K), which the tolerances below bound.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGUFReader
from test_runtime import _load_lib_or_fail, kl_rows, ref_states

from clover_gguf.reference.generate import GenerationConfig, TorchBackend, generate
from clover_gguf.runtime.runtime import RuntimeBackend

# measured on CPU: KL mean 2e-5, max 5e-5; max|dlogit| 3e-2; states 3e-7 (one layer: the state
# does not go through the experts)
KL_MEAN_TOL = 1e-4
KL_MAX_TOL = 1e-3
DLOGIT_TOL = 0.1
STATE_TOL = 1e-4


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    _load_lib_or_fail()
    from clover_gguf.config import preset
    from clover_gguf.convert.converter import convert
    from clover_gguf.gguf_io.reader import load_gguf_as_hf_tensors
    from clover_gguf.reference.model import CloverModel
    from clover_gguf.runtime.runtime import CloverRuntime
    from clover_gguf.synthetic import write_synthetic

    d = tmp_path_factory.mktemp("wide")
    cfg = preset(
        "clover-35b-a3b",
        num_hidden_layers=1,
        vocab_size=512,
        num_experts=16,
        mask_token_id=511,
        bos_token_id=508,
        eos_token_id=509,
        pad_token_id=509,
    )
    write_synthetic(d / "hf", cfg, progress=False, seed=11)
    gguf = d / "wide.gguf"
    convert(d / "hf", gguf, outtype="f32", experts="q4_k", progress=False)
    types = {t.name: t.tensor_type.name for t in GGUFReader(gguf).tensors}
    assert types["blk.0.ffn_down_exps.weight"] == "Q4_K" and types["blk.0.attn_q.weight"] == "F32"
    gcfg, tensors = load_gguf_as_hf_tensors(gguf)
    assert (gcfg.head_dim, gcfg.num_attention_heads, gcfg.num_key_value_heads) == (256, 16, 4)
    ref = CloverModel.from_tensors(gcfg, tensors, torch.float32).eval()
    rt = CloverRuntime(gguf, n_threads=2, n_ubatch=128, n_batch=128)
    yield rt, ref
    rt.close()


def test_wide_q4_k_experts_parity(wide):
    rt, ref = wide
    c = ref.config
    B = c.block_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 500, (70,), generator=g).tolist()  # blocks 32, 32, 6
    rt.reset()
    rt.commit(prompt, B)
    state = ref.prefill(torch.tensor([prompt]), B)
    for il, want in enumerate(ref_states(state)):
        diff = float(abs(rt.state(il) - want.reshape(rt.state(il).shape)).max())
        assert diff < STATE_TOL, f"D=256 state after the prompt, layer {il}: max|diff| {diff:.2e}"
    # a masked block, then the same block half unmasked
    blk = [c.mask_token_id] * B
    half = [t if i % 2 else c.mask_token_id for i, t in enumerate(torch.randint(0, 500, (B,), generator=g).tolist())]
    for what, b in (("all masked", blk), ("half masked", half)):
        want = ref.block_logits(torch.tensor([b]), len(prompt), state)[0]
        got = rt.block_logits(b)
        kl = kl_rows(want, got)
        assert kl.mean() < KL_MEAN_TOL and kl.max() < KL_MAX_TOL, f"{what}: KL mean {kl.mean():.2e} max {kl.max():.2e}"
        assert (want - got).abs().max() < DLOGIT_TOL, what
        top2 = want.topk(2, -1).values
        sure = (top2[:, 0] - top2[:, 1]) > 2 * DLOGIT_TOL  # no near-tie: the argmax must agree
        assert torch.equal(want.argmax(-1)[sure], got.argmax(-1)[sure]), what
    cfg = GenerationConfig(
        max_new_tokens=2 * B,
        block_size=B,
        steps=B // 4,
        temperature=0.0,
        mask_token_id=c.mask_token_id,
        eos_token_id=rt.eos_token_id,
    )
    # greedy decisions: every denoising step of the reference's generation, replayed in the
    # runtime (same blocks, same memory); a random model's logits are flat (top-1 margins of a
    # few 0.01 are common), so argmaxes must agree wherever the margin exceeds the logit error
    both = _Both(ref, rt)
    generate(both, prompt, cfg)
    n_sure = n_agree = n = 0
    for block, want, got in both.steps:
        m = torch.tensor(block) == c.mask_token_id
        want, got = want[m], got[m]
        top2 = want.topk(2, -1).values
        sure = (top2[:, 0] - top2[:, 1]) > 2 * DLOGIT_TOL
        assert torch.equal(want.argmax(-1)[sure], got.argmax(-1)[sure])
        assert kl_rows(want, got).mean() < KL_MEAN_TOL
        n_sure, n_agree, n = (
            n_sure + int(sure.sum()),
            n_agree + int((want.argmax(-1) == got.argmax(-1)).sum()),
            n + len(want),
        )
    # measured: 16 steps, 288 masked rows, 151 without a near-tie, 286 agreeing
    assert len(both.steps) == 2 * 8 and n_sure > n // 10 and n_agree >= 0.9 * n, (n, n_sure, n_agree)
    # the native loop (graph-side candidates, folded prompt commit) = the step-level loop on
    # the runtime's logits
    assert rt.generate(prompt, cfg).tokens == generate(RuntimeBackend(rt), prompt, cfg).tokens


class _Both(TorchBackend):
    """The reference drives generation; the runtime follows it (same blocks, same commits)
    and its logits are kept next to the reference's."""

    def __init__(self, ref, rt):
        from clover_gguf.runtime.runtime import RuntimeBackend

        super().__init__(ref, "blockwise")
        self.rt, self.steps = RuntimeBackend(rt), []

    def prefill(self, tokens, block_size):
        super().prefill(tokens, block_size)
        self.rt.prefill(tokens, block_size)

    def block_logits(self, block):
        want = super().block_logits(block)
        self.steps.append((list(block), want, self.rt.block_logits(block)))
        return want

    def commit(self, block):
        super().commit(block)
        self.rt.commit(block)
