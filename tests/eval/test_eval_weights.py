"""`eval` compares a few rows of every tensor of a GGUF with its --reference's weights before
scoring (eval/quality/weights.py), so that a fingerprint edited to the reference's cannot pass a
file of another model off as a conversion (issue 47: KL 0.29 and top-1 0.39 scored, exit 0)."""

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq
from testdata import REPO, TINY

from clover_gguf.checkpoint import Checkpoint
from clover_gguf.cli import cli
from clover_gguf.config import CloverConfig
from clover_gguf.constants import Keys
from clover_gguf.convert.recipes import RECIPES
from clover_gguf.eval.quality import weights as W
from clover_gguf.eval.quality.run import QualityError, check_matches_reference
from clover_gguf.gguf_io import codec as F
from clover_gguf.gguf_io.reader import open_gguf

V3 = REPO / "models" / "clover-tiny-v3-wip"


def _worst_ratio(gguf, model=TINY) -> float:
    """The largest error ratio over the tensors' sampled rows (compare_weights' own figures)."""
    ratios: dict = {}
    assert W.compare_weights(open_gguf(gguf), Checkpoint(model), ratios) is None
    return max(ratios.values())


def _with_kv(src, dst, key: str, value):
    g = F.parse(src.read_bytes())
    next(kv for kv in g.kvs if kv.key == key.encode()).value = value
    dst.write_bytes(F.serialize(g)[0])
    return dst


def _kv(path, key: str):
    return next(kv for kv in F.parse(path.read_bytes()).kvs if kv.key == key.encode()).value


def _one_line(res, needle):
    assert res.exit_code != 0, res.output
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("Error: "), res.stderr
    assert needle in res.stderr, res.stderr


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_shipped_recipe_passes_on_clover_tiny(converted, recipe):
    g = converted(TINY, recipe)
    assert _worst_ratio(g) < 2.0  # a margin under RATIO_LIMIT (2.5)
    assert check_matches_reference(g, TINY, CloverConfig.load(TINY)) is None


def test_imatrix_conversions_pass(tmp_path):
    """An importance matrix trades some weights' error for others': still within the bound."""
    from clover_gguf.convert.converter import convert
    from clover_gguf.convert.imatrix import compute_imatrix

    im = tmp_path / "im.gguf"
    ids = list(np.random.default_rng(0).integers(6, 4000, size=256))
    compute_imatrix(TINY, None, im, n_ctx=128, token_ids=ids, progress=False, log=lambda *a: None)
    for recipe in ("iq4_xs", "q4_k_m"):
        g = tmp_path / f"{recipe}.gguf"
        convert(TINY, g, recipe=recipe, imatrix=im, progress=False)
        assert _worst_ratio(g) < 2.0, recipe


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.Q5_1, Q.Q5_0, Q.Q4_1, Q.Q4_0])
def test_the_bound_is_the_uniform_quantizers_error(qt):
    """The unit is the RMS error of a uniform quantizer of the type's bits relative to the
    group's largest weight, whatever the values' distribution: gguf-py's (ggml's) quantizers of
    Gaussian and heavy-tailed rows land at 0.6-1.2 of it (below 1 for the types with a minimum,
    Q4_1 and Q5_1, whose grid spans max - min rather than 2 max|w|)."""
    rng = np.random.default_rng(1)
    for x in (rng.normal(size=(64, 256)), rng.standard_t(2, size=(64, 256))):
        x = x.astype(np.float32)
        got = gq.dequantize(gq.quantize(x, qt), qt).astype(np.float64)
        e = W.group_relative_error(got, x.astype(np.float64))
        ratio = float(np.sqrt(np.mean(e * e))) / W.uniform_rms(qt)
        assert 0.6 < ratio < 1.2, (qt.name, ratio)


