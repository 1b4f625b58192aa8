"""Streaming the tensor data: reader thread -> quantizer -> writer thread.

The reader takes row chunks of each planned tensor from the shards with plain ``pread``s (no
tensor is ever held whole: peak memory is a few chunks, whatever the model size), checks
them for NaN/Inf and brings them to float32 (or passes the bits through unchanged); the
calling thread quantizes them on a thread pool (ggml via ctypes, or numpy); the writer thread
appends them to the output. A failure anywhere stops all three and surfaces as a
``TensorError`` that names the tensor, its source and shard.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import queue
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from ..checkpoint import DTYPES, Checkpoint, CheckpointError
from . import ConvertError, quants
from .tensor_plan import Piece, Plan, PlanEntry

Q = GGMLQuantizationType
CHUNK_ELEMENTS = 2 << 20  # rows are streamed in chunks of about this many values (8 MB f32)


class TensorError(ConvertError):
    """A failure while streaming one tensor: carries the tensor, its source and shard, and
    (set by the converter) the output it was writing."""

    def __init__(self, cause: str, tensor: str, source: str | None = None, shard: Path | None = None):
        super().__init__(cause)
        self.cause, self.tensor, self.source, self.shard = cause, tensor, source, shard
        self.output: Path | None = None

    def __str__(self) -> str:
        s = f"{self.cause} while writing tensor {self.tensor}"
        if self.source is not None:
            s += f" (source {self.source}" + (f" in {self.shard})" if self.shard is not None else ")")
        if self.output is not None:
            s += f" (output {self.output}); no output written"
        return s


class ShardReader:
    """Reads row ranges of 2-D views of safetensors tensors with os.pread."""

    def __init__(self, ck: Checkpoint):
        self.ck = ck
        self._fds: dict[Path, int] = {}
        self._data_start: dict[Path, int] = {}
        self._hdr: dict[Path, dict] = {}
        self._lock = threading.Lock()

    def _open(self, shard: Path) -> int:
        with self._lock:
            if shard not in self._fds:
                fd = os.open(shard, os.O_RDONLY)
                (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
                self._hdr[shard] = json.loads(os.pread(fd, n, 8))
                self._data_start[shard] = 8 + n
                self._fds[shard] = fd
            return self._fds[shard]

    def info(self, name: str) -> tuple[Path, str, tuple[int, ...], int]:
        shard = self.ck.shard_of(name)
        self._open(shard)
        h = self._hdr[shard][name]
        return shard, h["dtype"], tuple(h["shape"]), self._data_start[shard] + h["data_offsets"][0]

    def rows(self, name: str, r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) of the tensor viewed as [prod(shape[:-1]), shape[-1]], source dtype."""
        shard, dtype, shape, off = self.info(name)
        tdt, esize = DTYPES[dtype]
        cols = shape[-1] if shape else 1
        n = (r1 - r0) * cols * esize
        buf = np.empty(n, dtype=np.uint8)  # not zero-filled
        fd = self._fds[shard]
        mv = memoryview(buf)
        got, pos = 0, off + r0 * cols * esize
        while got < n:
            k = os.preadv(fd, [mv[got:]], pos + got)
            if k <= 0:
                raise CheckpointError(f"{shard}: unexpected end of file reading tensor {name}")
            got += k
        return torch.from_numpy(buf).view(tdt).reshape(r1 - r0, cols)

    def close(self):
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_EXP_MASK = {
    torch.bfloat16: (np.int16, 0x7F80),
    torch.float16: (np.int16, 0x7C00),
    torch.float32: (np.int32, 0x7F800000),
    torch.float64: (np.int64, 0x7FF0000000000000),
}


def first_nonfinite(t: torch.Tensor) -> int | None:
    """Flat index of the first NaN/Inf (all exponent bits set), or None. Bit test in numpy:
    ~20x faster than torch.isfinite on BF16."""
    ity, mask = _EXP_MASK[t.dtype]
    v = (
        t.contiguous().view(-1).numpy().view(ity)
        if t.dtype != torch.bfloat16
        else t.contiguous().view(-1).view(torch.int16).numpy()
    )
    m = ity(mask)
    bad = np.bitwise_and(v, m) == m
    if not bad.any():
        return None
    return int(np.argmax(bad))


