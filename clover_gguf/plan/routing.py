"""How much of a layer's routed experts one block touches, measured on a model's real router.

A pass over T block rows reads (in VRAM) or copies (host-resident experts, op offload) only
the experts those rows route to. With top-k of E and independent uniform routing the expected
fraction is 1 - (1 - k/E)^T (`uniform`); a real router is neither uniform nor independent
across the rows of one block (neighbouring tokens, and the mask rows of a denoising step, share
experts). `measure` runs the PyTorch reference over held-out text, in whole blocks at several
block sizes, and records the fraction of experts each block touches per layer, for the rows of
a commit (clean tokens) and of a denoising step with half or all rows masked. The result is
committed under evaldata/plan/ and keyed by the model's router fingerprint (sha256 of every
layer's router weights as float32): the cost model uses it for that router only and the
uniform formula for any other model (`Routing.load_for`). docs/plan.md."""

from __future__ import annotations

import hashlib
import json
import random
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SCHEMA = "clover-gguf.routing/1"
ROUTING_DIR = Path(__file__).resolve().parents[2] / "evaldata" / "plan"
BLOCK_SIZES = (8, 16, 32, 64)
MASK_LEVELS = (0.0, 0.5, 1.0)  # a commit's rows, a step with half, with all rows masked
ROUTER_HF = "model.layers.{bid}.mlp.gate.weight"
ROUTER_GGUF = "blk.{bid}.ffn_gate_inp.weight"


def uniform(k: int, E: int, T: float) -> float:
    """Expected fraction of E experts that T rows, each routed to k of them at random, touch."""
    return 1.0 - (1.0 - k / E) ** T


def _digest(layers) -> str:
    h = hashlib.sha256()
    for w in layers:
        h.update(np.ascontiguousarray(w, dtype="<f4").tobytes())
    return h.hexdigest()


def fingerprint_checkpoint(ck, n_layers: int) -> str:
    """sha256 of the routers ([E, d] float32, layer order) of a checkpoint (checkpoint.Checkpoint)."""
    return _digest(ck.get(ROUTER_HF.format(bid=i)).float().numpy() for i in range(n_layers))


def fingerprint_gguf(path) -> str | None:
    """The same fingerprint from a GGUF (the router is stored F32, the checkpoint's values)."""
    from ..gguf_io.reader import open_gguf

    r = open_gguf(path)
    by_name = {t.name: t for t in r.tensors}
    out, i = [], 0
    while ROUTER_GGUF.format(bid=i) in by_name:
        t = by_name[ROUTER_GGUF.format(bid=i)]
        if t.tensor_type.name != "F32":
            return None
        out.append(np.asarray(t.data))
        i += 1
    return _digest(out) if out else None


@dataclass
class Routing:
    """Touched fractions for one model: measured (table: T -> mask level -> per-layer list) or
    the uniform formula."""

    k: int
    E: int
    table: dict[int, dict[float, list[float | None]]] | None = None
    source: str = "uniform 1-(1-k/E)^T (no routing measurement for this model)"

    @property
    def measured(self) -> bool:
        return bool(self.table)

    def fraction(self, T: int, masked: float = 1.0, layer: int | None = None) -> float:
        """Fraction of a layer's experts T rows touch; masked: the fraction of the rows that are
        mask tokens (0: a commit). Linear between the measured mask levels; the uniform formula
        for a block size or layer that was not measured."""
        rows = (self.table or {}).get(int(T))
        if not rows:
            return uniform(self.k, self.E, T)
        levels = sorted(rows)
        m = min(max(masked, levels[0]), levels[-1])
        hi = next(x for x in levels if x >= m)
        lo = max(x for x in levels if x <= m)
        a, b = self._at(rows[lo], layer, T), self._at(rows[hi], layer, T)
        return a if hi == lo else a + (b - a) * (m - lo) / (hi - lo)

    def _at(self, per_layer: list[float | None], layer: int | None, T: int) -> float:
        vals = [v for v in per_layer if v is not None]
        if layer is not None and layer < len(per_layer) and per_layer[layer] is not None:
            return float(per_layer[layer])
        return float(np.mean(vals)) if vals else uniform(self.k, self.E, T)

    @classmethod
    def load_for(cls, k: int, E: int, fingerprint: str | None, folder: Path | None = None) -> Routing:
        """The committed measurement of the router with this fingerprint, else the formula."""
        folder = Path(folder or ROUTING_DIR)
        if fingerprint:
            for f in sorted(folder.glob("routing-*.json")):
                d = json.loads(f.read_text())
                if d.get("schema") == SCHEMA and d["fingerprint"]["router_sha256"] == fingerprint:
                    table = {
                        int(B): {float(m): v["per_layer"] for m, v in lv.items() if m != "uniform"}
                        for B, lv in d["blocks"].items()
                    }
                    shown = f.relative_to(ROUTING_DIR.parents[1]) if f.is_relative_to(ROUTING_DIR.parents[1]) else f
                    return cls(k, E, table, f"measured on {d['model']}'s router ({shown})")
        return cls(k, E)


# ----------------------------------------------------------------------------- measurement


