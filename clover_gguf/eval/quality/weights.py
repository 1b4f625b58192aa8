"""A GGUF's weights against its --reference's, on a few rows of every tensor: the check that
makes the recorded fingerprint (clover_gguf.source_weights_sha256) more than a claim (issue 47).

Every GGUF tensor's rows are matched to the reference's source rows as the converter maps them
(convert/tensor_plan.source_entries: per-expert or fused experts, -exp(A_log), conv reshape);
a few rows are read from both sides, the GGUF's dequantized with gguf-py (gguf.quants, the same
dequantizers the eval's reference backend uses), and compared.

The error bound is the one of a uniform quantizer, relative to each group's largest weight. A
b-bit uniform quantizer of a group whose values lie in [-m, m] has a step of 2m / (2^b - 1) and
rounds each value by at most half a step; its RMS error is step / sqrt(12) whatever the values'
distribution, that is m / ((2^b - 1) * sqrt(3)). Measured on groups of 32 consecutive weights
of a row (ggml's blocks are 32 or 256 weights, the k-quants' sub-blocks 16 or 32), the ratio of
the RMS error to this figure is what the check bounds: a tensor whose sampled rows exceed
``RATIO_LIMIT`` (2.5) times it is not a conversion of the reference.

Why 2.5 (clover-tiny, every type the converter writes, with and without an importance matrix,
every row of every tensor; tests/eval/test_eval_weights.py keeps the recipes and a file of
another model honest): conversions stay at 0.6-1.03x over a whole tensor (MXFP4: 1.40x) and at
most 1.69x on a single row (MXFP4, whose FP4 grid and power-of-two scale are coarser than a
uniform 4-bit grid; IQ3_S 1.54x, every other type at most 1.17x); clover-tiny-v3-wip (a
continued training of clover-tiny, each row 0.1-0.7 of its norm away) converted to the same
type gives at least 3.97x on any 4 rows of a tensor of 4 or more bits, 55x in Q8_0 and far more
in BF16 and F32. 2.5 sits between 1.69 and 3.97 with room on both sides. Types of 2 and 3 bits
quantize with an error as large as such a difference (Q2_K, IQ2_S: 0.8x legitimately, 0.95x
for the other model; Q3_K, IQ3_S: 1.9x for the other model); the check rests there on the
other tensors: the norms are F32 in every file, the routers in every recipe, which keeps the
embeddings, attention and shared expert at Q8_0 or better, the output at Q6_K or better.

Cost: ``ROWS_KEY`` rows of the embeddings, the output and the middle layer's attention and
experts, ``ROWS_OTHER`` of every other tensor: about half a millisecond per tensor (50-120 ms
for clover-tiny's 99 tensors on a busy 2-core machine; Clover-35B-A3B has 963), beside an eval
that hashes all of the reference's weights for the fingerprint."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch
from gguf import GGMLQuantizationType

from ...checkpoint import Checkpoint
from ...convert import quants
from ...convert.pipeline import ShardReader
from ...convert.tensor_plan import source_entries

Q = GGMLQuantizationType
GROUP = 32  # weights per group whose largest |w| scales the error
FLOOR = 2.0**-14  # the smallest normal F16 (the block formats' scales are F16)
RATIO_LIMIT = 2.5
ROWS_KEY, ROWS_OTHER = 8, 2

# bits b of the uniform grid each type stands for: the quantized values' bits (a float type: its
# significand's, with the implicit bit). F32 is given 20: a reference computed in another
# precision (-exp(A_log) in float32 by another converter) differs by a few float32 ulps.
BITS: dict[GGMLQuantizationType, int] = {
    Q.F32: 20, Q.F16: 11, Q.BF16: 8,
    Q.Q8_0: 8, Q.Q8_1: 8, Q.Q6_K: 6,
    Q.Q5_0: 5, Q.Q5_1: 5, Q.Q5_K: 5,
    Q.Q4_0: 4, Q.Q4_1: 4, Q.Q4_K: 4, Q.IQ4_NL: 4, Q.IQ4_XS: 4, Q.MXFP4: 4,
    Q.Q3_K: 3, Q.IQ3_S: 3, Q.IQ3_XXS: 3,
    Q.Q2_K: 2, Q.IQ2_XXS: 2, Q.IQ2_XS: 2, Q.IQ2_S: 2, Q.TQ2_0: 2,
    Q.IQ1_S: 1, Q.IQ1_M: 1, Q.TQ1_0: 1,
}  # fmt: skip


def uniform_rms(qt: GGMLQuantizationType) -> float:
    """RMS error of a uniform quantizer of the type's bits, relative to the group's largest |w|."""
    b = BITS.get(qt)
    if b is None:  # another type gguf-py dequantizes: its bits per weight, scales included
        b = max(1, int(quants.bits_per_weight(qt)))
    return 1.0 / ((2**b - 1) * math.sqrt(3))


def sample_rows(name: str, n_rows: int, k: int) -> list[int]:
    """k rows spread over [0, n_rows), at an offset fixed by the tensor's name (the same rows
    on every run: a refusal is reproducible)."""
    u = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") / 2.0**64
    return sorted({min(n_rows - 1, int((j + u) * n_rows / k)) for j in range(min(k, n_rows))})


def group_relative_error(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """(got - ref) of rows [k, n], each divided by the largest |ref| of its group of GROUP weights
    of the row."""
    k, n = ref.shape
    a = np.zeros((k, n + (-n % GROUP)))
    a[:, :n] = np.abs(ref)
    m = np.maximum(a.reshape(k, -1, GROUP).max(axis=2), FLOOR)
    return (got - ref) / np.repeat(m, GROUP, axis=1)[:, :n]


def _key_tensors(ck: Checkpoint) -> set[str]:
    """The tensors that get ROWS_KEY rows: the embeddings, the output, and the middle layer's
    attention and routed experts."""
    m = ck.config.num_hidden_layers // 2
    keys = {"token_embd.weight", "output.weight"}
    for name, shape, _, _ in source_entries(ck):
        if name.startswith(f"blk.{m}.") and len(shape) >= 2 and ("attn_" in name or "_exps" in name):
            keys.add(name)
    return keys


def _source_row(reader: ShardReader, pieces, transform, i: int) -> np.ndarray:
    """Row i of the GGUF tensor made of ``pieces``, from the source, as the converter makes it."""
    for p in pieces:
        n = p.r1 - p.r0
        if i < n:
            t = reader.rows(p.hf, p.r0 + i, p.r0 + i + 1)
            if transform == "a_log":
                t = -torch.exp(t.double())
            return t.double().reshape(-1).numpy()
        i -= n
    raise IndexError(i)


def compare_weights(r, ck: Checkpoint, ratios: dict | None = None) -> str | None:
    """None when the sampled rows of every tensor of the GGUF (gguf-py's reader ``r``) are within
    the bound of the reference checkpoint's; else what differs, one line naming the tensor.
    ``ratios``, when given, gets each tensor's error over the uniform quantizer's (all of them:
    a failure does not stop the comparison there)."""
    by_name = {t.name: t for t in r.tensors}
    keys, first = _key_tensors(ck), None
    with ShardReader(ck) as reader:
        for name, shape, pieces, transform in source_entries(ck):
            t = by_name.get(name)
            if t is None:
                why = f"tensor {name} is missing"
            else:
                k = ROWS_KEY if name in keys else ROWS_OTHER
                why = _compare_tensor(r, t, name, shape, pieces, transform, reader, k, ratios)
            if why and ratios is None:
                return why
            first = first or why
    return first


def _compare_tensor(r, t, name, shape, pieces, transform, reader, k, ratios) -> str | None:
    qt = GGMLQuantizationType(int(t.tensor_type))
    tname = quants.type_name(qt)
    cols = int(shape[-1])
    n_rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    try:
        rb = quants.row_bytes(qt, cols)
    except ValueError as e:
        return f"tensor {name} ({tname}): {e}"
    base, rows = int(t.data_offset), sample_rows(name, n_rows, k)
    raw = np.concatenate([np.asarray(r.data[base + i * rb : base + (i + 1) * rb]) for i in rows])
    if raw.size != rb * len(rows):
        return f"tensor {name} ({tname}): its data runs past the end of the file"
    try:  # one call for the rows: gguf-py's per-call overhead is most of the cost
        got = quants.dequantize(raw, qt, (len(rows), cols)).astype(np.float64)
    except NotImplementedError:
        return f"tensor {name} has type {tname}, which gguf-py cannot dequantize: its weights cannot be checked"
    bad = ~np.isfinite(got).all(axis=1)
    if bad.any():
        return f"tensor {name} ({tname}): row {rows[int(np.argmax(bad))]} has non-finite values"
    ref = np.stack([_source_row(reader, pieces, transform, i) for i in rows])
    e = group_relative_error(got, ref)
    rms = float(np.sqrt(np.mean(e * e)))
    unit = uniform_rms(qt)
    ratio = rms / unit
    if ratios is not None:
        ratios[name] = ratio
    if ratio <= RATIO_LIMIT:
        return None
    return (
        f"tensor {name} ({tname}): in rows {', '.join(map(str, rows))} its weights differ from the reference's by "
        f"{ratio:.3g}x the error of a {tname} conversion (RMS {rms:.3g} of each {GROUP}-weight group's largest |w|; "
        f"a conversion stays within {RATIO_LIMIT:g} x {unit:.3g})"
    )
