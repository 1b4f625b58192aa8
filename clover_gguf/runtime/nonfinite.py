"""Which tensor went non-finite first: a debug pass over one denoising step.

When a denoising step's logits or confidences are not finite, clover.h stops with
CLOVER_ERR_NONFINITE and logs the sequence, block, step and position; that says where the
output broke, not why. ``first_nonfinite`` replays the prompt commit and one denoising step on
a second context of the same model with llama.cpp's eval callback (``cb_eval`` of
``llama_context_params``), which sees every node of the graph after it is computed, and
returns the first node whose output holds a NaN or an infinity, with its layer, op and the
weights it read (e.g. ``attn_norm-0 (layer 0, MUL of norm-0 and blk.0.attn_norm.weight)``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from . import bindings as B

GGML_MAX_DIMS, GGML_MAX_SRC, GGML_MAX_OP_PARAMS, GGML_MAX_NAME = 4, 10, 64, 64
GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16 = 0, 1, 30
# ops whose output is another tensor's memory or an input: nothing new is computed there
_NO_COMPUTE = {"NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE", "GET_ROWS_BACK"}


class _GgmlTensor(ctypes.Structure):
    pass


_GgmlTensor._fields_ = [  # ggml.h struct ggml_tensor
    ("type", ctypes.c_int),
    ("buffer", ctypes.c_void_p),
    ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
    ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
    ("op", ctypes.c_int),
    ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
    ("flags", ctypes.c_int32),
    ("src", ctypes.POINTER(_GgmlTensor) * GGML_MAX_SRC),
    ("view_src", ctypes.POINTER(_GgmlTensor)),
    ("view_offs", ctypes.c_size_t),
    ("data", ctypes.c_void_p),
    ("name", ctypes.c_char * GGML_MAX_NAME),
    ("extra", ctypes.c_void_p),
    ("padding", ctypes.c_char * 8),
]


def _ggml_base(lib: B._Lib) -> ctypes.CDLL:
    g = getattr(lib, "_ggml_base", None)
    if g is None:
        d = lib.lib_path.parent
        g = ctypes.CDLL(str(d / "libggml-base.so") if (d / "libggml-base.so").exists() else "libggml-base.so")
        tp, vp = ctypes.POINTER(_GgmlTensor), ctypes.c_void_p
        for name, argtypes, restype in (
            ("ggml_backend_tensor_get", [tp, vp, ctypes.c_size_t, ctypes.c_size_t], None),
            ("ggml_nbytes", [tp], ctypes.c_size_t),
            ("ggml_is_contiguous", [tp], ctypes.c_bool),
            ("ggml_op_name", [ctypes.c_int], ctypes.c_char_p),
        ):
            f = getattr(g, name)
            f.argtypes, f.restype = argtypes, restype
        lib._ggml_base = g
    return g


@dataclass
class Finding:
    node: str  # the graph node, e.g. attn_norm-0
    op: str
    sources: list[str]
    layer: int | None
    stage: str  # "prompt commit" (any commit of the replay) or "denoising step"

    def describe(self) -> str:
        where = f"layer {self.layer}, " if self.layer is not None else ""
        srcs = f" of {' and '.join(self.sources)}" if self.sources else ""
        return f"{self.node} ({where}{self.op}{srcs}, in the {self.stage})"


def _layer(name: str) -> int | None:
    tail = name.rsplit("-", 1)
    return int(tail[1]) if len(tail) == 2 and tail[1].isdigit() else None


class _Watcher:
    """The eval callback: asks for every computed float node, checks it, remembers the first
    non-finite one and from then on asks for nothing (the rest runs at full speed)."""

    def __init__(self, g: ctypes.CDLL):
        self.g = g
        self.found: Finding | None = None
        self.stage = "prompt commit"
        self.checked = 0

    def _float_node(self, t) -> bool:
        if t.type not in (GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16):
            return False
        return self.g.ggml_op_name(t.op).decode() not in _NO_COMPUTE

    def __call__(self, tp, ask, _user) -> bool:
        if self.found is not None:
            return not ask  # want nothing more; keep computing
        p = ctypes.cast(tp, ctypes.POINTER(_GgmlTensor))
        t = p.contents
        if ask:
            return self._float_node(t)
        if not self.g.ggml_is_contiguous(p):
            return True
        self.checked += 1
        n = int(self.g.ggml_nbytes(p))
        buf = np.empty(n, dtype=np.uint8)
        self.g.ggml_backend_tensor_get(p, buf.ctypes.data_as(ctypes.c_void_p), 0, n)
        if t.type == GGML_TYPE_F32:
            x = buf.view(np.float32)
        elif t.type == GGML_TYPE_F16:
            x = buf.view(np.float16)
        else:  # bf16: the high half of a float32
            x = (buf.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        if not np.isfinite(x).all():
            name = t.name.decode("utf-8", "replace")
            srcs = [t.src[i].contents.name.decode("utf-8", "replace") for i in range(GGML_MAX_SRC) if t.src[i]]
            self.found = Finding(name, self.g.ggml_op_name(t.op).decode(), srcs, _layer(name), self.stage)
        return True


def first_nonfinite(rt, commits: list[tuple[list[int], int]], block: list[int]) -> tuple[Finding | None, int]:
    """Replay ``commits`` ((tokens, block size) in order, as the sequence committed them) and one
    denoising step of ``block`` on a second context of ``rt``'s model with the eval callback:
    (the first non-finite node or None, the number of node outputs checked)."""
    lib, lc = rt._lib, rt._lib.lc
    watcher = _Watcher(_ggml_base(lib))
    cb = lc.ggml_backend_sched_eval_callback(watcher)
    ub = max([rt.n_ubatch, len(block)] + [bs for _, bs in commits])
    n_pos = sum(len(t) for t, _ in commits) + len(block)
    cp = B.context_params(lib, n_ctx=max(ub, n_pos), n_batch=ub, n_ubatch=ub, n_threads=rt.n_threads)
    cp.cb_eval, cp.cb_eval_user_data = cb, None
    with B.stderr_silenced(not rt._log.verbose):
        ctx = lc.llama_init_from_model(rt.model, cp)
        if not ctx:
            return None, 0
        try:
            for toks, bs in commits:
                if toks and watcher.found is None:
                    lib.clover_commit(ctx, B.token_ptr(toks), len(toks), bs)
            if watcher.found is None:
                watcher.stage = "denoising step"
                out = (ctypes.c_float * (len(block) * rt.n_vocab))()
                lib.clover_block_logits(ctx, B.token_ptr(block), len(block), out)
        finally:
            lc.llama_free(ctx)
    return watcher.found, watcher.checked


def explain(found: Finding | None, checked: int) -> str:
    """The tail of a NonFiniteError's message."""
    if found is not None:
        return f"; the first non-finite output is {found.describe()}"
    return (
        f"; a debug pass over the committed tokens and one denoising step found all {checked} outputs finite "
        "(the failing step depends on state this replay does not have)"
    )
