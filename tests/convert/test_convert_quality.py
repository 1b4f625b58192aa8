"""Acceptance: the PyTorch reference on weights dequantized from the GGUF stays close to
the source weights' logits (mean KL, top-1 agreement); more bits, closer."""

import torch
from convert_helpers import VECTORS

from clover_gguf.convert.converter import convert
from clover_gguf.gguf_io.reader import logit_agreement

VEC = VECTORS / "random-clover"


def test_logits_close_to_reference(tmp_path):
    ids = torch.randint(0, 94, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    res = {}
    for name, kw in {
        "bf16": dict(experts="bf16"),
        "q8_0": dict(experts="q8_0", outtype="q8_0"),
        "q4": dict(experts="q4_0"),
    }.items():
        out = tmp_path / f"{name}.gguf"
        convert(VEC, out, progress=False, **kw)
        res[name] = logit_agreement(VEC, out, ids, seq_len=128)
    assert res["bf16"]["mean_kl"] < 1e-9 and res["bf16"]["top1_agreement"] == 1.0  # lossless
    # (the random vectors model is very sensitive: its attention alone at Q8_0 gives ~2e-3)
    assert res["q8_0"]["mean_kl"] < 5e-3 and res["q8_0"]["top1_agreement"] > 0.9
    assert res["q4"]["mean_kl"] < 0.05
    assert res["q8_0"]["mean_kl"] < res["q4"]["mean_kl"]
