"""Quantizers: numpy (gguf-py) vs ggml's own (ctypes), bit for bit; error bounds against
gguf-py's dequantizers; llama.cpp's fallback rule; the missing-libggml message."""

import numpy as np
import pytest
from convert_helpers import require_ggml
from gguf import GGMLQuantizationType as Q

from clover_gguf.convert import ggml_lib, quants

NUMPY_TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4"]


def _inputs(n_per_row=256, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((64, n_per_row)) * 0.05).astype(np.float32)
    x[1] = 0.0  # all-zero blocks
    x[2, :32] = 1e-30  # tiny values
    x[3] = np.round(rng.standard_normal(n_per_row) * 4) / 8  # exact ties on the grids
    x[4, 5] = 7.5  # an outlier
    x[5] = -x[5]
    x[6] = rng.uniform(-1, 1, n_per_row).astype(np.float32) * 1e3
    x[7] = np.linspace(-1, 1, n_per_row, dtype=np.float32)
    return x


@pytest.mark.parametrize("t", NUMPY_TYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_numpy_matches_ggml_bit_for_bit(t, seed):
    require_ggml()
    x = _inputs(seed=seed)
    a = quants.quantize_rows(x, t, backend="numpy")
    b = quants.quantize_rows(x, t, backend="ggml")
    assert a.shape == b.shape
    assert np.array_equal(a, b), f"{t}: {int((a != b).any(1).sum())} rows differ"


@pytest.mark.parametrize("t", ["q8_0", "mxfp4", "bf16", "f16"])
def test_numpy_exact_with_imatrix_for_types_that_ignore_it(t):
    require_ggml()
    x = _inputs(seed=3)
    im = np.random.default_rng(3).random(x.shape[1]).astype(np.float32)
    assert np.array_equal(
        quants.quantize_rows(x, t, im, backend="numpy"), quants.quantize_rows(x, t, im, backend="ggml")
    )


@pytest.mark.parametrize("t", ["q4_0", "q4_1", "q5_0", "q5_1"])
def test_imatrix_changes_legacy_quants_and_needs_ggml(t):
    require_ggml()
    x = _inputs(seed=4)
    im = np.random.default_rng(4).random(x.shape[1]).astype(np.float32) * 10
    with pytest.raises(quants.QuantBackendError, match="needs ggml"):
        quants.quantize_rows(x, t, im, backend="numpy")
    a = quants.quantize_rows(x, t, im, backend="ggml")
    assert not np.array_equal(a, quants.quantize_rows(x, t, backend="ggml"))


# rough relative RMS error bounds for N(0, s) data, per type
REL_RMSE = {
    "q8_0": 0.01,
    "q6_k": 0.03,
    "q5_k": 0.06,
    "q5_0": 0.06,
    "q5_1": 0.06,
    "q4_k": 0.12,
    "q4_0": 0.13,
    "q4_1": 0.12,
    "iq4_nl": 0.12,
    "iq4_xs": 0.12,
    "mxfp4": 0.2,
    "q3_k": 0.25,
    "q2_k": 0.45,
    "iq3_s": 0.25,
    "iq2_s": 0.4,
    "iq2_m": 0.4,
    "bf16": 0.005,
    "f16": 0.001,
    "f32": 0.0,
}


@pytest.mark.parametrize("t", sorted(set(quants.EXPERT_TYPES) | set(quants.OUTTYPES)))
def test_ggml_quantize_then_gguf_py_dequantize(t):
    require_ggml()
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((128, 512)) * 0.02).astype(np.float32)
    qt = quants.parse_type(t)
    # the IQ2 types need an importance matrix (uniform here)
    im = np.ones(512, np.float32) if quants.requires_imatrix(qt) else None
    q = quants.quantize_rows(x, qt, im, backend="ggml")
    assert q.shape == (128, quants.row_bytes(qt, 512))
    y = quants.dequantize(q, qt, x.shape)
    rel = np.sqrt(np.mean((y - x) ** 2)) / np.sqrt(np.mean(x**2))
    assert rel <= REL_RMSE[t], f"{t}: relative RMSE {rel:.4f}"


