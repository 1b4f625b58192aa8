#!/usr/bin/env python3
"""Fuzz the loaders and the generation of a Clover GGUF: llama-clover-cli and the Python side
(inspect, the GGUF reader, CloverRuntime), on mutants of two small valid files.

    python tests/fuzz/fuzz_gguf.py --iterations 130            # the CI campaign (fails on any finding)
    python tests/fuzz/fuzz_gguf.py --iterations 5000 --seed 7  # a long one
    python tests/fuzz/fuzz_gguf.py --replay tests/data/fuzz    # the kept inputs again

Two base files: ``spec`` (the spec's random-clover, converted with the default recipe, run on
prompt ids) and ``tiny`` (clover-tiny: the real BPE vocabulary, merges and chat template, run on
a text prompt, and in Python also through the chat template and the detokenizer);
``--tiny-share`` of the mutants start from tiny. A mutant is

* random byte flips in the metadata, or a structured change to one key (type, huge, zero,
  negative, NaN/Inf, strings, arrays: count, duplicates; the key given twice; token strings
  that are not UTF-8, all of them or a few), one tensor info (dims, n_dims, type, offset, name;
  retyped to another ggml type whose blocks fit its rows, often the last tensor, whose size
  nothing but the data layout check sees, its bytes zeroed half the time) or the header counts;
* a change to one tensor's data: NaN, Inf, a huge finite value or zero, in one element or the
  whole tensor of a float type, or in the scale or all bytes of one block of a quantized one;
* weights that are not the reference's under its fingerprint: the twin's file (another model
  of the same shapes and tokens: clover-tiny-v3-wip, a synthetic random-clover) with the base's
  fingerprint, one tensor's bytes from the twin, a float tensor perturbed; or the fingerprint
  edited;
* the file cut short.

Every mutant runs through ``llama-clover-cli`` in a subprocess and, in a worker process,
``inspect``, ``load_gguf_as_hf_tensors``, ``CloverRuntime`` (generate, and the logits of one
denoising step) and ``match`` (`eval`'s check that the file is a conversion of the base's
reference, eval/quality/run.check_matches_reference), each under a memory limit (RLIMIT_AS) and
a timeout. Outcomes:

* ``ok``: it ran and its output is the unmutated file's; ``changed``: it ran and its output
  differs, which the mutation explains (it touched something generation reads);
* ``clean``: refused: exit 1 with one ``error:`` line / a documented exception, one line;
* findings: ``crash`` (a signal), ``hang`` (timeout), ``unclean`` (any other exit or
  exception, or more than one line), ``nonfinite`` (exit 0 with non-finite logits), ``differs``
  (it ran and its output differs although the mutation touched only what generation never
  reads: general.name, clover_gguf.* provenance, ...), ``accepted`` (``match`` took a
  fingerprint mutant for a conversion of the reference).

Findings are kept in ``--keep`` (default tests/data/fuzz/) with a ``.txt`` saying what happened;
``tests/runtime/test_fuzz.py`` replays them. Exit status 1 on any finding.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import resource
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KEEP = REPO / "tests" / "data" / "fuzz"
PROMPT_IDS = "1,2,3,4,5,6,7,8,9,10,11"
TEXT_PROMPT = "def fibonacci(n):"
CHAT = [{"role": "user", "content": "Write a loop"}]
N_PREDICT = 16
MEM_LIMIT = 4 << 30  # address space a target may add
CLI: Path | None = None  # --cli
TIMEOUT = 30.0
GOOD = ("ok", "changed", "clean")

sys.path.insert(0, str(REPO))  # this checkout's clover_gguf, also when run as a script
from clover_gguf.gguf_io.codec import (  # noqa: E402
    ARR,
    BOOL,
    F32,
    F64,
    I8,
    I16,
    I32,
    I64,
    INT_TYPES,
    KV,
    STR,
    U8,
    U16,
    U32,
    U64,
    Gguf,
    TensorInfo,
    parse,
    serialize,
    tensor_span,
    value_spans,
)

# Keys generation never reads: a mutant that changes only these must give the base's output.
UNREAD_KEYS = {
    b"general.name",
    b"general.size_label",
    b"general.license",
    b"clover_gguf.recipe",
    b"clover_gguf.version",
    b"clover_gguf.source_config_sha256",
    b"clover_gguf.source_weights_sha256",
    b"clover_gguf.source_expert_layout",
}


@dataclass
class Base:
    """A valid base file and what it gives unmutated (per target, its output)."""

    kind: str  # "spec" | "tiny"
    path: Path
    raw: bytes
    g: Gguf
    meta_len: int
    unread: list  # byte ranges of UNREAD_KEYS' values
    expected: dict = field(default_factory=dict)
    twin: Gguf | None = None  # another model of the same shapes and tokens, the same recipe


def load_base(kind: str, path: Path, twin: Path | None = None) -> Base:
    raw = path.read_bytes()
    g = parse(raw)
    data, meta_len = serialize(g)
    assert data == raw, "the codec does not round-trip the base file"
    unread = [span for k, span in value_spans(g).items() if k in UNREAD_KEYS]
    return Base(kind, path, raw, g, meta_len, unread, twin=parse(twin.read_bytes()) if twin else None)


# ---- mutations of the metadata ----------------------------------------------------------------


def _copy(g: Gguf) -> Gguf:
    """A copy the mutations may change in place (the arrays' lists copied, their items shared:
    a deep copy of tiny's 8,000 token strings and merges would dominate an iteration)."""
    kvs = [
        KV(kv.key, kv.type, (kv.value[0], list(kv.value[1])) if kv.type == ARR else kv.value, kv.count) for kv in g.kvs
    ]
    tis = [TensorInfo(t.name, list(t.dims), t.type, t.offset, t.n_dims) for t in g.tis]
    return Gguf(g.version, kvs, tis, g.data, g.n_kv, g.n_tensors)


def _other_value(rng, t):
    """A value of type t, often an extreme one."""
    if t == STR:
        return rng.choice([b"", b"none", b"\xff\xfe", b"x" * 70000, b"gpt2", b"qwen2"])
    if t == F32 or t == F64:
        return rng.choice([0.0, -1.0, 1e38, float("inf"), float("-inf"), float("nan"), 1e-45, 3.0])
    if t == BOOL:
        return rng.choice([0, 1, 2, 255])
    lo, hi = {U8: (0, 255), I8: (-128, 127), U16: (0, 65535), I16: (-32768, 32767), U32: (0, 2**32 - 1),
              I32: (-(2**31), 2**31 - 1), U64: (0, 2**64 - 1), I64: (-(2**63), 2**63 - 1)}[t]  # fmt: skip
    return rng.choice([lo, hi, 0, 1, 2, 3, 7, max(lo, -5), min(hi, 1 << 20), min(hi, 10**9), rng.randint(lo, hi)])


def mutate_kv(rng, g: Gguf) -> str:
    kv = rng.choice(g.kvs)
    k = kv.key.decode("utf-8", "replace")
    if rng.random() < 0.08:  # ggml's parser and the Python reader refuse a key given twice
        if kv.type == ARR:
            value = (kv.value[0], list(kv.value[1]))
        else:
            value = kv.value if rng.random() < 0.5 else _other_value(rng, kv.type)
        twin = KV(kv.key, kv.type, value, kv.count)
        g.kvs.insert(rng.randrange(len(g.kvs) + 1), twin)
        return f"kv {k}: duplicate key"
    if rng.random() < 0.05:
        return mutate_tokens(rng, g)
    if kv.type == ARR:
        sub, items = kv.value
        op = rng.choice(["count+", "count-", "count-huge", "dup", "empty", "elem", "subtype", "type", "truncate"])
        if op == "count+":
            kv.count = len(items) + rng.randint(1, 10)
        elif op == "count-":
            kv.count = max(0, len(items) - rng.randint(1, 10))
        elif op == "count-huge":
            kv.count = rng.choice([2**32, 2**62, 2**64 - 1])
        elif op == "dup" and len(items) > 1:
            i, j = rng.sample(range(len(items)), 2)
            items[i] = items[j]
        elif op == "empty":
            kv.value = (sub, [])
        elif op == "elem" and items:
            i = rng.randrange(len(items))
            items[i] = _other_value(rng, sub)
        elif op == "subtype":
            new = rng.choice([t for t in range(13) if t not in (sub, ARR)])
            kv.value = (new, [_other_value(rng, new) for _ in items[:50]])
        elif op == "truncate":
            kv.value = (sub, items[: rng.randint(0, max(0, len(items) - 1))])
        else:
            new = rng.choice([U32, F32, STR])
            kv.type, kv.value = new, _other_value(rng, new)
        return f"kv {k}: array {op}"
    op = rng.choice(["type", "huge", "zero", "negative", "nan", "inf", "value", "remove", "rename"])
    if op == "type":
        new = rng.choice([t for t in range(13) if t != kv.type])
        kv.type = new
        kv.value = (U32, [1, 2]) if new == ARR else _other_value(rng, new)
    elif op == "remove":
        g.kvs.remove(kv)
    elif op == "rename":
        b = bytearray(kv.key)
        b[rng.randrange(len(b))] = rng.randrange(32, 127)
        kv.key = bytes(b)
    elif kv.type == STR:
        kv.value = _other_value(rng, STR)
    elif op in ("huge", "zero", "negative", "nan", "inf"):
        if kv.type in (F32, F64):
            kv.value = {"huge": 1e38, "zero": 0.0, "negative": -1.0, "nan": float("nan"), "inf": float("inf")}[op]
        elif kv.type in INT_TYPES or kv.type == BOOL:
            if op == "huge":
                kv.value = rng.choice([2**32 - 1, 10**9, 2**31]) if kv.type in (U32, I32, U64, I64) else 255
                if kv.type == I32:
                    kv.value = 2**31 - 1
            elif op == "zero":
                kv.value = 0
            elif op == "negative":
                kv.type, kv.value = I32, -5
            else:
                kv.type, kv.value = F32, float(op)
    else:
        kv.value = _other_value(rng, kv.type)
    return f"kv {k}: {op}"


def mutate_tokens(rng, g: Gguf) -> str:
    """Token strings that are not UTF-8 (still unique): every one past the specials, so that a
    text prompt tokenizes to nothing (llama-clover-cli and `run` refuse it), or a few."""
    kv = next(kv for kv in g.kvs if kv.key == b"tokenizer.ggml.tokens")
    sub, toks = kv.value
    if rng.random() < 0.5:
        kv.value = (sub, [t if i < 6 else b"\xff\xfe%d" % i for i, t in enumerate(toks)])
        return "kv tokenizer.ggml.tokens: invalid UTF-8 (all)"
    toks = list(toks)
    for i in rng.sample(range(len(toks)), min(len(toks), rng.choice([1, 5, 50]))):
        toks[i] = toks[i] + b"\xc3"  # a lead byte with no continuation
    kv.value = (sub, toks)
    return "kv tokenizer.ggml.tokens: invalid UTF-8 (some)"


def _retype(rng, g: Gguf, ti: TensorInfo) -> str:
    """Another ggml type whose blocks fit the rows, mostly of another size; the last tensor's
    bytes zeroed half the time (finite in any type: llama.cpp's NaN check then does not catch
    the retype, the data layout check must)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    old = (
        GGML_QUANT_SIZES.get(GGMLQuantizationType(ti.type))
        if ti.type in GGMLQuantizationType._value2member_map_
        else None
    )
    fits = [
        int(q)
        for q, (blk, size) in GGML_QUANT_SIZES.items()
        if int(q) != ti.type and ti.dims and ti.dims[0] % blk == 0 and q.name not in ("Q8_K",)
    ]
    if not fits:
        return "unchanged"
    ti.type = rng.choice(fits)
    last = max(g.tis, key=lambda t: t.offset)
    note = ""
    if ti is last and rng.random() < 0.5:
        g.data = g.data[: ti.offset] + bytes(len(g.data) - ti.offset)
        note = ", its bytes zeroed"
    new = GGML_QUANT_SIZES[GGMLQuantizationType(ti.type)]
    same = old is not None and old[1] * new[0] == new[1] * old[0]
    return f"retype to {GGMLQuantizationType(ti.type).name} ({'same' if same else 'other'} size{note})"


def mutate_tensor(rng, g: Gguf) -> str:
    ti = rng.choice(g.tis)
    n = ti.name.decode("utf-8", "replace")
    op = rng.choice(
        ["dim0", "dim-huge", "dim+1", "swap", "n_dims", "type", "offset", "offset-huge", "name-dup", "rename"]
        + ["retype"] * 3
    )
    if op == "retype":
        if rng.random() < 0.5:
            ti = max(g.tis, key=lambda t: t.offset)  # the last tensor: its size is checked by no one else
            n = ti.name.decode("utf-8", "replace")
        return f"tensor {n}: {_retype(rng, g, ti)}"
    if op == "dim0":
        ti.dims[rng.randrange(len(ti.dims))] = 0
    elif op == "dim-huge":
        ti.dims[rng.randrange(len(ti.dims))] = rng.choice([2**31, 2**40, 2**62, 2**64 - 1])
    elif op == "dim+1":
        i = rng.randrange(len(ti.dims))
        ti.dims[i] += rng.choice([1, -1 if ti.dims[i] > 1 else 1, 32])
    elif op == "swap" and len(ti.dims) > 1:
        ti.dims.reverse()
    elif op == "n_dims":
        ti.n_dims = rng.choice([0, 5, 9, 2**31])
        if ti.n_dims <= 8:
            ti.dims = (ti.dims + [1] * 8)[: ti.n_dims]
            ti.n_dims = None
    elif op == "type":
        ti.type = rng.choice(list(range(0, 45)) + [255, 2**31])
    elif op == "offset":
        ti.offset = rng.choice([o.offset for o in g.tis] + [ti.offset + 1, ti.offset + 32])
    elif op == "offset-huge":
        ti.offset = rng.choice([len(g.data), 2**40, 2**64 - 32])
    elif op == "name-dup":
        ti.name = rng.choice(g.tis).name
    else:
        b = bytearray(ti.name)
        b[rng.randrange(len(b))] = rng.randrange(32, 127)
        ti.name = bytes(b)
    return f"tensor {n}: {op}"


def mutate_header(rng, g: Gguf) -> str:
    op = rng.choice(["n_kv", "n_tensors", "version"])
    if op == "n_kv":
        g.n_kv = rng.choice([len(g.kvs) + 1, len(g.kvs) - 1, 0, 2**63])
    elif op == "n_tensors":
        g.n_tensors = rng.choice([len(g.tis) + 1, len(g.tis) - 1, 0, 2**63])
    else:
        g.version = rng.choice([0, 1, 2, 4, 2**32 - 1])
    return f"header: {op}"


def byte_flips(rng, base: Base) -> tuple[bytes, str, bool]:
    b = bytearray(base.raw)
    k = rng.choice([1, 1, 2, 3, 8])
    unread = base.unread if rng.random() < 0.2 else []  # sometimes aim at values nothing reads
    offsets = []
    for _ in range(k):
        if unread:
            lo, hi = rng.choice(unread)
            i = rng.randrange(lo, hi) if hi > lo else rng.randrange(base.meta_len)
        else:
            i = rng.randrange(base.meta_len)
        b[i] = b[i] ^ (1 << rng.randrange(8)) if rng.random() < 0.5 else rng.randrange(256)
        offsets.append(i)
    same = all(any(lo <= i < hi for lo, hi in base.unread) for i in offsets)
    return bytes(b), f"{k} byte flip(s) in the metadata{' (values nothing reads)' if same else ''}", same


# ---- mutations of the tensor data ---------------------------------------------------------------

# ggml type -> (struct format or raw, NaN, Inf, huge finite) of the float types
_FLOAT = {
    0: ("<f", struct.pack("<f", math.nan), struct.pack("<f", math.inf), struct.pack("<f", 3e38)),
    1: ("<e", b"\x00\x7e", b"\x00\x7c", b"\xff\x7b"),  # F16: 65504
    30: ("bf16", b"\xc0\x7f", b"\x80\x7f", b"\x7f\x7f"),  # BF16: 3.39e38
}
_QUANT_SCALE = {"nan": b"\x00\x7e", "inf": b"\x00\x7c", "huge": b"\xff\x7b", "zero": b"\x00\x00"}


def mutate_data(rng, g: Gguf) -> str:
    """NaN, Inf, a huge finite value or zero in one tensor's data: one element or all of a float
    tensor; the leading F16 scale or all bytes of one block of a quantized one."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    ti = rng.choice(g.tis)
    span = tensor_span(ti)
    name = ti.name.decode("utf-8", "replace")
    if span is None or span[1] == 0:
        return f"data {name}: unknown type {ti.type}, unchanged"
    off, n = span
    op = rng.choice(["nan", "inf", "huge", "zero"])
    data = bytearray(g.data)
    if ti.type in _FLOAT:
        fmt, nan, inf, huge = _FLOAT[ti.type]
        esize = 4 if ti.type == 0 else 2
        val = {"nan": nan, "inf": inf, "huge": huge, "zero": b"\0" * esize}[op]
        if rng.random() < 0.5:
            data[off : off + n] = val * (n // esize)
            where = "all"
        else:
            i = rng.randrange(n // esize)
            data[off + i * esize : off + (i + 1) * esize] = val
            where = f"element {i}"
    else:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ti.type)]
        i = rng.randrange(n // size)
        b0 = off + i * size
        if rng.random() < 0.5:  # the block's first F16 (d: its scale in the Q*_0/Q*_K/IQ* formats)
            data[b0 : b0 + 2] = _QUANT_SCALE[op]
            where = f"block {i} scale"
        else:
            data[b0 : b0 + size] = (b"\xff" if op in ("nan", "inf", "huge") else b"\0") * size
            where = f"block {i} all bytes"
    g.data = bytes(data)
    return f"data {name}: {op} ({where})"


def truncate(rng, base: Base) -> tuple[bytes, str]:
    n = len(base.raw)
    cut = rng.choice([rng.randrange(base.meta_len), rng.randrange(base.meta_len, n), n - rng.randrange(1, 64)])
    return base.raw[:cut], f"truncate at {cut} of {n} bytes"


FINGERPRINT_KEY = b"clover_gguf.source_weights_sha256"
MUST_REFUSE = "fingerprint:"  # mutants `eval` must refuse (the match target): other weights


def mutate_fingerprint(rng, base: Base, g: Gguf) -> tuple[str, bool]:
    """Weights that are not the reference's under its fingerprint (the value left as it is, or
    copied over), or the fingerprint itself edited: `eval` must refuse each whatever the value
    says (issue 47). (what, whether generation must give the base's output)."""
    fp = next(kv for kv in g.kvs if kv.key == FINGERPRINT_KEY)
    op = rng.choice(["value", "other-model", "other-tensor", "scaled"] if base.twin else ["value", "scaled"])
    if op == "value":
        fp.value = bytes(rng.choice(b"0123456789abcdef") for _ in range(64))
        return f"{MUST_REFUSE} another value", True
    if op == "other-model":  # the twin's file with the base's fingerprint (the v3 GGUF with v2's)
        twin = _copy(base.twin)
        next(kv for kv in twin.kvs if kv.key == FINGERPRINT_KEY).value = fp.value
        g.kvs, g.tis, g.data = twin.kvs, twin.tis, twin.data
        return f"{MUST_REFUSE} another model's weights", False
    if op == "other-tensor":  # one tensor's bytes from the twin (same type and size)
        by_name = {t.name: t for t in base.twin.tis}
        cands = []
        for ti in g.tis:
            span, other = tensor_span(ti), by_name.get(ti.name)
            if span and other is not None and other.type == ti.type and span[1]:
                a = g.data[ti.offset : ti.offset + span[1]]
                b = base.twin.data[other.offset : other.offset + span[1]]
                if a != b:
                    cands.append((ti, b))
        if not cands:
            return "weights: unchanged (the twin's tensors are the base's)", True
        ti, b = rng.choice(cands)
        g.data = g.data[: ti.offset] + b + g.data[ti.offset + len(b) :]
        return f"{MUST_REFUSE} tensor {ti.name.decode()} from another model", False
    floats = [t for t in g.tis if t.type in (0, 1, 30) and tensor_span(t)[1]]  # F32, F16, BF16
    ti = rng.choice(floats)
    off, n = tensor_span(ti)
    if ti.type == 0:
        x = struct.unpack(f"<{n // 4}f", g.data[off : off + n])
        b = struct.pack(f"<{n // 4}f", *(v * 1.25 for v in x))
    else:  # the high byte of F16/BF16 holds sign and exponent: a step of the exponent doubles
        b = bytes(
            v if i % 2 == 0 or (v & 0x7F) in (0x00, 0x7F, 0x7E) else v + 1 for i, v in enumerate(g.data[off : off + n])
        )
    if b == g.data[off : off + n]:
        return "weights: unchanged", True
    g.data = g.data[:off] + b + g.data[off + n :]
    return f"{MUST_REFUSE} tensor {ti.name.decode()} scaled", False


def mutant(rng, base: Base) -> tuple[bytes, str, bool]:
    """(mutant bytes, what was done, whether generation must give the base's output)."""
    kind = rng.random()
    if kind < 0.25:
        return byte_flips(rng, base)
    if kind < 0.9:
        g = _copy(base.g)
        if kind < 0.55:
            what = mutate_kv(rng, g)
            key = what[3:].split(":")[0].encode()
            same = key in UNREAD_KEYS and not what.endswith("duplicate key")
        elif kind < 0.85:
            what = (mutate_tensor if kind < 0.65 else mutate_header if kind < 0.68 else mutate_data)(rng, g)
            same = what.endswith("unchanged")
        else:
            what, same = mutate_fingerprint(rng, base, g)
        return serialize(g)[0], what, same
    data, what = truncate(rng, base)
    return data, what, False


# ---- running the targets ------------------------------------------------------------------------


def _limit(extra: int):
    def f():
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if not extra:
            return
        vm = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (vm + extra, vm + extra))

    return f


def run_cli(cli: Path, path: Path, timeout: float, kind: str = "spec") -> tuple[str, str, str]:
    """(outcome, detail, output): llama-clover-cli on the spec base's prompt ids, or the tiny
    base's text prompt (its tokenizer), printing the text and the ids."""
    prompt = ["--prompt-ids", PROMPT_IDS] if kind == "spec" else ["-p", TEXT_PROMPT]
    try:
        r = subprocess.run(
            [str(cli), "-m", str(path), *prompt, "-n", str(N_PREDICT), "-t", "1", "--verbose-prompt"],
            capture_output=True,
            timeout=timeout,
            preexec_fn=_limit(MEM_LIMIT),
        )
    except subprocess.TimeoutExpired:
        return "hang", f"no exit after {timeout:g} s", ""
    err = r.stderr.decode("utf-8", "replace").strip()
    if r.returncode < 0:
        return "crash", f"signal {signal.Signals(-r.returncode).name}: {err[-2000:]}", ""
    if r.returncode == 0:
        return "ok", "", r.stdout.decode("utf-8", "replace")
    if r.returncode == 1 and err.startswith("error: ") and "\n" not in err:
        return "clean", err, ""
    return "unclean", f"exit {r.returncode}: {err[-2000:]}", ""


def _generation(path: Path, kind: str) -> str:
    """CloverRuntime on the mutant: generate (text through the tokenizer and the chat template on
    tiny), then the logits of one denoising step, which must be finite. The output as JSON."""
    import numpy as np

    from clover_gguf.reference.generate import GenerationConfig
    from clover_gguf.runtime.runtime import CloverRuntime

    rt = CloverRuntime(path, n_threads=1)
    try:
        out = {}
        if kind == "spec":
            ids = [int(x) for x in PROMPT_IDS.split(",")]
        else:
            from clover_gguf.generation.run import check_prompt_tokens

            ids = rt.tokenize(TEXT_PROMPT)
            check_prompt_tokens(ids)  # `run`'s rule (and llama-clover-cli's): tokens that match nothing
            out["chat"] = rt.chat_prompt(CHAT, enable_thinking=False)
        res = rt.generate(ids, GenerationConfig(max_new_tokens=N_PREDICT, block_size=rt.default_block_size))
        out["ids"] = res.tokens
        if kind != "spec":
            out["text"] = rt.detokenize(res.tokens)
        rt.reset()
        rt.commit(ids, rt.default_block_size)
        lg = rt.block_logits_np([rt.mask_token_id] * rt.default_block_size)
        lg[:, rt.mask_token_id] = 0.0  # the mask token's column is never a prediction
        if not np.isfinite(lg).all():
            raise NonFiniteOutput(f"exit 0 but {int((~np.isfinite(lg)).sum())} non-finite logits in a denoising step")
        return json.dumps(out, sort_keys=True)
    finally:
        rt.close()


class NonFiniteOutput(Exception):
    pass


REFERENCES = {
    "spec": REPO / "tests" / "data" / "spec-vectors" / "random-clover",
    "tiny": REPO / "models" / "clover-tiny",
}
_REF_SHA: dict = {}


def _match(path: Path, kind: str) -> None:
    """`eval`'s check that the file is a conversion of its base's reference (config, shapes,
    tokens, fingerprint, a few rows of every tensor's weights)."""
    from clover_gguf.checkpoint import Checkpoint
    from clover_gguf.config import CloverConfig
    from clover_gguf.convert.fingerprint import weights_sha256
    from clover_gguf.eval.quality.run import check_matches_reference

    ref = REFERENCES[kind]
    if kind not in _REF_SHA:
        _REF_SHA[kind] = (CloverConfig.load(ref), weights_sha256(Checkpoint(ref)))
    cfg, sha = _REF_SHA[kind]
    check_matches_reference(path, ref, cfg, lambda: sha)


def _python_checks(path: Path, kind: str = "spec") -> dict:
    """In the worker: each Python entry point either works or raises its documented error."""
    from clover_gguf.gguf_io.inspection import format_inspection, inspect_path
    from clover_gguf.gguf_io.reader import GGUFReadError, load_gguf_as_hf_tensors
    from clover_gguf.runtime.runtime import RuntimeError_

    out = {}

    def check(name, fn, clean_types):
        try:
            r = fn()
            out[name] = ["ok", "", r if isinstance(r, str) else ""]
        except NonFiniteOutput as e:
            out[name] = ["nonfinite", str(e), ""]
        except clean_types as e:
            msg = str(e)
            out[name] = ["clean", msg, ""] if "\n" not in msg.strip() else ["unclean", msg, ""]
        except BaseException as e:  # noqa: BLE001 - any other exception is a finding
            import traceback

            out[name] = ["unclean", "".join(traceback.format_exception(e))[-3000:], ""]

    check("inspect", lambda: format_inspection(inspect_path(path), show_tensors=True) and None, (ValueError,))
    if kind == "spec":  # dequantizing all of tiny costs 10x its other targets and reads no tokenizer
        check("reader", lambda: load_gguf_as_hf_tensors(path) and None, (GGUFReadError,))
    check("runtime", lambda: _generation(path, kind), (RuntimeError_, ValueError))
    from clover_gguf.errors import CloverError

    check("match", lambda: _match(path, kind), (CloverError,))
    return out


class PythonWorker:
    """A subprocess that imports clover_gguf (torch, libllama) once and runs _python_checks on
    one path per request, under RLIMIT_AS. A crash or hang is that input's; the worker is then
    replaced. (Forking this process per input is not an option: the OpenMP runtime of ggml's
    CPU backend does not survive a fork.)"""

    def __init__(self):
        self.proc = None

    def _start(self):
        self.rd, w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", str(w), "--mem-limit-gb", str(MEM_LIMIT / 2**30)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(w,),
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)),
            cwd=REPO,
        )
        os.close(w)
        self.buf = b""
        self._request("")  # wait until it has imported everything

    def _request(self, line: str, timeout: float = 300.0):
        self.proc.stdin.write((line + "\n").encode())
        self.proc.stdin.flush()
        t0 = time.time()
        while b"\n" not in self.buf:
            left = timeout - (time.time() - t0)
            r, _, _ = select.select([self.rd], [], [], max(0.0, left))
            if not r:
                return None  # timeout
            chunk = os.read(self.rd, 1 << 16)
            if not chunk:
                return b""  # the worker died
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def _stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            os.close(self.rd)
            self.proc = None

    def check(self, path: Path, timeout: float, kind: str = "spec") -> dict[str, tuple[str, str, str]]:
        res = self._check(path, timeout, kind)
        if "python" in res and self.proc is None:
            # the worker died: the cause may be an earlier input's (a corrupted heap); try alone
            again = self._check(path, timeout, kind)
            if "python" not in again:
                outcome, detail, _ = res["python"]
                why = f"{detail}, but not when run alone: an earlier input left the process broken"
                return {"python": (outcome, why, "")}
        return res

    def _check(self, path: Path, timeout: float, kind: str) -> dict[str, tuple[str, str, str]]:
        if self.proc is None:
            self._start()
        got = self._request(f"{kind}\t{path}", timeout)
        if got is None:
            self._stop()
            return {"python": ("hang", f"no answer after {timeout:g} s", "")}
        if not got:
            rc = self.proc.wait()
            self._stop()
            if rc < 0:
                return {"python": ("crash", f"signal {signal.Signals(-rc).name}", "")}
            return {"python": ("unclean", f"worker exit {rc}", "")}
        return {k: tuple(v) for k, v in json.loads(got).items()}

    def close(self):
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
            os.close(self.rd)
            self.proc = None