def test_another_models_gguf_with_the_references_fingerprint_is_refused(converted, tmp_path):
    """Issue 47: the v3 GGUF with the v2 fingerprint was scored (KL 0.29, top-1 0.39, exit 0)."""
    v2 = converted(TINY)
    fp = _kv(v2, Keys.SOURCE_WEIGHTS_SHA256)
    bad = _with_kv(converted(V3), tmp_path / "v3-as-v2.gguf", Keys.SOURCE_WEIGHTS_SHA256, fp)
    cfg = CloverConfig.load(TINY)
    with pytest.raises(QualityError) as e:
        check_matches_reference(bad, TINY, cfg)
    msg = str(e.value)
    assert msg.startswith(f"{bad}: does not match the reference {TINY}: tensor ") and "\n" not in msg
    assert "whatever its fingerprint says" in msg and "the error of a" in msg
    out = tmp_path / "o"
    _one_line(
        CliRunner().invoke(cli, ["eval", "quality", "--reference", str(TINY), str(bad), "--out", str(out)]),
        "it is not a conversion of this reference, whatever its fingerprint says",
    )
    assert not (out / "quality.json").exists()
    _one_line(
        CliRunner().invoke(cli, ["eval", "tools", "--reference", str(TINY), str(bad), "--out", str(tmp_path / "t")]),
        "it is not a conversion of this reference, whatever its fingerprint says",
    )
    assert not (tmp_path / "t" / "tools.json").exists()


def test_every_type_of_the_other_model_is_refused(tmp_path):
    """clover-tiny-v3-wip in each type of 4 or more bits, its fingerprint the reference's: the
    tensors' own rows give it away (the F32 norms would anyway)."""
    from clover_gguf.convert.converter import convert

    for t in ("q8_0", "q6_k", "q5_k", "q4_k", "iq4_xs", "mxfp4"):
        g = tmp_path / f"{t}.gguf"
        convert(V3, g, tensor_types=[("^(token_embd|output)\\.weight$", t)], experts=t, outtype="q8_0", progress=False)
        why = W.compare_weights(open_gguf(g), Checkpoint(TINY))
        assert why and why.startswith("tensor token_embd.weight") and f"({t})" in why, (t, why)
        assert W.compare_weights(open_gguf(g), Checkpoint(V3)) is None  # its own reference: fine


def _perturbed(src, dst, name: str, edit):
    g = F.parse(src.read_bytes())
    ti = next(t for t in g.tis if t.name == name.encode())
    off, n = F.tensor_span(ti)
    data = bytearray(g.data)
    data[off : off + n] = edit(bytes(data[off : off + n]), ti)
    g.data = bytes(data)
    dst.write_bytes(F.serialize(g)[0])
    return dst


def test_a_perturbed_tensor_is_refused_naming_it(converted, tmp_path):
    """The fingerprint is the reference's, the weights are not: 3 % more on a BF16 output, two
    experts swapped in a Q4_K stack, the attention's keys of layer 0 scaled by 1.5."""
    g = converted(TINY)  # experts Q4_K, the rest BF16
    ck = Checkpoint(TINY)

    def scale(f):
        def edit(b, ti):
            if ti.type == 30:  # BF16 -> float32 and back (truncating: the scaling dominates)
                x = (np.frombuffer(b, np.uint16).astype(np.uint32) << 16).view(np.float32) * f
                return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()
            raise AssertionError(ti.type)

        return edit

    def swap_experts(b, ti):
        n = len(b) // ti.dims[2]
        return b[n : 2 * n] + b[:n] + b[2 * n :]

    for name, edit in (
        ("output.weight", scale(1.03)),
        ("blk.0.attn_k.weight", scale(1.5)),
        ("blk.2.ffn_down_exps.weight", swap_experts),
    ):
        bad = _perturbed(g, tmp_path / "bad.gguf", name, edit)
        why = W.compare_weights(open_gguf(bad), ck)
        assert why and why.startswith(f"tensor {name} ("), (name, why)
        with pytest.raises(QualityError, match=f"tensor {name} .*whatever its fingerprint says"):
            check_matches_reference(bad, TINY, CloverConfig.load(TINY))
    assert W.compare_weights(open_gguf(g), ck) is None


def test_non_finite_rows_are_refused(converted, tmp_path):
    g = converted(TINY)
    bad = _perturbed(
        g, tmp_path / "nan.gguf", "token_embd.weight", lambda b, ti: b"\xc0\x7f" * (len(b) // 2)
    )  # BF16 NaN everywhere
    why = W.compare_weights(open_gguf(bad), Checkpoint(TINY))
    assert why.startswith("tensor token_embd.weight (bf16): row ") and "non-finite" in why


def test_rows_are_spread_and_fixed():
    assert W.sample_rows("x", 4100, 8) == W.sample_rows("x", 4100, 8)
    rows = W.sample_rows("token_embd.weight", 4100, 8)
    assert len(rows) == 8 and all(0 <= r < 4100 for r in rows)
    assert all(b - a > 4100 / 8 / 2 for a, b in zip(rows, rows[1:]))  # one in each eighth
    assert W.sample_rows("blk.0.attn_norm.weight", 1, 2) == [0]
