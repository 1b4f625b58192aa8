"""The conversion plan: one entry per GGUF tensor, with its type (recipes.TypeRules),
llama.cpp's fallback when a row is not a multiple of the block, its size, and the source
rows it is made of. Built from the checkpoint's headers alone; ``--dry-run`` prints it."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from gguf import GGMLQuantizationType

from ..checkpoint import DTYPES, Checkpoint
from ..config import CloverConfig
from ..constants import (
    EXPERT_PROJS,
    GGUF_EXPERT_NAME,
    HF_EXPERT_FUSED_DOWN,
    HF_EXPERT_FUSED_GATE_UP,
    HF_EXPERT_PER,
    hf_to_gguf_name,
    spec_for_hf,
    tensor_group,
)
from . import ConvertError, quants
from .recipes import TypeRules


@dataclass
class Piece:
    """Rows [r0, r1) of source tensor `hf` (2-D view), and the imatrix row to use."""

    hf: str
    r0: int
    r1: int
    im_index: int = 0


@dataclass
class PlanEntry:
    name: str  # GGUF tensor name
    shape: tuple[int, ...]  # numpy/torch order as stored in the GGUF
    qtype: GGMLQuantizationType
    requested: GGMLQuantizationType
    why: str  # rule that chose the type
    fallback: str | None  # llama.cpp fallback note
    group: str
    pieces: list[Piece]  # source rows, in output order
    transform: str | None  # None | "a_log" | "conv"
    src_bytes: int
    nbytes: int
    imatrix: str = "-"  # "yes" | "no data" | "-" (type ignores it / none given)
    backend: str = "numpy"

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def n_per_row(self) -> int:
        return self.shape[-1]


@dataclass
class Plan:
    config: CloverConfig
    layout: str
    rules: TypeRules
    entries: list[PlanEntry]
    model_dir: Path

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def src_bytes(self) -> int:
        return sum(e.src_bytes for e in self.entries)

    @property
    def n_params(self) -> int:
        return sum(e.n_elements for e in self.entries)

    @property
    def bpw(self) -> float:
        return 8.0 * self.total_bytes / max(1, self.n_params)

    def fallbacks(self) -> list[tuple[str, str]]:
        return [(e.name, e.fallback) for e in self.entries if e.fallback]

    def table(self, verbose: bool = True) -> str:
        lines = []
        w = max(len(e.name) for e in self.entries)
        hdr = f"{'tensor':<{w}}  {'shape':<20} {'type':<7} {'size':>11} {'bpw':>6}  note"
        lines.append(hdr)
        lines.append("-" * len(hdr))
        for e in self.entries:
            if not verbose and re.match(r"^blk\.(?!0\.)\d+\.", e.name):
                continue
            note = e.why
            if e.fallback:
                note += f"; FALLBACK {e.fallback}"
            if e.imatrix not in ("-",):
                note += f"; imatrix {e.imatrix}"
            lines.append(
                f"{e.name:<{w}}  {str(list(e.shape)):<20} {quants.type_name(e.qtype):<7} "
                f"{fmt_bytes(e.nbytes):>11} {8.0 * e.nbytes / e.n_elements:6.2f}  {note}"
            )
        if not verbose and self.config.num_hidden_layers > 1:
            lines.append(f"... (layers 1..{self.config.num_hidden_layers - 1} as layer 0)")
        lines.append("-" * len(hdr))
        by_type: dict[str, list[int]] = {}
        for e in self.entries:
            s = by_type.setdefault(quants.type_name(e.qtype), [0, 0, 0])
            s[0] += 1
            s[1] += e.n_elements
            s[2] += e.nbytes
        for t, (n, el, b) in sorted(by_type.items(), key=lambda kv: -kv[1][2]):
            lines.append(f"  {t:<7} {n:5d} tensors {el / 1e6:12.2f} M weights {fmt_bytes(b):>11}")
        lines.append(
            f"total: {len(self.entries)} tensors, {self.n_params / 1e6:.2f} M weights, "
            f"{fmt_bytes(self.total_bytes)} ({self.bpw:.3f} bits per weight); "
            f"source {fmt_bytes(self.src_bytes)}"
        )
        lines.append(f"types: {self.rules.describe()}")
        fb = self.fallbacks()
        if fb:
            lines.append(f"fallbacks: {len(fb)} tensor(s) (llama.cpp's rule: row not a multiple of the block)")
        return "\n".join(lines)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"  # pragma: no cover


def _hf_rows(shape: tuple[int, ...]) -> int:
    return math.prod(shape[:-1]) if len(shape) > 1 else 1


def _expert_pieces(ck: Checkpoint, bid: int, proj: str) -> tuple[tuple[int, int, int], list[Piece]]:
    """(stacked shape [E, rows, cols], one piece per expert) of a layer's routed experts."""
    c = ck.config
    E, Fe = c.num_experts, c.moe_intermediate_size
    rows, cols = (Fe, c.hidden_size) if proj != "down" else (c.hidden_size, Fe)
    pieces = []
    for x in range(E):
        if ck.layout != "fused":
            pieces.append(Piece(HF_EXPERT_PER.format(bid=bid, xid=x, proj=proj), 0, rows, x))
        elif proj == "down":
            pieces.append(Piece(HF_EXPERT_FUSED_DOWN.format(bid=bid), x * rows, (x + 1) * rows, x))
        else:
            base = x * 2 * Fe + (0 if proj == "gate" else Fe)
            pieces.append(Piece(HF_EXPERT_FUSED_GATE_UP.format(bid=bid), base, base + Fe, x))
    return (E, rows, cols), pieces