def worker_main(fd: int) -> None:
    """The worker's loop: one "kind<TAB>path" per line on stdin, one JSON line on fd."""
    import torch

    torch.set_num_threads(1)
    _limit(MEM_LIMIT)()
    out = os.fdopen(fd, "w")
    for line in sys.stdin:
        kind, _, path = line.rstrip("\n").partition("\t")
        res = _python_checks(Path(path), kind) if path else {}
        out.write(json.dumps(res) + "\n")
        out.flush()


# ---- the campaign ----------------------------------------------------------------------------------


@dataclass
class Tally:
    counts: dict = field(default_factory=dict)  # target -> outcome -> n
    findings: list = field(default_factory=list)

    def add(self, target: str, outcome: str) -> None:
        self.counts.setdefault(target, {}).setdefault(outcome, 0)
        self.counts[target][outcome] += 1

    @property
    def bad(self) -> int:
        return sum(n for c in self.counts.values() for o, n in c.items() if o not in GOOD)


def twin_files(work: Path) -> dict[str, Path]:
    """Each base's twin: another model of its shapes and tokens, converted alike (the fingerprint
    mutants' other weights): a synthetic random-clover of another seed; clover-tiny-v3-wip."""
    from clover_gguf.config import CloverConfig
    from clover_gguf.convert.converter import convert
    from clover_gguf.synthetic import write_synthetic

    out = {}
    for kind in ("spec", "tiny"):
        p = work / f"twin-{kind}.gguf"
        if not p.exists():
            src = REPO / "models" / "clover-tiny-v3-wip"
            if kind == "spec":
                src = work / "twin-spec-model"
                write_synthetic(src, CloverConfig.load(REFERENCES["spec"]), seed=7, progress=False)
            convert(src, p, progress=False)
        out[kind] = p
    return out