@pytest.mark.parametrize("t", ["q4_k", "iq4_xs", "q6_k"])
def test_threaded_chunks_equal_one_call(t):
    lib = require_ggml()
    x = _inputs(n_per_row=512, seed=6)
    x = np.concatenate([x] * 8)
    im = np.random.default_rng(6).random(512).astype(np.float32)
    qt = quants.parse_type(t)
    one = np.zeros((x.shape[0], lib.row_size(int(qt), 512)), np.uint8)
    lib.quantize_chunk(int(qt), x, one, 0, x.shape[0], im)
    for threads in (1, 3):
        assert np.array_equal(quants.quantize_rows(x, qt, im, backend="ggml", threads=threads), one)


def test_fallback_rule_matches_llama_cpp():
    f = quants.fallback_type
    assert f(Q.Q4_K, 256) == (Q.Q4_K, None)
    assert f(Q.Q4_K, 64)[0] == Q.Q5_0
    assert f(Q.Q5_K, 96)[0] == Q.Q5_1
    assert f(Q.Q6_K, 32)[0] == Q.Q8_0
    assert f(Q.IQ4_XS, 64)[0] == Q.IQ4_NL
    assert f(Q.IQ3_S, 64)[0] == Q.IQ4_NL
    assert f(Q.IQ2_S, 96)[0] == Q.IQ4_NL
    assert f(Q.Q3_K, 64)[0] == Q.Q4_0
    assert f(Q.Q4_K, 48)[0] == Q.F16  # fallback still does not fit -> F16
    assert f(Q.Q8_0, 48)[0] == Q.F16  # 32-block type that does not fit
    assert f(Q.MXFP4, 64) == (Q.MXFP4, None)
    assert f(Q.BF16, 7) == (Q.BF16, None)
    t, why = f(Q.Q4_K, 64)
    assert "64" in why and "q4_k" in why and "q5_0" in why


def test_row_sizes_agree_with_ggml():
    lib = require_ggml()
    for t in set(quants.EXPERT_TYPES) | set(quants.OUTTYPES):
        qt = quants.parse_type(t)
        assert quants.row_bytes(qt, 512) == lib.row_size(int(qt), 512), t
        assert quants.block_size(qt) == lib.blck_size(int(qt)), t
        # llama-quantize's rule is ggml's plus IQ2_S/IQ3_XXS
        assert quants.requires_imatrix(qt) == (lib.requires_imatrix(int(qt)) or qt in (Q.IQ2_S, Q.IQ3_XXS)), t


def test_missing_libggml_message(no_ggml):
    x = _inputs()
    with pytest.raises(quants.QuantBackendError) as ei:
        quants.quantize_rows(x, "q4_k")
    msg = str(ei.value)
    assert "clover-gguf runtime build" in msg and ggml_lib.LIB_ENV in msg
    # the exact numpy types still work without it
    assert quants.quantize_rows(x, "q8_0").shape == (64, 272)


def test_env_var_points_at_library(monkeypatch, tmp_path):
    lib = require_ggml()
    monkeypatch.setattr(ggml_lib, "_lib", None)
    monkeypatch.setenv(ggml_lib.LIB_ENV, str(lib.path))
    assert ggml_lib.candidate_paths()[0] == lib.path
    monkeypatch.setenv(ggml_lib.LIB_ENV, str(lib.path.parent))
    assert ggml_lib.candidate_paths()[0].parent == lib.path.parent
    monkeypatch.setenv(ggml_lib.LIB_ENV, str(tmp_path / "nothing.so"))
    assert tmp_path / "nothing.so" not in ggml_lib.candidate_paths()


def test_bad_rows_fail_in_python_not_in_ggml():
    lib = require_ggml()
    x = np.zeros((2, 100), np.float32)
    with pytest.raises(ValueError):
        lib.quantize_chunk(int(Q.Q4_K), x, np.zeros((2, 1000), np.uint8), 0, 2)
    with pytest.raises(ValueError):
        quants.quantize_rows(x, "q4_k", backend="ggml")