# A weight of 2^16 = 65536 or more in magnitude gets a warning (one line per tensor): the
# model's arithmetic cannot be trusted with it. Every weight multiplies an activation of RMS 1
# (after an RMS norm; single components up to sqrt(hidden_size) >= 16), so the product is past
# 2^20: beyond F16's largest value (65504), in which ggml computes wherever a weight is F16 (the
# CPU's F16 dot products convert the activations to F16) and in CUDA's F16 GEMMs; and such a
# product compounds through the layers until an RMS norm's F32 sum of squares overflows (past
# 1.8e19), giving NaN logits (issue 26: 3e38 in blk.0.attn_norm.weight). Trained weights are
# orders of magnitude smaller (clover-tiny's largest |w| is 6.75).
BIG_WEIGHT_EXP = 16
_EXP_BITS = {torch.bfloat16: (127, 7), torch.float16: (15, 10), torch.float32: (127, 23), torch.float64: (1023, 52)}


def first_at_least(t: torch.Tensor, exp: int = BIG_WEIGHT_EXP) -> int | None:
    """Flat index of the first value with |x| >= 2**exp (non-finite included), or None: an
    exponent-bits test, as first_nonfinite."""
    ity, mask = _EXP_MASK[t.dtype]
    bias, mant = _EXP_BITS[t.dtype]
    v = (
        t.contiguous().view(-1).numpy().view(ity)
        if t.dtype != torch.bfloat16
        else t.contiguous().view(-1).view(torch.int16).numpy()
    )
    thr = min(mask, (bias + exp) << mant)
    big = np.bitwise_and(v, ity(mask)) >= ity(thr)
    if not big.any():
        return None
    return int(np.argmax(big))


@dataclass
class BigWeight:
    """The first value past the warning bound in one GGUF tensor (and the largest seen)."""

    tensor: str  # GGUF name
    source: str  # HF name
    shard: Path
    row: int
    col: int
    max_abs: float

    def describe(self) -> str:
        return (
            f"{self.tensor}: |w| up to {self.max_abs:.3g} ({self.shard}: tensor {self.source}, first at row "
            f"{self.row}, column {self.col}); weights of 2^{BIG_WEIGHT_EXP} or more overflow the model's "
            "arithmetic (F16 dot products, then the RMS norms' F32 sums of squares): expect non-finite logits"
        )


def source_bytes(t: torch.Tensor):
    """A read chunk's bytes as the weights' fingerprint hashes them (contiguous, source dtype)."""
    return t.contiguous().view(-1).view(torch.uint8).numpy()


def _fixed_mmap_threshold() -> None:
    """glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB), after
    which the 4-8 MB chunks come from the heap, where freed ones stay in the process: a
    conversion's peak RSS then wandered with thread timing (88-137 MiB over the base on the
    360 MiB synthetic of tests/convert/test_convert_memory.py; 72-80 MiB with 4 MiB fixed, for
    about 5 % more time there, the page faults of fresh mappings). glibc only."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 4 << 20)  # M_MMAP_THRESHOLD, no longer dynamic
    except (OSError, AttributeError):
        pass


class SourceScan:
    """What the converter learns from the source values as they stream past: the tensors with
    weights past the warning bound, and the weights' fingerprint (convert/fingerprint.py)."""

    def __init__(self):
        self.big: dict[str, BigWeight] = {}  # GGUF tensor -> its weights past the bound
        self.sha = hashlib.sha256()

    def see(self, entry: PlanEntry, piece: Piece, reader: ShardReader, t: torch.Tensor, r0: int) -> None:
        self.sha.update(source_bytes(t))
        if entry.transform != "a_log":  # an A_log past the bound overflows: refused by _check_range
            _note_big(self.big, entry, piece, reader, t, r0)