def base_files(work: Path) -> dict[str, Path]:
    """spec: random-clover with the default recipe (experts Q4_K -> Q5_0 fallback); tiny:
    clover-tiny with its tokenizer and chat template (experts Q4_K)."""
    from clover_gguf.convert.converter import convert

    out = {}
    for kind, src in (
        ("spec", REPO / "tests" / "data" / "spec-vectors" / "random-clover"),
        ("tiny", REPO / "models" / "clover-tiny"),
    ):
        p = work / f"base-{kind}.gguf"
        if not p.exists():
            convert(src, p, progress=False)
        out[kind] = p
    return out


def find_cli() -> Path:
    if CLI is not None:
        return CLI
    from clover_gguf.runtime import bindings

    lib = Path(bindings.load().lib_path)
    for d in (lib.parent.parent / "bin", lib.parent):  # a runtime dir (lib/ + bin/) or a build's bin/
        if (d / "llama-clover-cli").exists():
            return d / "llama-clover-cli"
    from clover_gguf.runtime.build import runtime_paths

    p = Path(runtime_paths()["bin_dir"]) / "llama-clover-cli"
    if not p.exists():
        raise SystemExit(f"llama-clover-cli not found next to {lib} or in {p.parent}: run `clover-gguf runtime build`")
    return p


