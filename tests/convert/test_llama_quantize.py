"""The converter's quantized blocks against the real `llama-quantize` binary (built with the
runtime, tools/quantize): a synthetic model converted by us straight from BF16 safetensors, and
the same model converted to an F32 GGUF then quantized by llama-quantize with the same types,
hold the same bytes in every tensor (with and without an importance matrix).

`llama-quantize` is looked up in $CLOVER_GGUF_LLAMA_QUANTIZE, then in the runtime's bin_dir
(`clover-gguf runtime build` puts it there). Missing, the tests FAIL (never skip)."""

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from convert_helpers import write_synth
from gguf import GGUFReader

from clover_gguf.constants import GGUF_EXPERT_NAME
from clover_gguf.convert.converter import convert
from clover_gguf.convert.imatrix import write_imatrix


def llama_quantize() -> Path:
    from clover_gguf.runtime.build import runtime_paths

    env = os.environ.get("CLOVER_GGUF_LLAMA_QUANTIZE")
    p = Path(env) if env else runtime_paths()["bin_dir"] / "llama-quantize"
    if not (p.is_file() and os.access(p, os.X_OK)):
        pytest.fail(
            f"llama-quantize not found at {p}: run `clover-gguf runtime build` (it builds llama-quantize) "
            "or set CLOVER_GGUF_LLAMA_QUANTIZE",
            pytrace=False,
        )
    return p


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A 1-layer model whose rows are multiples of 256 (no k-quant fallbacks), as BF16
    safetensors and as an all-F32 GGUF (llama-quantize's input)."""
    d = tmp_path_factory.mktemp("lq")
    src = write_synth(d / "hf", seed=5)
    f32 = d / "f32.gguf"
    convert(src, f32, outtype="f32", experts="f32", progress=False)
    return src, f32


def _imatrix(path: Path) -> Path:
    """Random activation statistics for the experts and attn_q, expert 1 never routed."""
    rng = np.random.default_rng(1)
    names = [GGUF_EXPERT_NAME[p].format(bid=0) for p in ("gate", "up", "down")]
    sums = {n: (rng.random((4, 256)) * 50).astype(np.float32) for n in names}
    counts = {n: np.array([10, 0, 3, 7], np.float32) for n in names}
    sums["blk.0.attn_q.weight"] = (rng.random((1, 256)) * 5).astype(np.float32)
    counts["blk.0.attn_q.weight"] = np.array([4], np.float32)
    write_imatrix(path, sums, counts, ["calib.txt"], 3, 64)
    return path


def _tensors(path: Path) -> dict[str, tuple[str, bytes]]:
    return {t.name: (t.tensor_type.name, np.asarray(t.data).tobytes()) for t in GGUFReader(path).tensors}


@pytest.mark.parametrize("experts", ["q4_k", "iq4_xs"])
@pytest.mark.parametrize("with_imatrix", [False, True], ids=["plain", "imatrix"])
def test_every_tensor_identical_to_llama_quantize(model, tmp_path, experts, with_imatrix):
    exe = llama_quantize()
    src, f32 = model
    # the rest Q8_0, attn_q a k-quant too so that the imatrix also weights a dense tensor
    types = [f"ffn_{p}_exps={experts}" for p in ("gate", "up", "down")] + ["attn_q=q4_k"]
    im = _imatrix(tmp_path / "im.gguf") if with_imatrix else None
    ours = tmp_path / "ours.gguf"
    convert(src, ours, outtype="q8_0", experts=experts, tensor_types=["attn_q=q4_k"], imatrix=im, progress=False)
    theirs = tmp_path / "theirs.gguf"
    cmd = [str(exe), "--pure"]
    for t in types:
        cmd += ["--tensor-type", t]
    if im is not None:
        cmd += ["--imatrix", str(im)]
    r = subprocess.run(cmd + [str(f32), str(theirs), "Q8_0", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    if im is not None:  # it read our file: 4 entries, none missing
        assert "loaded 4 importance matrix entries from" in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
    a, b = _tensors(ours), _tensors(theirs)
    assert a.keys() == b.keys()
    quantized = {n for n, (t, _) in a.items() if t not in ("F32", "F16", "BF16")}
    want_q = {GGUF_EXPERT_NAME[p].format(bid=0) for p in ("gate", "up", "down")} | {"blk.0.attn_q.weight"}
    assert len(quantized) > len(want_q)  # the Q8_0 ones too
    assert want_q <= quantized
    assert a["blk.0.attn_q.weight"][0] == "Q4_K" and a[GGUF_EXPERT_NAME["down"].format(bid=0)][0] == experts.upper()
    diff = [f"{n}: ours {a[n][0]}, llama-quantize {b[n][0]}" for n in a if a[n] != b[n]]
    assert not diff, "tensors that differ: " + "; ".join(diff)
