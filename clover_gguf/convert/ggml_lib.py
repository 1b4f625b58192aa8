"""ctypes bindings to ggml's own quantizer (libggml-base from a llama.cpp build).

Only the handful of functions the converter needs:

    ggml_quantize_chunk(type, src f32, dst, start, nrows, n_per_row, imatrix) -> bytes written
    ggml_quantize_requires_imatrix(type) -> bool
    ggml_quantize_init(type)
    ggml_row_size(type, n) / ggml_blck_size(type) / ggml_type_size(type)

Where the library is looked for, in order (the first that exists wins):

1. ``$CLOVER_GGML_LIB``: the library file itself, or a folder holding it;
2. ``$LLAMA_CPP_LIB_PATH`` (llama-cpp-python's own override): a folder;
3. the installed ``llama_cpp`` package's ``lib/`` folder (what ``clover-gguf runtime build``
   installs, the project's runtime);
4. ``build/runtime/**`` and ``build/**`` under the repository root.

ctypes releases the GIL during foreign calls, so quantizing row chunks from a thread pool
uses every core.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from pathlib import Path

import numpy as np

from ..errors import CloverError
from ..util import REPO_ROOT

LIB_ENV = "CLOVER_GGML_LIB"
LLAMA_CPP_ENV = "LLAMA_CPP_LIB_PATH"

if sys.platform == "darwin":
    _LIB_NAMES = ("libggml-base.dylib",)
elif sys.platform == "win32":
    _LIB_NAMES = ("ggml-base.dll",)
else:
    _LIB_NAMES = ("libggml-base.so",)

BUILD_HINT = (
    "libggml-base (ggml's quantizer) was not found. Build the project's llama.cpp runtime "
    "with `clover-gguf runtime build` (it installs the patched llama-cpp-python, whose "
    f"lib/ folder holds libggml-base), or point ${LIB_ENV} at a libggml-base shared library "
    "(a file or its folder) from any llama.cpp build "
    "(cmake -DBUILD_SHARED_LIBS=ON ... && cmake --build . --target ggml-base)."
)


class GGMLLibError(CloverError, RuntimeError):
    """libggml is missing or unusable."""


def _candidates_in(folder: Path) -> list[Path]:
    out = []
    for name in _LIB_NAMES:
        p = folder / name
        if p.exists():
            out.append(p)
    return out


def _llama_cpp_lib_dir() -> Path | None:
    from ..runtime.build import installed_llama_cpp_lib_dir

    d = installed_llama_cpp_lib_dir()
    return d if d is not None and d.is_dir() else None


def candidate_paths() -> list[Path]:
    """Every place libggml-base is looked for, in priority order (existing files only)."""
    out: list[Path] = []
    env = os.environ.get(LIB_ENV)
    if env:
        p = Path(env)
        out += [p] if p.is_file() else _candidates_in(p)
    env = os.environ.get(LLAMA_CPP_ENV)
    if env:
        out += _candidates_in(Path(env))
    d = _llama_cpp_lib_dir()
    if d is not None:
        out += _candidates_in(d)
    for base in (REPO_ROOT / "build" / "runtime", REPO_ROOT / "build"):
        if base.is_dir():
            for name in _LIB_NAMES:
                out += sorted(base.rglob(name))
    seen, uniq = set(), []
    for p in out:
        if p not in seen:
            seen.add(p)
            uniq.append(p)
    return uniq


class GGMLLib:
    """A loaded libggml-base."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            lib = ctypes.CDLL(str(self.path))
        except OSError as e:
            raise GGMLLibError(f"{self.path}: cannot load ({e}). {BUILD_HINT}") from None
        try:
            lib.ggml_quantize_chunk.argtypes = [
                ctypes.c_int,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_int64,
                ctypes.c_int64,
                ctypes.c_int64,
                ctypes.c_void_p,
            ]
            lib.ggml_quantize_chunk.restype = ctypes.c_size_t
            lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
            lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
            lib.ggml_quantize_init.argtypes = [ctypes.c_int]
            lib.ggml_quantize_init.restype = None
            lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
            lib.ggml_row_size.restype = ctypes.c_size_t
            lib.ggml_blck_size.argtypes = [ctypes.c_int]
            lib.ggml_blck_size.restype = ctypes.c_int64
            lib.ggml_type_size.argtypes = [ctypes.c_int]
            lib.ggml_type_size.restype = ctypes.c_size_t
            lib.ggml_type_name.argtypes = [ctypes.c_int]
            lib.ggml_type_name.restype = ctypes.c_char_p
        except AttributeError as e:
            raise GGMLLibError(f"{self.path}: not a libggml-base ({e}). {BUILD_HINT}") from None
        self._lib = lib
        self._init_lock = threading.Lock()
        self._inited: set[int] = set()

    # -- small wrappers -----------------------------------------------------------------
    def requires_imatrix(self, qtype: int) -> bool:
        return bool(self._lib.ggml_quantize_requires_imatrix(int(qtype)))

    def row_size(self, qtype: int, n_per_row: int) -> int:
        return int(self._lib.ggml_row_size(int(qtype), int(n_per_row)))

    def blck_size(self, qtype: int) -> int:
        return int(self._lib.ggml_blck_size(int(qtype)))

    def type_size(self, qtype: int) -> int:
        return int(self._lib.ggml_type_size(int(qtype)))

    def type_name(self, qtype: int) -> str:
        return self._lib.ggml_type_name(int(qtype)).decode()

    def init(self, qtype: int) -> None:
        """ggml_quantize_init (builds the IQ grids once); thread-safe."""
        with self._init_lock:
            if int(qtype) not in self._inited:
                self._lib.ggml_quantize_init(int(qtype))
                self._inited.add(int(qtype))

    def quantize_chunk(
        self, qtype: int, src: np.ndarray, dst: np.ndarray, row0: int, nrows: int, imatrix: np.ndarray | None = None
    ) -> int:
        """Quantize rows [row0, row0+nrows) of the C-contiguous float32 matrix ``src``
        [n, n_per_row] into the uint8 buffer ``dst`` [n, row_size] (same rows).
        Returns the number of bytes written. Releases the GIL."""
        assert src.dtype == np.float32 and src.flags.c_contiguous and src.ndim == 2
        assert dst.dtype == np.uint8 and dst.flags.c_contiguous
        n_per_row = src.shape[1]
        blck = self.blck_size(qtype)
        if n_per_row % blck:
            # ggml would abort the process; fail in Python instead
            raise ValueError(f"row length {n_per_row} is not a multiple of {self.type_name(qtype)}'s block {blck}")
        if imatrix is None and self.requires_imatrix(qtype):
            raise ValueError(f"{self.type_name(qtype)} requires an importance matrix")
        if dst.nbytes < src.shape[0] * self.row_size(qtype, n_per_row):
            raise ValueError("destination buffer too small")
        im_ptr = None
        if imatrix is not None:
            assert imatrix.dtype == np.float32 and imatrix.shape == (n_per_row,) and imatrix.flags.c_contiguous
            im_ptr = imatrix.ctypes.data
        return int(
            self._lib.ggml_quantize_chunk(
                int(qtype), src.ctypes.data, dst.ctypes.data, int(row0) * n_per_row, int(nrows), n_per_row, im_ptr
            )
        )


_lib: GGMLLib | None = None
_lib_lock = threading.Lock()
_load_error: str | None = None


def find_lib_path() -> Path | None:
    c = candidate_paths()
    return c[0] if c else None


def load(required: bool = True) -> GGMLLib | None:
    """The process-wide libggml, loaded on first use. With required=False, None when absent."""
    global _lib, _load_error
    with _lib_lock:
        if _lib is not None:
            return _lib
        errors = []
        for p in candidate_paths():
            try:
                _lib = GGMLLib(p)
                return _lib
            except GGMLLibError as e:
                errors.append(str(e))
        _load_error = "; ".join(errors) if errors else BUILD_HINT
    if required:
        raise GGMLLibError(_load_error)
    return None


def available() -> bool:
    return load(required=False) is not None


def reset() -> None:
    """Forget the loaded library (tests that change the environment)."""
    global _lib, _load_error
    with _lib_lock:
        _lib = None
        _load_error = None
