"""Budget recipes (``--recipe fit:16GiB``): the type per tensor group that minimises the
predicted KL under a size budget.

Predicted KL = sum over groups of KL_group(type), from per-group sensitivity curves
(`clover-gguf eval sensitivity --type T ...`: one group quantized at a time against a BF16
base, committed for clover-tiny under evaldata/sensitivity/). For another model those curves
are the prior: they rank groups and types, they do not predict its absolute KL; the per-layer
groups' KL is scaled by the ratio of layer counts (errors of independent layers add), the
embeddings' and output's is not. A (group,
type) the curves lack is extrapolated from the group's measured point nearest in bits per
weight with quantization noise power ~ 2^(-2 bpw). The search is exhaustive over the groups'
candidate types (a few 10^4 recipes), with sizes from the converter's own rules (block
fallbacks included)."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

from ..convert import quants
from ..convert.tensor_plan import fmt_bytes
from .sizes import GROUPS, GroupTypes, PlanError, Source, exact_plan, header_bytes_estimate

CURVES_DIR = Path(__file__).resolve().parents[2] / "evaldata" / "sensitivity" / "clover-tiny"
EXPERT_CANDIDATES = ("q8_0", "q6_k", "q5_k", "q4_k", "iq4_xs", "q3_k", "iq3_s", "iq2_s")
OTHER_CANDIDATES = ("bf16", "q8_0", "q6_k", "q5_k", "q4_k")
LOSSLESS = {"f32", "f16", "bf16"}


def _bpw(t: str) -> float:
    return quants.bits_per_weight(quants.parse_type(t))


PER_LAYER_GROUPS = ("experts_gate_up", "experts_down", "shared_expert", "attention")


@dataclass
class Curves:
    kl: dict[str, dict[str, float]]  # group -> type -> KL mean (nats)
    source: str
    layers: int = 0  # layers of the model the curves were measured on
    target_layers: int = 0  # layers of the model predicted (0: the same)
    reference: str | None = None  # the sensitivity runs' reference model
    reference_sha256: frozenset[str] = frozenset()  # eval.quality.backends.model_dir_hash of it

    def for_layers(self, n: int) -> Curves:
        """The curves applied to an n-layer model: a per-layer group's error adds up over the
        layers (to first order), the embeddings and the output are one tensor each."""
        return Curves(self.kl, self.source, self.layers, n, self.reference, self.reference_sha256)

    def of_model(self, model_dir) -> bool:
        """True when every sensitivity run scored this very model folder (same config and
        weights): then the curves predict its KL; otherwise they are a ranking prior."""
        if model_dir is None or len(self.reference_sha256) != 1 or not Path(model_dir).is_dir():
            return False
        from ..eval.quality.backends import model_dir_hash

        return model_dir_hash(model_dir) in self.reference_sha256

    def scale(self, group: str) -> float:
        if group in PER_LAYER_GROUPS and self.layers and self.target_layers:
            return self.target_layers / self.layers
        return 1.0

    @classmethod
    def load(cls, folder: Path | None = None) -> Curves:
        """Every sensitivity.json under folder (one per type)."""
        folder = Path(folder or CURVES_DIR)
        kl: dict[str, dict[str, float]] = {}
        layers = 0
        refs, hashes = set(), set()
        files = sorted(folder.glob("**/sensitivity.json"))
        if not files:
            raise PlanError(f"{folder}: no sensitivity.json (run `clover-gguf eval sensitivity --type ...`)")
        for f in files:
            run = json.loads(f.read_text())
            t = run["config"]["qtype"]
            t = quants.TYPE_ALIASES.get(t, t)
            for row in run["groups"]:
                kl.setdefault(row["group"], {})[t] = max(0.0, float(row["overall"]["kl_mean"]))
            layers = layers or _reference_layers(run["config"].get("reference"), f)
            refs.add(run["config"].get("reference"))
            hashes.add(run["config"].get("reference_sha256") or "?")
        root = Path(__file__).resolve().parents[2]
        shown = folder.resolve()
        shown = shown.relative_to(root) if shown.is_relative_to(root) else shown
        ref = refs.pop() if len(refs) == 1 else None
        return cls(kl, str(shown), layers, 0, ref, frozenset(h for h in hashes if h != "?"))

    def predict(self, group: str, t: str) -> float:
        if t in LOSSLESS:
            return 0.0
        pts = self.kl.get(group, {})
        if not pts:
            return 0.0
        b = _bpw(t)
        if t in pts:
            # monotone in bits: a type never predicts less KL than any measured wider one
            kl = max([pts[t]] + [v for u, v in pts.items() if _bpw(u) >= b])
        else:
            near = min(pts, key=lambda u: abs(_bpw(u) - b))
            kl = pts[near] * 2.0 ** (2 * (_bpw(near) - b))
        return kl * self.scale(group)

    def predict_recipe(self, gt: GroupTypes) -> float:
        return sum(self.predict(g, t) for g, t in gt.types)


def _reference_layers(ref, run_file: Path) -> int:
    """num_hidden_layers of the sensitivity run's reference model (0 when unknown)."""
    if not ref:
        return 0
    for base in (Path(ref), Path(__file__).resolve().parents[2] / ref):
        cfg = base / "config.json"
        if cfg.is_file():
            try:
                return int(json.loads(cfg.read_text())["num_hidden_layers"])
            except (ValueError, KeyError, TypeError):
                return 0
    return 0