def _note_big(big: dict, entry: PlanEntry, piece: Piece, reader: ShardReader, t: torch.Tensor, r0: int) -> None:
    i = first_at_least(t)
    if i is None:
        return
    m = float(t.abs().max())
    if entry.name in big:
        big[entry.name].max_abs = max(big[entry.name].max_abs, m)
        return
    cols = t.shape[-1] if t.dim() else 1
    big[entry.name] = BigWeight(entry.name, piece.hf, reader.ck.shard_of(piece.hf), r0 + i // cols, i % cols, m)


def prepare(entry: PlanEntry, piece: Piece, reader: ShardReader, r0: int, r1: int, scan: SourceScan | None = None):
    """Read rows and bring them to what gets quantized: ('raw', bytes-as-uint8) when the
    bits can be copied unchanged, else ('f32', float32 ndarray [rows, n_per_row]). ``scan``
    sees the source rows (fingerprint, weights past the warning bound)."""
    t = reader.rows(piece.hf, r0, r1)
    bad = first_nonfinite(t)
    if bad is not None:
        cols = t.shape[-1]
        shard = reader.ck.shard_of(piece.hf)
        raise ConvertError(
            f"{shard}: tensor {piece.hf} has a non-finite value (NaN/Inf) at row "
            f"{r0 + bad // cols}, column {bad % cols}; no output written"
        )
    if scan is not None:
        scan.see(entry, piece, reader, t, r0)
    if entry.transform == "a_log":
        t = (-torch.exp(t.double())).float()
    elif entry.transform == "conv":
        t = t.reshape(-1, entry.shape[-1])
    if entry.transform is None:
        # bits copied unchanged: the check above was enough
        if entry.qtype == Q.BF16 and t.dtype == torch.bfloat16:
            return "raw", t.contiguous().view(torch.int16).numpy().view(np.uint8)
        if entry.qtype == Q.F32 and t.dtype == torch.float32:
            return "raw", t.contiguous().numpy().view(np.uint8)
        if entry.qtype == Q.F16 and t.dtype == torch.float16:
            return "raw", t.contiguous().numpy().view(np.uint8)
    x = t.float().contiguous().numpy().reshape(-1, entry.n_per_row)
    _check_range(entry, piece, reader, x, r0)
    return "f32", x


# Largest magnitude each target type stores finitely: F16 itself, and the F16 scales of the
# block formats (a block's scale is about its largest |x| over a small integer); BF16's max.
_MAX_ABS = {Q.F32: float(np.finfo(np.float32).max), Q.BF16: float(torch.finfo(torch.bfloat16).max)}
_F16_MAX = float(np.finfo(np.float16).max)


def _check_range(entry: PlanEntry, piece: Piece, reader: ShardReader, x: np.ndarray, r0: int) -> None:
    """What gets quantized is finite (after the a_log transform, or an F64 -> F32 cast) and
    within what the target type can store."""
    lim = _MAX_ABS.get(entry.qtype, _F16_MAX)
    with np.errstate(invalid="ignore"):
        bad = ~(np.abs(x) <= lim)  # NaN compares False: bad too
    if not bad.any():
        return
    i = int(np.argmax(bad.reshape(-1)))
    v = float(x.reshape(-1)[i])
    row, col = i // entry.n_per_row, i % entry.n_per_row
    where = f"{reader.ck.shard_of(piece.hf)}: tensor {piece.hf}"
    if entry.transform or not np.isfinite(v):
        what = f"becomes {v:g} in {entry.name}" + (" (stored as -exp(A_log))" if entry.transform == "a_log" else "")
    else:
        what = f"has {v:g}, more than type {quants.type_name(entry.qtype)} of {entry.name} stores (|x| <= {lim:g})"
    raise ConvertError(f"{where} {what} at row {r0 + row}, column {col}; no output written")


def chunks(entry: PlanEntry, reader: ShardReader):
    """(piece, r0, r1) row ranges of at most ~CHUNK_ELEMENTS values, in output order."""
    for p in entry.pieces:
        _, _, shape, _ = reader.info(p.hf)
        cols = shape[-1] if shape else 1
        step = max(1, CHUNK_ELEMENTS // cols)
        for r in range(p.r0, p.r1, step):
            yield p, r, min(p.r1, r + step)


_STOP = object()


def _get(q: queue.Queue):
    """q.get(), waking up now and then: a SIGTERM raised in the main thread while it waits on a
    queue can leave that queue's condition with a lost wake-up (a SIGTERMed conversion hung in
    the writer's join about once in 40 runs); polling makes that harmless."""
    while True:
        try:
            return q.get(timeout=0.2)
        except queue.Empty:
            continue


class Pipeline:
    """Writes the data section of a plan to an open file (positioned at the data start)."""

    def __init__(self, plan: Plan, reader: ShardReader, imatrix, threads: int, progress: bool):
        self.plan, self.reader, self.imatrix = plan, reader, imatrix
        self.threads, self.progress = threads, progress
        self._errors: list[BaseException] = []
        self._stop = threading.Event()
        self.scan = SourceScan()

    # ---- errors ------------------------------------------------------------------------
    def _fail(self, exc: BaseException, entry: PlanEntry | None, piece: Piece | None) -> None:
        """Record the first failure, as a TensorError unless it already names its tensor."""
        if isinstance(exc, Exception) and not isinstance(exc, ConvertError):
            cause = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
            if entry is None:
                wrapped = ConvertError(f"{cause} while opening the checkpoint's shards")
            else:
                shard = None
                if piece is not None:
                    try:
                        shard = self.reader.ck.shard_of(piece.hf)
                    except CheckpointError:
                        pass
                wrapped = TensorError(cause, entry.name, piece.hf if piece else None, shard)
            wrapped.__cause__ = exc
            exc = wrapped
        self._errors.append(exc)
        self._stop.set()

    # ---- the three stages ----------------------------------------------------------------
    def _read(self, in_q: queue.Queue) -> None:
        e = p = None
        try:
            for e in self.plan.entries:
                for p, r0, r1 in chunks(e, self.reader):
                    if self._stop.is_set():
                        return
                    kind, data = prepare(e, p, self.reader, r0, r1, self.scan)
                    _, dt, shape, _ = self.reader.info(p.hf)
                    nsrc = (r1 - r0) * DTYPES[dt][1] * (shape[-1] if shape else 1)
                    in_q.put((e, p, kind, data, nsrc))
                in_q.put((e, None, "end", None, 0))
        except BaseException as exc:
            self._fail(exc, e, p)
        finally:
            in_q.put(_STOP)

    def _write(self, out_q: queue.Queue, fout, align: int) -> None:
        # keeps draining out_q after an error so that the quantizer never blocks on put()
        while True:
            item = _get(out_q)
            if item is _STOP:
                return
            if self._stop.is_set():
                continue
            e, data = item
            try:
                if data is None:  # end of tensor: pad to the alignment
                    pad = (-fout.tell()) % align
                    if pad:
                        fout.write(b"\0" * pad)
                else:
                    fout.write(memoryview(data).cast("B"))
            except BaseException as exc:
                self._fail(exc, e, None)

    def _quantize(self, e: PlanEntry, p: Piece, data: np.ndarray) -> np.ndarray:
        w = None
        if self.imatrix is not None and quants.uses_imatrix(e.qtype):
            wm = self.imatrix.get(e.name)
            if wm is not None:
                w = wm[p.im_index] if wm.shape[0] > 1 else wm[0]
        return quants.quantize_rows(data, e.qtype, imatrix=w, backend=e.backend, threads=self.threads)

    def run(self, fout, align: int) -> None:
        _fixed_mmap_threshold()
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(
                total=self.plan.src_bytes,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc="converting",
                dynamic_ncols=True,
                smoothing=0.1,
            )
        in_q: queue.Queue = queue.Queue(maxsize=2)
        out_q: queue.Queue = queue.Queue(maxsize=2)
        rt = threading.Thread(target=self._read, args=(in_q,), name="clover-read", daemon=True)
        wt = threading.Thread(target=self._write, args=(out_q, fout, align), name="clover-write", daemon=True)
        rt.start()
        wt.start()
        written = {e.name: 0 for e in self.plan.entries}
        e = None
        try:
            while not self._stop.is_set():
                item = _get(in_q)
                if item is _STOP:
                    break
                e, p, kind, data, nsrc = item
                if kind == "end":
                    if written[e.name] != e.nbytes:
                        raise ConvertError(
                            f"internal error: tensor {e.name} wrote {written[e.name]} bytes, planned {e.nbytes}"
                        )
                    out_q.put((e, None))
                    if bar is not None:
                        bar.set_postfix_str(e.name, refresh=False)
                    continue
                try:
                    q = data if kind == "raw" else self._quantize(e, p, data)
                except Exception as exc:
                    self._fail(exc, e, p)
                    break
                written[e.name] += q.nbytes
                out_q.put((e, q))
                if bar is not None:
                    bar.update(nsrc)
        except BaseException as exc:
            self._stop.set()
            if isinstance(exc, KeyboardInterrupt) and e is not None:
                exc.add_note(f"interrupted while writing tensor {e.name}")
            raise
        finally:
            self._finish(rt, in_q, out_q, wt, bar)
        if self._errors:
            raise self._errors[0]

    def _finish(self, rt, in_q, out_q, wt, bar) -> None:
        """Let the reader exit (draining its queue), then stop the writer once it has written
        everything queued (or skipped it, after a failure)."""
        while rt.is_alive():
            try:
                in_q.get(timeout=0.05)
            except queue.Empty:
                pass
        out_q.put(_STOP)
        wt.join()
        if bar is not None:
            bar.close()
