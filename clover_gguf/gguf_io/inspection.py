"""`clover-gguf inspect`: metadata and a per-group table (constants.TENSOR_GROUPS) of
types, sizes and bits per weight, for a GGUF file or a safetensors model dir (whose
tensors are grouped under the GGUF names they will get)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..constants import GGUF_EXPERT_NAME, TENSOR_GROUPS, hf_to_gguf_name, tensor_group


@dataclass
class GroupStats:
    n_tensors: int = 0
    n_weights: int = 0
    n_bytes: int = 0
    types: dict[str, int] = field(default_factory=dict)  # type -> weights

    @property
    def bpw(self) -> float:
        return 8.0 * self.n_bytes / max(1, self.n_weights)


@dataclass
class Inspection:
    path: Path
    kind: str  # "gguf" | "safetensors"
    metadata: dict
    tensors: list[tuple[str, tuple[int, ...], str, int]]  # name, shape, type, bytes
    groups: dict[str, GroupStats]

    @property
    def n_weights(self) -> int:
        return sum(g.n_weights for g in self.groups.values())

    @property
    def n_bytes(self) -> int:
        return sum(g.n_bytes for g in self.groups.values())


def _group(tensors) -> dict[str, GroupStats]:
    groups = {g: GroupStats() for g in list(TENSOR_GROUPS) + ["other"]}
    for name, shape, typ, nb in tensors:
        g = groups[tensor_group(name)]
        n = math.prod(shape)
        g.n_tensors += 1
        g.n_weights += n
        g.n_bytes += nb
        g.types[typ] = g.types.get(typ, 0) + n
    return {k: v for k, v in groups.items() if v.n_tensors}


def _short(v, limit=80):
    if isinstance(v, list):
        if len(v) > 8:
            return f"[{len(v)} items: {', '.join(map(repr, v[:3]))}, ...]"
        return repr(v)
    s = str(v)
    s = s.replace("\n", "\\n")
    return s if len(s) <= limit else s[:limit] + f"... ({len(s)} chars)"


def inspect_gguf(path) -> Inspection:
    from .reader import GGUFReadError, open_gguf

    r = open_gguf(path)
    md = {}
    for k, f in r.fields.items():
        if not k.startswith("GGUF."):
            try:
                md[k] = f.contents()
            except Exception:  # a value gguf-py cannot decode (e.g. a string that is not UTF-8)
                md[k] = "<undecodable " + "/".join(t.name.lower() for t in f.types) + ">"
    try:
        tensors = [
            (t.name, tuple(int(s) for s in reversed(t.shape.tolist())), t.tensor_type.name.lower(), int(t.n_bytes))
            for t in r.tensors
        ]
    except Exception as e:
        raise GGUFReadError(
            f"{path}: not a valid GGUF file ({type(e).__name__}: {' '.join(str(e).split())[:300]})"
        ) from None
    return Inspection(Path(path), "gguf", md, tensors, _group(tensors))


def inspect_model_dir(path) -> Inspection:
    from ..checkpoint import Checkpoint

    ck = Checkpoint(path)
    c = ck.config
    md = {"config": c.to_dict(), "layout": ck.layout, "shards": len({ck.shard_of(n) for n in ck.names()})}
    tensors = []
    for n in ck.names():
        shape, dt, nb = ck.shape(n), ck.dtype(n).lower(), ck.nbytes(n)
        g = hf_to_gguf_name(n)
        if g is None:
            m = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(?:\d+\.)?(gate|up|down|gate_up)_proj", n)
            if m:
                proj = "gate" if m.group(2) == "gate_up" else m.group(2)
                g = GGUF_EXPERT_NAME[proj].format(bid=m.group(1))
            else:
                g = n
        tensors.append((g, shape, dt, nb))
    return Inspection(Path(path), "safetensors", md, tensors, _group(tensors))


def inspect_path(path) -> Inspection:
    p = Path(path)
    if p.is_dir():
        return inspect_model_dir(p)
    if p.suffix == ".safetensors":
        return inspect_model_dir(p.parent)
    return inspect_gguf(p)


def format_inspection(ins: Inspection, show_tensors: bool = False, show_metadata: bool = True) -> str:
    lines = [f"{ins.path} ({ins.kind})"]
    if show_metadata:
        lines.append("metadata:")
        md = ins.metadata.get("config", ins.metadata) if ins.kind == "safetensors" else ins.metadata
        for k, v in md.items():
            lines.append(f"  {k:<48} {_short(v)}")
        if ins.kind == "safetensors":
            lines.append(f"  {'layout':<48} {ins.metadata['layout']}")
            lines.append(f"  {'shards':<48} {ins.metadata['shards']}")
    if show_tensors:
        lines.append("tensors:")
        for name, shape, typ, nb in ins.tensors:
            lines.append(f"  {name:<40} {str(list(shape)):<22} {typ:<7} {nb:>12}")
    hdr = f"{'group':<16} {'tensors':>7} {'weights (M)':>12} {'size (MiB)':>11} {'bpw':>6}  types"
    lines += ["groups:", "  " + hdr, "  " + "-" * len(hdr)]
    for name, g in ins.groups.items():
        types = ", ".join(
            f"{t} {100.0 * n / g.n_weights:.0f}%" if len(g.types) > 1 else t
            for t, n in sorted(g.types.items(), key=lambda kv: -kv[1])
        )
        lines.append(
            f"  {name:<16} {g.n_tensors:>7} {g.n_weights / 1e6:>12.3f} {g.n_bytes / 2**20:>11.2f} "
            f"{g.bpw:>6.2f}  {types}"
        )
    lines.append("  " + "-" * len(hdr))
    lines.append(
        f"  {'total':<16} {sum(g.n_tensors for g in ins.groups.values()):>7} "
        f"{ins.n_weights / 1e6:>12.3f} {ins.n_bytes / 2**20:>11.2f} "
        f"{8.0 * ins.n_bytes / max(1, ins.n_weights):>6.2f}"
    )
    return "\n".join(lines)