def judge(results: dict, base: Base | None, same: bool, refuse: bool = False) -> dict[str, tuple[str, str]]:
    """Each target's outcome, with a run that gave output compared with the base's: the same
    (ok), different for a reason (changed), different without one (differs); and `eval`'s match
    accepting weights that are not its reference's (accepted) when ``refuse``."""
    out = {}
    for target, (outcome, detail, output) in results.items():
        if target == "match" and refuse and outcome == "ok":
            outcome, detail = "accepted", "eval took it for a conversion of the reference"
        elif outcome == "ok" and base is not None and target in base.expected and output != base.expected[target]:
            if same:
                outcome, detail = "differs", f"output {output[:300]!r}, the base's {base.expected[target][:300]!r}"
            else:
                outcome = "changed"
        out[target] = (outcome, detail)
    return out


def check_one(data: bytes, what: str, cli: Path, py: PythonWorker, tally: Tally, keep, timeout: float, tmp: Path,
              base: Base | None = None, same: bool = False, kind: str = "spec") -> list:  # fmt: skip
    kind = base.kind if base is not None else kind
    path = tmp / "mutant.gguf"
    path.write_bytes(data)
    results = {"cli": run_cli(cli, path, timeout, kind), **py.check(path, timeout, kind)}
    results = judge(results, base, same, refuse=what.split(": ", 1)[-1].startswith(MUST_REFUSE))
    bad = []
    for target, (outcome, detail) in results.items():
        tally.add(target, outcome)
        if outcome not in GOOD:
            bad.append((target, outcome, detail))
    if bad and keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256(data).hexdigest()[:12]
        name = f"{bad[0][1]}-{bad[0][0]}-{kind}-{h}"
        (keep / f"{name}.gguf").write_bytes(data)
        (keep / f"{name}.txt").write_text(what + "\n" + "\n".join(f"{t}: {o}: {d}" for t, o, d in bad) + "\n")
    if bad:
        tally.findings.append((what, bad))
    return bad