def _group_sizes(src: Source, expert_candidates=EXPERT_CANDIDATES) -> tuple[dict[str, dict[str, int]], int, int]:
    """(group -> type -> bytes, bytes of the tensors no recipe changes, n tensors)."""
    base = exact_plan(src, GroupTypes.make(**{g: "bf16" for g in GROUPS}))
    sizes: dict[str, dict[str, int]] = {g: {} for g in GROUPS}
    fixed = 0
    for e in base.entries:
        if e.group not in GROUPS or e.why not in ("outtype", "experts"):
            fixed += e.nbytes  # F32 by rule: no recipe changes it
            continue
        cands = expert_candidates if e.group.startswith("experts") else OTHER_CANDIDATES
        for t in cands:
            qt, _ = quants.fallback_type(quants.parse_type(t), e.shape[-1])
            sizes[e.group][t] = sizes[e.group].get(t, 0) + quants.tensor_bytes(qt, e.shape)
    return sizes, fixed, len(base.entries)


@dataclass
class Fit:
    types: GroupTypes
    tensor_bytes: int
    file_bytes_max: int  # tensor bytes + header estimate
    kl: float
    budget: int
    table: list[tuple[str, str, int, float]]  # group, type, bytes, KL

    def format(self, kl_head: str = "pred. KL") -> str:
        lines = [f"{'group':<16} {'type':<7} {'size':>11} {kl_head:>10}"]
        for g, t, b, k in self.table:
            lines.append(f"{g:<16} {t:<7} {fmt_bytes(b):>11} {k:10.6f}")
        lines.append(
            f"total {fmt_bytes(self.tensor_bytes)} of tensors (file <= {fmt_bytes(self.file_bytes_max)}), "
            f"budget {fmt_bytes(self.budget)}, {kl_head} {self.kl:.6f}"
        )
        return "\n".join(lines)


def fit_budget(
    src: Source,
    budget: int,
    curves: Curves | None = None,
    reserve: int = 0,
    expert_candidates=EXPERT_CANDIDATES,
    gpu_only: bool = False,
) -> Fit:
    """The recipe with the least predicted KL whose file (tensors + header estimate + reserve)
    is at most ``budget`` bytes; gpu_only: what llama.cpp puts on the GPU is (the file less
    token_embd and the header: plan.vram)."""
    curves = (curves or Curves.load()).for_layers(src.config.num_hidden_layers)
    sizes, fixed, n_tensors = _group_sizes(src, expert_candidates)
    header = 0 if gpu_only else header_bytes_estimate(src.config, n_tensors)
    counted = [not (gpu_only and g == "embeddings") for g in GROUPS]
    room = budget - reserve - fixed - header
    per_group = []
    for g in GROUPS:
        opts = sorted(((t, b, curves.predict(g, t)) for t, b in sizes[g].items()), key=lambda x: x[1])
        per_group.append(opts)
    best = None
    for combo in itertools.product(*per_group):
        if sum(x[1] for x, c in zip(combo, counted) if c) > room:
            continue
        b = sum(x[1] for x in combo)
        k = sum(x[2] for x in combo)
        if best is None or (k, b) < (best[0], best[1]):
            best = (k, b, combo)
    if best is None:
        smallest = fixed + sum(min(x[1] for x in opts) for opts, c in zip(per_group, counted) if c)
        raise PlanError(
            f"no recipe fits {fmt_bytes(budget)}: the smallest ({', '.join(o[0][0] for o in per_group)}) "
            f"needs {fmt_bytes(smallest + header + reserve)}"
        )
    k, b, combo = best
    gt = GroupTypes.make(**{g: x[0] for g, x in zip(GROUPS, combo)})
    table = [(g, x[0], x[1], x[2]) for g, x in zip(GROUPS, combo)]
    return Fit(gt, fixed + b, fixed + b + header_bytes_estimate(src.config, n_tensors), k, budget, table)


def parse_fit_recipe(recipe: str | None) -> int | None:
    """'fit:16GiB' -> budget bytes; None for another recipe."""
    if not recipe or not recipe.lower().startswith("fit:"):
        return None
    from .sizes import parse_size

    return parse_size(recipe[4:], "--recipe fit:SIZE")


def budget_rules(
    model_dir, recipe: str | None, outtype=None, experts=None, tensor_types=None, with_imatrix=False, log=print
):
    """The explicit type rules of a budget recipe (``fit:16GiB``) for the checkpoint in
    model_dir, for ``convert(rules=...)``; None for any other recipe (convert resolves those).
    Without an imatrix, no type that needs one. The fit's table goes to ``log``."""
    from ..convert.converter import open_checkpoint

    budget = parse_fit_recipe(recipe)
    if budget is None:
        return None
    ck = open_checkpoint(Path(model_dir))
    if outtype or experts or tensor_types:
        raise PlanError(f"--recipe {recipe} chooses every group's type: drop --outtype/--experts/--tensor-type")
    cands = EXPERT_CANDIDATES if with_imatrix else tuple(t for t in EXPERT_CANDIDATES if t != "iq2_s")
    res = fit_budget(Source(ck.config, str(ck.dir), str(ck.dir), ck), budget, expert_candidates=cands)
    for line in res.format().splitlines():
        log(f"fit: {line}")
    rules = res.types.rules()
    rules.recipe = recipe
    return rules
