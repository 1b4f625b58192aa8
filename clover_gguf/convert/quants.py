"""Quantization of float32 rows into ggml block formats.

Two backends, bit-identical where both exist:

* ``ggml``: ggml's own ``ggml_quantize_chunk`` through ctypes (``ggml_lib``); every type.
* ``numpy``: gguf-py's ``gguf.quants`` quantizers, for the types where they reproduce ggml's
  reference quantizer exactly: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and MXFP4.
  With an importance matrix ggml switches Q4_0/Q4_1/Q5_0/Q5_1 to a different (weighted)
  algorithm, which gguf-py does not have, so those need the ggml backend then; ggml
  ignores the imatrix for F32/F16/BF16/Q8_0/MXFP4, so numpy stays exact for them.

``backend="auto"`` uses ggml when the library is found, else numpy when exact, else fails
with a message saying how to build the runtime. Rows are quantized in parallel chunks on
a thread pool (ctypes and numpy release the GIL).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from ..errors import CloverError
from ..util import default_threads
from . import ggml_lib

Q = GGMLQuantizationType

# user-facing names (lower case, as llama.cpp's ggml_type_name)
TYPE_NAMES: dict[str, GGMLQuantizationType] = {
    "f32": Q.F32,
    "f16": Q.F16,
    "bf16": Q.BF16,
    "q8_0": Q.Q8_0,
    "q4_0": Q.Q4_0,
    "q4_1": Q.Q4_1,
    "q5_0": Q.Q5_0,
    "q5_1": Q.Q5_1,
    "q2_k": Q.Q2_K,
    "q3_k": Q.Q3_K,
    "q4_k": Q.Q4_K,
    "q5_k": Q.Q5_K,
    "q6_k": Q.Q6_K,
    "iq4_nl": Q.IQ4_NL,
    "iq4_xs": Q.IQ4_XS,
    "iq3_s": Q.IQ3_S,
    "iq2_s": Q.IQ2_S,
    "mxfp4": Q.MXFP4,
}
# llama.cpp's IQ2_M file type stores its experts as IQ2_S; the name users know is accepted
TYPE_ALIASES: dict[str, str] = {"iq2_m": "iq2_s"}

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
EXPERT_TYPES = (
    "q4_k", "q4_0", "q4_1", "iq4_nl", "iq4_xs", "mxfp4", "q5_k", "q6_k", "q8_0", "bf16", "f16", "f32",
    "q3_k", "q2_k", "iq3_s", "iq2_s", "iq2_m",
)  # fmt: skip

FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})
# numpy (gguf-py) quantizers that are bit-exact with ggml's reference quantizer
NUMPY_EXACT = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.MXFP4})
# types for which ggml ignores the importance matrix
IMATRIX_IGNORED = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.MXFP4})

# llama.cpp's tensor_type_fallback (src/llama-quant.cpp): when a row is not a multiple of the
# type's block, use this 32-block type; if that still does not fit, F16.
FALLBACK: dict[GGMLQuantizationType, GGMLQuantizationType] = {
    Q.IQ4_XS: Q.IQ4_NL,
    Q.IQ3_S: Q.IQ4_NL,
    Q.IQ2_S: Q.IQ4_NL,
    Q.Q2_K: Q.Q4_0,
    Q.Q3_K: Q.Q4_0,
    Q.Q4_K: Q.Q5_0,
    Q.Q5_K: Q.Q5_1,
    Q.Q6_K: Q.Q8_0,
}


class QuantBackendError(CloverError, RuntimeError):
    """The requested type needs libggml and none was found."""


def parse_type(name: str | GGMLQuantizationType) -> GGMLQuantizationType:
    if isinstance(name, GGMLQuantizationType):
        return name
    key = str(name).strip().lower()
    key = TYPE_ALIASES.get(key, key)
    if key not in TYPE_NAMES:
        raise ValueError(f"unknown tensor type {name!r}; known: {', '.join(TYPE_NAMES)}")
    return TYPE_NAMES[key]


def type_name(qt: GGMLQuantizationType) -> str:
    return qt.name.lower()


def block_size(qt: GGMLQuantizationType) -> int:
    return GGML_QUANT_SIZES[qt][0]


def row_bytes(qt: GGMLQuantizationType, n_per_row: int) -> int:
    blk, size = GGML_QUANT_SIZES[qt]
    if n_per_row % blk:
        raise ValueError(f"row length {n_per_row} is not a multiple of {type_name(qt)}'s block {blk}")
    return n_per_row // blk * size


def tensor_bytes(qt: GGMLQuantizationType, shape) -> int:
    n_rows = 1
    for s in shape[:-1]:
        n_rows *= int(s)
    return n_rows * row_bytes(qt, int(shape[-1]))


def bits_per_weight(qt: GGMLQuantizationType) -> float:
    blk, size = GGML_QUANT_SIZES[qt]
    return 8.0 * size / blk


def fallback_type(qt: GGMLQuantizationType, n_per_row: int) -> tuple[GGMLQuantizationType, str | None]:
    """llama.cpp's fallback for rows that are not a multiple of the type's block.
    Returns (type to use, reason or None when no fallback was needed)."""
    blk = block_size(qt)
    if n_per_row % blk == 0:
        return qt, None
    new = FALLBACK.get(qt)
    if new is None:
        if blk > 32:
            raise ValueError(f"no tensor type fallback is defined for type {type_name(qt)}")
        new = qt
    if n_per_row % block_size(new):
        new = Q.F16
    return new, (
        f"row length {n_per_row} is not a multiple of {blk} (required for {type_name(qt)}) -> {type_name(new)}"
    )


def numpy_exact(qt: GGMLQuantizationType, with_imatrix: bool = False) -> bool:
    if qt not in NUMPY_EXACT:
        return False
    return (not with_imatrix) or qt in IMATRIX_IGNORED


def uses_imatrix(qt: GGMLQuantizationType) -> bool:
    return qt not in IMATRIX_IGNORED


def requires_imatrix(qt: GGMLQuantizationType) -> bool:
    """llama-quantize's tensor_requires_imatrix (IQ1/IQ2 families and IQ3_XXS: without one
    they are unusable); answered without libggml."""
    return qt in (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ1_S, Q.IQ1_M)


def backend_for(qt: GGMLQuantizationType, with_imatrix: bool = False, backend: str = "auto") -> str:
    """'ggml' or 'numpy' for this type; raises QuantBackendError when neither can do it exactly."""
    with_imatrix = with_imatrix and uses_imatrix(qt)
    if backend == "numpy":
        if not numpy_exact(qt, with_imatrix):
            raise QuantBackendError(
                f"{type_name(qt)}{' with an imatrix' if with_imatrix else ''} has no exact numpy "
                f"quantizer; it needs ggml's. {ggml_lib.BUILD_HINT}"
            )
        return "numpy"
    if backend == "ggml":
        ggml_lib.load(required=True)
        return "ggml"
    if backend != "auto":
        raise ValueError(f"unknown backend {backend!r}")
    if qt in FLOAT_TYPES:
        return "numpy"  # plain casts: numpy is exact and as fast
    if ggml_lib.available():
        return "ggml"
    if numpy_exact(qt, with_imatrix):
        return "numpy"
    raise QuantBackendError(
        f"type {type_name(qt)}{' with an imatrix' if with_imatrix else ''} needs ggml's quantizer "
        f"(libggml-base), which was not found. Without it, use a type gguf-py quantizes exactly "
        f"({', '.join(type_name(t) for t in sorted(NUMPY_EXACT, key=int))}). {ggml_lib.BUILD_HINT}"
    )


_pools: dict[int, ThreadPoolExecutor] = {}


def _pool(threads: int) -> ThreadPoolExecutor:
    if threads not in _pools:
        _pools[threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="clover-quant")
    return _pools[threads]


def _numpy_rows(x: np.ndarray, qt: GGMLQuantizationType) -> np.ndarray:
    if qt == Q.F32:
        return x.view(np.uint8)
    if qt == Q.F16:
        with np.errstate(over="ignore"):
            return x.astype(np.float16).view(np.uint8)
    return gq.quantize(x, qt)


def quantize_rows(
    x: np.ndarray,
    qt: GGMLQuantizationType,
    imatrix: np.ndarray | None = None,
    backend: str = "auto",
    threads: int | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Quantize the float32 matrix ``x`` [n_rows, n_per_row] to ``qt``.

    ``imatrix``: importance weights [n_per_row] for all the rows (one expert's), as
    llama-quantize passes them (sums / counts). Returns uint8 [n_rows, row_bytes].
    """
    qt = parse_type(qt)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 1:
        x = x.reshape(1, -1)
    if x.ndim != 2:
        x = x.reshape(-1, x.shape[-1])
    n_rows, n_per_row = x.shape
    rb = row_bytes(qt, n_per_row)
    if imatrix is not None:
        imatrix = np.ascontiguousarray(imatrix, dtype=np.float32).reshape(-1)
        if imatrix.shape[0] != n_per_row:
            raise ValueError(f"imatrix has {imatrix.shape[0]} values, rows have {n_per_row}")
        if not uses_imatrix(qt):
            imatrix = None
    if imatrix is None and requires_imatrix(qt):
        raise ValueError(f"{type_name(qt)} requires an importance matrix")
    be = backend_for(qt, imatrix is not None, backend)
    if out is None:
        out = np.empty((n_rows, rb), dtype=np.uint8)
    else:
        assert out.dtype == np.uint8 and out.shape == (n_rows, rb) and out.flags.c_contiguous
    if n_rows == 0:
        return out
    threads = threads or default_threads()

    if be == "ggml":
        lib = ggml_lib.load()
        lib.init(int(qt))
        # chunks of >= 16 K elements (as llama-quantize), at least 4 per thread
        min_rows = max(1, (32 * 512) // n_per_row)
        n_chunks = max(1, min(threads * 4, n_rows // min_rows))
        bounds = np.linspace(0, n_rows, n_chunks + 1).astype(np.int64)

        def work(i):
            r0, r1 = int(bounds[i]), int(bounds[i + 1])
            if r1 > r0:
                lib.quantize_chunk(int(qt), x, out, r0, r1 - r0, imatrix)
    else:
        blk = 256 if qt not in FLOAT_TYPES else 4096
        n_chunks = max(1, min(threads * 2, (n_rows * n_per_row) // (blk * 64)))
        bounds = np.linspace(0, n_rows, n_chunks + 1).astype(np.int64)

        def work(i):
            r0, r1 = int(bounds[i]), int(bounds[i + 1])
            if r1 > r0:
                out[r0:r1] = _numpy_rows(x[r0:r1], qt).reshape(r1 - r0, rb)

    if n_chunks == 1 or threads == 1:
        for i in range(n_chunks):
            work(i)
    else:
        list(_pool(threads).map(work, range(n_chunks)))
    return out


def dequantize(data: np.ndarray, qt: GGMLQuantizationType, shape) -> np.ndarray:
    """gguf-py's dequantizer: raw bytes/typed array -> float32 of the logical shape."""
    qt = parse_type(qt)
    if qt == Q.F32:
        arr = np.asarray(data).view(np.float32)
    elif qt == Q.F16:
        arr = np.asarray(data).view(np.float16).astype(np.float32)
    else:
        arr = gq.dequantize(np.asarray(data).view(np.uint8), qt)
    return np.asarray(arr, dtype=np.float32).reshape(tuple(int(s) for s in shape))