def _expected(base: Base, cli: Path, py: PythonWorker, timeout: float) -> None:
    """Run the unmutated base everywhere: it must work, and its outputs are what mutants that
    change nothing generation reads must give."""
    got = {"cli": run_cli(cli, base.path, timeout, base.kind), **py.check(base.path, timeout, base.kind)}
    for target, (outcome, detail, output) in got.items():
        if outcome != "ok":
            raise SystemExit(f"the unmutated {base.kind} base fails in {target}: {outcome}: {detail}")
        if target in ("cli", "runtime"):
            base.expected[target] = output
    if not base.expected["cli"].strip():
        raise SystemExit(f"the unmutated {base.kind} base generates nothing in llama-clover-cli")


def campaign(iterations: int, seed: int, keep: Path | None, timeout: float = TIMEOUT, log=print,
             tiny_share: float = 0.25, base_dir: Path | None = None) -> Tally:  # fmt: skip
    """base_dir: where base_files finds (or converts) the bases; default the campaign's temp folder."""
    cli = find_cli()
    tally = Tally()
    rng = random.Random(seed)
    py = PythonWorker()
    with tempfile.TemporaryDirectory(prefix="clover-fuzz-") as td:
        tmp = Path(td)
        twins = twin_files(base_dir or tmp)
        bases = {k: load_base(k, p, twins[k]) for k, p in base_files(base_dir or tmp).items()}
        for b in bases.values():
            _expected(b, cli, py, timeout)
        t0 = time.time()
        for i in range(iterations):
            base = bases["tiny" if rng.random() < tiny_share else "spec"]
            data, what, same = mutant(rng, base)
            what = f"{base.kind}: {what}"
            for target, outcome, detail in check_one(data, what, cli, py, tally, keep, timeout, tmp, base, same):
                log(f"[{i}] {what}: {target} {outcome}: {detail.splitlines()[-1] if detail else ''}")
            if (i + 1) % 100 == 0:
                log(f"{i + 1}/{iterations} in {time.time() - t0:.0f} s: {json.dumps(tally.counts)}")
        py.close()
    return tally


