"""A minimal GGUF byte codec: parse a file into its header, key/values, tensor infos and data,
and write one back, byte for byte. Unlike gguf-py it also writes what a reader must refuse
(array counts, dimension counts and header counts that lie, any type number, any offset): the
GGUF fuzzer (tests/fuzz/fuzz_gguf.py) and the tests of damaged files build their inputs with it.
``tensor_data``/``set_tensor_data`` read and replace one tensor's bytes (the fuzzer's
tensor-data mutations)."""

from __future__ import annotations

import struct
from dataclasses import dataclass

GGUF_MAGIC = 0x46554747

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
SCALAR = {
    U8: "<B",
    I8: "<b",
    U16: "<H",
    I16: "<h",
    U32: "<I",
    I32: "<i",
    F32: "<f",
    BOOL: "<B",
    U64: "<Q",
    I64: "<q",
    F64: "<d",
}
INT_TYPES = (U8, I8, U16, I16, U32, I32, U64, I64)


@dataclass
class KV:
    key: bytes
    type: int
    value: object  # int/float/bytes, or (subtype, [values]) for ARR
    count: int | None = None  # declared array length when it must lie


@dataclass
class TensorInfo:
    name: bytes
    dims: list[int]
    type: int
    offset: int
    n_dims: int | None = None  # declared when it must lie


@dataclass
class Gguf:
    version: int
    kvs: list[KV]
    tis: list[TensorInfo]
    data: bytes
    n_kv: int | None = None
    n_tensors: int | None = None

    @property
    def alignment(self) -> int:
        for kv in self.kvs:
            if kv.key == b"general.alignment" and kv.type == U32:
                return kv.value
        return 32


class _Reader:
    def __init__(self, raw: bytes):
        self.raw, self.pos = raw, 0

    def take(self, fmt):
        v = struct.unpack_from(fmt, self.raw, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> bytes:
        n = self.take("<Q")
        s = self.raw[self.pos : self.pos + n]
        self.pos += n
        return s

    def value(self, t):
        if t == STR:
            return self.string()
        if t == ARR:
            sub, n = self.take("<I"), self.take("<Q")
            return (sub, [self.value(sub) for _ in range(n)])
        return self.take(SCALAR[t])


def parse(raw: bytes) -> Gguf:
    """The (valid) base file."""
    r = _Reader(raw)
    if r.take("<I") != GGUF_MAGIC:
        raise ValueError("not a GGUF file")
    version, n_t, n_kv = r.take("<I"), r.take("<Q"), r.take("<Q")
    kvs = []
    for _ in range(n_kv):
        key = r.string()
        t = r.take("<I")
        kvs.append(KV(key, t, r.value(t)))
    tis = []
    for _ in range(n_t):
        name = r.string()
        nd = r.take("<I")
        dims = [r.take("<Q") for _ in range(nd)]
        tis.append(TensorInfo(name, dims, r.take("<I"), r.take("<Q")))
    g = Gguf(version, kvs, tis, b"")
    start = -(-r.pos // g.alignment) * g.alignment
    g.data = raw[start:]
    return g


def _pack_value(t, v) -> bytes:
    if t == STR:
        return struct.pack("<Q", len(v)) + v
    if t == ARR:
        sub, items = v
        return struct.pack("<IQ", sub, len(items)) + b"".join(_pack_value(sub, x) for x in items)
    return struct.pack(SCALAR[t], v)


def serialize(g: Gguf) -> tuple[bytes, int]:
    """(file bytes, size of the metadata region before the data)."""
    out = [struct.pack("<IIQQ", GGUF_MAGIC, g.version, len(g.tis) if g.n_tensors is None else g.n_tensors,
                       len(g.kvs) if g.n_kv is None else g.n_kv)]  # fmt: skip
    for kv in g.kvs:
        body = _pack_value(kv.type, kv.value)
        if kv.type == ARR and kv.count is not None:
            body = body[:4] + struct.pack("<Q", kv.count) + body[12:]
        out.append(struct.pack("<Q", len(kv.key)) + kv.key + struct.pack("<I", kv.type) + body)
    for ti in g.tis:
        nd = len(ti.dims) if ti.n_dims is None else ti.n_dims
        out.append(
            struct.pack("<Q", len(ti.name))
            + ti.name
            + struct.pack("<I", nd)
            + b"".join(struct.pack("<Q", d) for d in ti.dims)
            + struct.pack("<IQ", ti.type, ti.offset)
        )
    meta = b"".join(out)
    a = g.alignment if g.alignment > 0 else 32
    meta += b"\0" * (-len(meta) % a)
    return meta + g.data, len(meta)


def value_spans(g: Gguf) -> dict[bytes, tuple[int, int]]:
    """key -> byte range of its value's content in serialize(g)'s output, for scalar and string
    key/values (a string's bytes without its length): where a byte flip changes the value and
    nothing else."""
    pos = struct.calcsize("<IIQQ")
    out = {}
    for kv in g.kvs:
        pos += 8 + len(kv.key) + 4
        body = len(_pack_value(kv.type, kv.value))
        if kv.type == STR:
            out[kv.key] = (pos + 8, pos + body)
        elif kv.type != ARR:
            out[kv.key] = (pos, pos + body)
        pos += body
    return out


def tensor_span(ti: TensorInfo) -> tuple[int, int] | None:
    """(offset, bytes) of a tensor's data in Gguf.data, for the float and quantized types gguf-py
    knows; None for another type number."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ti.type)]
    except (ValueError, KeyError):
        return None
    n = 1
    for d in ti.dims:
        n *= d
    return ti.offset, n // block * size


def tensor_nbytes(ti: TensorInfo) -> int | None:
    """Bytes of a tensor of a float type (F32, F16, BF16); None for the others."""
    size = {0: 4, 1: 2, 30: 2}.get(ti.type)
    if size is None:
        return None
    n = 1
    for d in ti.dims:
        n *= d
    return n * size


def tensor_data(g: Gguf, name: bytes) -> tuple[TensorInfo, bytes]:
    """(info, bytes) of a tensor of a float type, by name."""
    ti = next(t for t in g.tis if t.name == name)
    n = tensor_nbytes(ti)
    if n is None:
        raise ValueError(f"{name!r}: ggml type {ti.type} is not F32/F16/BF16")
    return ti, g.data[ti.offset : ti.offset + n]


def set_tensor_data(g: Gguf, name: bytes, data: bytes) -> None:
    """Replace a float tensor's bytes (same length)."""
    ti, old = tensor_data(g, name)
    if len(data) != len(old):
        raise ValueError(f"{name!r}: {len(data)} bytes given, the tensor has {len(old)}")
    g.data = g.data[: ti.offset] + data + g.data[ti.offset + len(data) :]