def _windows(docs, B: int, n_windows: int, n_blocks: int, seed: int) -> np.ndarray:
    """[n_windows, n_blocks, B] tokens: block-aligned runs of whole blocks from the documents
    long enough, one window per document drawn (seeded), documents reused when too few."""
    need = n_blocks * B
    long = [d for d in docs if len(d.tokens) >= need]
    if not long:
        raise ValueError(f"no held-out document has {need} tokens (block {B} x {n_blocks})")
    rng = random.Random(seed * 1000 + B)
    out = []
    for i in range(n_windows):
        d = long[rng.randrange(len(long))] if i >= len(long) else long[i]
        off = rng.randrange((len(d.tokens) - need) // B + 1) * B
        out.append(d.tokens[off : off + need])
    return np.stack(out).reshape(n_windows, n_blocks, B)


def _masked(clean, level: float, mask_id: int, gen):
    """A copy of the [W, nb, B] token blocks with round(level * B) rows of each block masked."""
    import torch

    if level >= 1.0:
        return torch.full_like(clean, mask_id)
    out = clean.clone()
    B = clean.shape[-1]
    n = round(level * B)
    for w in range(clean.shape[0]):
        for b in range(clean.shape[1]):
            out[w, b, torch.randperm(B, generator=gen)[:n]] = mask_id
    return out


def measure(
    model_dir,
    block_sizes=BLOCK_SIZES,
    levels=MASK_LEVELS,
    n_windows: int = 24,
    n_blocks: int = 8,
    seed: int = 0,
    threads: int = 1,
    log=print,
) -> dict:
    """Run the reference model over held-out windows of whole blocks (clean rows committed,
    masked copies reading the clean rows' memory, as in training's two streams) and record,
    per block size, mask level and layer, the mean fraction of experts one block touches."""
    import torch

    from ..checkpoint import Checkpoint
    from ..eval.quality.corpus import default_corpus_files, read_texts, tokenize
    from ..reference.model import CloverModel
    from ..tokenizer import CloverTokenizer

    torch.set_num_threads(threads)
    model = CloverModel.from_pretrained(model_dir, dtype=torch.float32)
    c = model.config
    E, k, L = c.num_experts, c.num_experts_per_tok, c.num_hidden_layers
    with Checkpoint(model_dir) as ck:
        fp = fingerprint_checkpoint(ck, L)
    files, corpus, _ = default_corpus_files()
    docs = tokenize(CloverTokenizer.from_dir(model_dir), read_texts(files))
    blocks = {}
    with _routes_seen(model) as seen:
        gen = torch.Generator().manual_seed(seed)
        for B in block_sizes:
            clean = torch.from_numpy(_windows(docs, B, n_windows, n_blocks, seed))
            per = _touched(model, clean, levels, gen, seen)
            blocks[str(B)] = {
                str(lv): {"per_layer": per[lv], "mean": round(float(np.mean([x for x in per[lv] if x is not None])), 5)}
                for lv in levels
            }
            blocks[str(B)]["uniform"] = round(uniform(k, E, B), 5)
            log(f"block {B}: " + ", ".join(f"masked {lv}: {blocks[str(B)][str(lv)]['mean']:.3f}" for lv in levels)
                + f" (uniform {uniform(k, E, B):.3f})")  # fmt: skip
    return {
        "schema": SCHEMA,
        "model": str(model_dir),
        "fingerprint": {
            "router_sha256": fp,
            "num_experts": E,
            "num_experts_per_tok": k,
            "num_hidden_layers": L,
            "vocab_size": c.vocab_size,
        },
        "corpus": corpus,
        "windows": n_windows,
        "blocks_per_window": n_blocks,
        "seed": seed,
        "mask_levels": list(levels),
        "what": "mean over blocks of (distinct experts the block's rows route to) / E, per layer; "
        "mask level 0: the rows of a commit (clean tokens; the last layer's FFN is pruned there), "
        "0.5 / 1.0: a denoising step with that fraction of the rows masked",
        "blocks": blocks,
    }


@contextmanager
def _routes_seen(model):
    """While open, the list it gives receives (layer, expert ids [rows, n_blocks, B, k]) of
    every MoE layer's forward."""
    k = model.config.num_experts_per_tok
    seen: list = []

    def hook(layer):
        def f(mod, args, _out):
            v = args[0]
            ids = mod.route(v.reshape(-1, v.shape[-1]))[0]
            seen.append((layer, ids.view(*v.shape[:-1], k)))

        return f

    handles = [lay.mlp.register_forward_hook(hook(i)) for i, lay in enumerate(model.layers)]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _touched(model, clean, levels, gen, seen: list) -> dict[float, list[float | None]]:
    """Per mask level, per layer: the mean fraction of experts one block of the [W, nb, B]
    windows `clean` touches (the clean rows committed, a masked copy per level > 0 reading
    their memory; None where a layer does not run those rows). `seen`: _routes_seen's list."""
    import torch

    c = model.config
    E, L = c.num_experts, c.num_hidden_layers
    n_windows, n_blocks, B = clean.shape
    noisy = [lv for lv in levels if lv > 0]
    tok = torch.cat([clean] + [_masked(clean, lv, c.mask_token_id, gen) for lv in noisy])
    N = tok.shape[0]
    pos = torch.arange(n_blocks * B).view(1, n_blocks, B).expand(N, -1, -1)
    seen.clear()
    with torch.no_grad():
        model._run(tok, pos, None, init=model.init_state(n_windows), n_clean=n_windows)
    per = {lv: [None] * L for lv in levels}
    for layer, ids in seen:
        hit = torch.zeros(*ids.shape[:2], E).scatter_(-1, ids.reshape(*ids.shape[:2], -1), 1.0)
        frac = hit.sum(-1) / E  # [rows, n_blocks]
        first = N - ids.shape[0]  # the last layer runs the masked rows only
        for i, lv in enumerate(levels):
            lo, hi = i * n_windows - first, (i + 1) * n_windows - first
            if hi > 0 and lo >= 0:
                per[lv][layer] = round(float(frac[lo:hi].mean()), 5)
    return per


def write(data: dict, out: Path) -> None:
    from ..outputs import write_json

    write_json(out, data)