def replay(folder: Path, timeout: float = TIMEOUT) -> Tally:
    """The kept inputs, each run as its base was (the kind is in the name: -tiny-)."""
    cli = find_cli()
    tally = Tally()
    py = PythonWorker()
    with tempfile.TemporaryDirectory(prefix="clover-fuzz-") as td:
        for f in sorted(folder.glob("*.gguf")):
            kind = "tiny" if "-tiny-" in f.name else "spec"
            bad = check_one(f.read_bytes(), f.name, cli, py, tally, None, timeout, Path(td), kind=kind)
            for target, outcome, detail in bad:
                print(f"{f.name}: {target} {outcome}: {detail.splitlines()[-1] if detail else ''}")
        py.close()
    return tally


def main(argv=None) -> int:
    global MEM_LIMIT, CLI
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--iterations", type=int, default=130)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tiny-share", type=float, default=0.25, help="Share of mutants of the clover-tiny base.")
    ap.add_argument("--keep", type=Path, default=KEEP, help="Where failing inputs are kept (default tests/data/fuzz).")
    ap.add_argument("--no-keep", action="store_true", help="Keep nothing.")
    ap.add_argument("--timeout", type=float, default=TIMEOUT, help="Seconds per target and input.")
    ap.add_argument("--replay", type=Path, help="Run the kept inputs of this folder instead of mutants.")
    ap.add_argument("--cli", type=Path, help="llama-clover-cli to run (default: the built runtime's).")
    ap.add_argument(
        "--mem-limit-gb",
        type=float,
        default=MEM_LIMIT / 2**30,
        help="Address space a target may add (0: none, for ASan).",
    )
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    MEM_LIMIT, CLI = int(a.mem_limit_gb * 2**30), a.cli
    if a.worker is not None:
        worker_main(a.worker)
        return 0
    if a.iterations < 0 or not math.isfinite(a.timeout) or a.timeout <= 0 or not 0 <= a.tiny_share <= 1:
        ap.error("--iterations must be >= 0, --timeout > 0 and --tiny-share in [0, 1]")
    t0 = time.time()
    if a.replay:
        tally = replay(a.replay, a.timeout)
    else:
        tally = campaign(a.iterations, a.seed, None if a.no_keep else a.keep, a.timeout, tiny_share=a.tiny_share)
    print(f"done in {time.time() - t0:.0f} s: {json.dumps(tally.counts)}")
    print(f"findings (crash, hang, unclean, nonfinite, differs, accepted): {tally.bad}")
    return 1 if tally.bad else 0


if __name__ == "__main__":
    sys.exit(main())
