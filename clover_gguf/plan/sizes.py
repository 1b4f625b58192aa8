"""Exact sizes of a recipe, without converting: the converter's own plan (convert.tensor_plan.build_plan)
run over a model's tensor names and shapes, from a checkpoint's headers, a GGUF's metadata or a
preset's config. A recipe here is a type per tensor group (GroupTypes), written as the
convert options that reproduce it."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from ..config import CloverConfig, preset
from ..constants import TENSOR_GROUPS
from ..convert import quants
from ..convert.recipes import OUTTYPE_GROUPS, TypeRules
from ..convert.tensor_plan import Plan, build_plan
from ..errors import CloverError

# the groups a recipe chooses types for (router/memory/conv/norms stay F32)
GROUPS = ("experts_gate_up", "experts_down", "shared_expert", "attention", "embeddings", "output")


class PlanError(CloverError, ValueError):
    """A bad plan input or option: one line."""


class _AnyImatrix:
    """Stands for an imatrix with data for every tensor: sizes do not depend on it."""

    entries: dict = {}

    def get(self, name):
        return True


@dataclass
class Source:
    """What a plan is made for: the config, and the converter's view of the tensors."""

    config: CloverConfig
    label: str  # what the user gave (a folder, a .gguf, a preset)
    convert_arg: str  # MODEL_DIR in the printed convert line
    ck: object  # Checkpoint or synthetic.SyntheticSource (names, shapes, dtypes)
    path: Path | None = None  # the model folder or GGUF file (None for --shape)


def open_source(model: str | None, shape: str | None = None, layers: int | None = None) -> Source:
    from ..synthetic import SyntheticSource

    if (model is None) == (shape is None):
        raise PlanError("give MODEL_DIR, MODEL.gguf or --shape NAME (one of them)")
    if shape is not None:
        try:
            cfg = preset(shape)
        except ValueError as e:
            raise PlanError(str(e)) from None
        label, arg = f"--shape {shape}", "MODEL_DIR"
    else:
        p = Path(model)
        if p.is_dir():
            from ..checkpoint import Checkpoint

            try:
                ck = Checkpoint(p)
            except ValueError as e:
                raise PlanError(str(e)) from None
            if layers is None:
                return Source(ck.config, str(p), str(p), ck, p)
            cfg = ck.config
        elif p.is_file():
            from ..gguf_io.reader import config_from_reader, open_gguf

            try:
                cfg = config_from_reader(open_gguf(p), p)
            except Exception as e:  # gguf-py raises whatever a damaged file leads to
                raise PlanError(f"{p}: cannot read a Clover GGUF ({e})") from None
        else:
            raise PlanError(f"{model}: no such model folder or GGUF file")
        label, arg = str(p), (str(p) if p.is_dir() else "MODEL_DIR")
    path = None if shape is not None else Path(model)
    if layers is not None:
        cfg = CloverConfig.from_dict({**cfg.to_dict(), "num_hidden_layers": layers})
        path = None
    return Source(cfg, label, arg, SyntheticSource(cfg, Path(".")), path)


@dataclass(frozen=True)
class GroupTypes:
    """A type per tensor group (GROUPS order)."""

    types: tuple[tuple[str, str], ...]

    @classmethod
    def make(cls, **kw) -> GroupTypes:
        for g in kw:
            if g not in GROUPS:
                raise PlanError(f"unknown tensor group {g!r}; known: {', '.join(GROUPS)}")
        out = []
        for g in GROUPS:
            t = kw[g]
            quants.parse_type(t)
            out.append((g, quants.TYPE_ALIASES.get(t.lower(), t.lower())))
        return cls(tuple(out))

    def __getitem__(self, g: str) -> str:
        return dict(self.types)[g]

    def experts_tag(self) -> str:
        """The experts' types as a file-name part: q4_k, or q4_k-q6_k when down differs."""
        d = dict(self.types)
        return d["experts_gate_up"] + ("" if d["experts_down"] == d["experts_gate_up"] else f"-{d['experts_down']}")

    def convert_options(self) -> list[str]:
        """--experts/--outtype/--tensor-type options that give exactly these types (each override
        is the group's own regex, so none can catch a router or norm)."""
        d = dict(self.types)
        outs = [d[g] for g in OUTTYPE_GROUPS]
        outtype = max(set(outs), key=outs.count) if any(o in quants.OUTTYPES for o in outs) else "q8_0"
        if outtype not in quants.OUTTYPES:
            outtype = "q8_0"
        experts = d["experts_gate_up"]
        opts = ["--experts", experts, "--outtype", outtype]
        for g in GROUPS:
            want = experts if g.startswith("experts") else outtype
            if d[g] != want:
                opts += ["--tensor-type", f"{TENSOR_GROUPS[g]}={d[g]}"]
        return opts

    def rules(self) -> TypeRules:
        o = self.convert_options()
        tts = [o[i + 1] for i in range(len(o)) if o[i] == "--tensor-type"]
        return TypeRules.make(o[3], o[1], tts, None)

    def needs_imatrix(self) -> bool:
        return any(quants.requires_imatrix(quants.parse_type(t)) for _, t in self.types)

    def imatrix_helps(self) -> bool:
        low = {"q3_k", "q2_k", "iq4_xs", "iq3_s", "iq2_s", "iq4_nl"}
        return any(t in low for _, t in self.types)


def exact_plan(src: Source, gt: GroupTypes) -> Plan:
    """The converter's plan for these types (as `convert --dry-run` prints it)."""
    from ..convert import ConvertError

    try:
        return build_plan(src.ck, gt.rules(), _AnyImatrix() if gt.needs_imatrix() else None, backend="auto")
    except ConvertError as e:
        raise PlanError(str(e)) from None
    except quants.QuantBackendError:  # pragma: no cover - sizes need no backend
        raise


def convert_line(src: Source, gt: GroupTypes, out: str) -> str:
    args = ["clover-gguf", "convert", src.convert_arg, "-o", out, *gt.convert_options()]
    if gt.imatrix_helps() or gt.needs_imatrix():
        args += ["--imatrix", "IMATRIX.gguf"]
    return shlex.join(args)


def group_bytes(plan: Plan) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in plan.entries:
        out[e.group] = out.get(e.group, 0) + e.nbytes
    return out


def expert_layer_bytes(plan: Plan) -> dict[int, int]:
    """Routed-expert bytes per layer."""
    out: dict[int, int] = {}
    for e in plan.entries:
        if e.group.startswith("experts"):
            b = int(re.match(r"^blk\.(\d+)\.", e.name).group(1))
            out[b] = out.get(b, 0) + e.nbytes
    return out


# GGUF header: the vocabulary (tokens + merges as strings) and per-tensor info; measured on
# converted files: ~24 bytes a token of tokens, ~24 a merge, 100 a tensor info, + alignment
def header_bytes_estimate(config: CloverConfig, n_tensors: int) -> int:
    return 64 * config.vocab_size + 160 * n_tensors + (1 << 20)


def parse_size(s: str, what: str = "size") -> int:
    """'16GiB', '16G' (GiB), '16GB' (10^9), '900MiB', bytes -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", str(s))
    if not m:
        raise PlanError(f"{what} {s!r}: expected a size such as 16GiB, 15.5G or 900MiB")
    v, unit, b = float(m.group(1)), m.group(2).upper(), m.group(3)
    base = 1000 if (b and not b.lower().startswith("i")) and unit else 1024
    n = int(v * base ** " KMGT".index(unit or " "))
    if n <= 0:
        raise PlanError(f"{what} {s!r}: must be positive")
    return n