def source_entries(ck: Checkpoint):
    """(gguf name, out shape, pieces, transform) in output order."""
    expected = ck.config.expected_tensors(fused=ck.layout == "fused")
    done_experts: set[int] = set()
    for hf, shape in expected.items():
        m = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.", hf)
        if m:
            bid = int(m.group(1))
            if bid not in done_experts:
                done_experts.add(bid)
                for proj in EXPERT_PROJS:
                    yield GGUF_EXPERT_NAME[proj].format(bid=bid), *_expert_pieces(ck, bid, proj), None
            continue
        transform = spec_for_hf(hf).transform
        out_shape = (shape[0], shape[2]) if transform == "conv" else tuple(shape)
        yield hf_to_gguf_name(hf), out_shape, [Piece(hf, 0, _hf_rows(shape), 0)], transform


def _src_bytes(ck: Checkpoint, pieces: list[Piece]) -> int:
    total = 0
    for p in pieces:
        shape = ck.shape(p.hf)
        total += (p.r1 - p.r0) * (shape[-1] if shape else 1) * DTYPES[ck.dtype(p.hf)][1]
    return total


def build_plan(ck: Checkpoint, rules: TypeRules, imatrix=None, backend: str = "auto") -> Plan:
    """The plan of a validated checkpoint; raises ConvertError for a type it cannot write."""
    entries = []
    for name, shape, pieces, transform in source_entries(ck):
        req, why = rules.choose(name, shape)
        qt, fb = quants.fallback_type(req, shape[-1])
        e = PlanEntry(
            name=name,
            shape=shape,
            qtype=qt,
            requested=req,
            why=why,
            fallback=fb,
            group=tensor_group(name),
            pieces=pieces,
            transform=transform,
            src_bytes=_src_bytes(ck, pieces),
            nbytes=quants.tensor_bytes(qt, shape),
        )
        if imatrix is not None and quants.uses_imatrix(qt):
            e.imatrix = "yes" if imatrix.get(name) is not None else "no data"
        if quants.requires_imatrix(qt) and e.imatrix != "yes":
            raise ConvertError(
                f"tensor {name}: type {quants.type_name(qt)} requires an importance matrix (--imatrix) with data for it"
            )
        try:
            e.backend = quants.backend_for(qt, e.imatrix == "yes", backend)
        except quants.QuantBackendError as exc:
            raise ConvertError(str(exc)) from None
        entries.append(e)
    unused = rules.unused_overrides(e.why for e in entries)
    if unused:
        raise ConvertError(
            f"--tensor-type {unused[0]!r} matches no tensor whose type it can set "
            "(1-D tensors, ssm_conv1d and mem_key stay F32; the first matching override wins)"
        )
    return Plan(ck.config, ck.layout, rules, entries, ck.dir)


def check_imatrix(plan: Plan, imatrix, path) -> None:
    """Every imatrix entry the plan uses has one row of n_per_row values per matrix."""
    by_name = {e.name: e for e in plan.entries}
    for nm, w in imatrix.entries.items():
        e = by_name.get(nm)
        if e is None:
            continue
        n_mat = e.shape[0] if e.group.startswith("experts") else 1
        if w.shape != (n_mat, e.n_per_row) and e.group != "embeddings":
            raise ConvertError(
                f"{path}: imatrix entry {nm} has shape {list(w.shape)}, tensor needs [{n_mat}, {e.n_per_row}]"
            )
