"""`clover-gguf eval quality`: how far each GGUF is from the BF16 reference.

``run_quality`` reads top-down (docs in the module docstrings of corpus.py and metrics.py):

1. provider selection (``select_providers``): ``reference-dequant`` (the PyTorch reference on
   the GGUF's dequantized weights) and/or ``runtime`` (the patched llama.cpp);
2. samples (``Sampling``): corpus -> windows of blocks -> masked copies at several ratios
   (fixed seeds);
3. reference logits (``ReferenceLogits.load_or_compute``): the reference scores every masked
   position once; its logits are saved compactly (top-k + log-sum-exp + true-token
   log-prob, ``reference-logits.npz``) and reused by every later run on the same samples;
4. scoring per GGUF (``score_gguf``): each scored position gives NLL, KL ref‖q (from the
   compact form, with its error bound), same-top-1 and Δp; summaries overall, per mask
   ratio, per history length (blocks committed before the scored block) and for the
   long-range recall probes;
5. generation agreement (``GenerationAgreement``): greedy generation of a prompt set with a
   ``steps`` and a ``threshold`` schedule, agreement with the reference's tokens;
6. the run (``QualityRun``), which serialises itself to ``quality.json``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ...checkpoint import Checkpoint
from ...config import CloverConfig
from ...constants import DEFAULT_THRESHOLD
from ...convert.fingerprint import weights_sha256
from ...errors import CloverError
from ...outputs import output_file, write_json
from ...reference.generate import NonFiniteError
from ...util import EVALDATA, default_threads
from ..sysinfo import environment, gguf_file_info
from . import backends as bk
from .corpus import (
    DEFAULT_RATIOS,
    DEFAULT_SEED,
    Document,
    SampleSet,
    build_samples,
    history_bin,
    identifier_predicate,
    load_corpus,
    probe_bin,
)
from .metrics import CompactLogits, agreement, compact, kl_full, position_metrics, summarize

MAX_BLOCK = 1024  # limits.py: diffusion.block_size
DEFAULT_PROMPTS = EVALDATA / "prompts" / "clover-tiny-code.jsonl"
DEFAULT_TOP_K = "auto"
SCHEMA = "clover-gguf-eval/1"


class QualityError(CloverError, RuntimeError):
    pass


# ---- reference logits -------------------------------------------------------------------

CALIB_MAX = 1024  # positions of window 0 whose full reference logits are kept (calibration)


AUTO_K_LADDER = (256, 512, 1024, 2048, 4096, 8192)
AUTO_K_TAIL = 1e-3  # "auto": the smallest k of the ladder whose mean tail mass on window 0 is <= this


def choose_k(logits: torch.Tensor, targets: torch.Tensor, exclude: int | None) -> int:
    """Smallest k of AUTO_K_LADDER leaving a mean tail mass <= AUTO_K_TAIL, else the largest.
    A vocabulary no larger than the chosen k is kept whole: the KL is then exact (clover-tiny,
    V = 8192); Clover-35B-A3B (V = 248320) keeps at most 8192 and reports the bound."""
    V = logits.shape[-1]
    k = AUTO_K_LADDER[-1]
    for cand in AUTO_K_LADDER:
        if cand >= V or compact(logits, targets, cand, exclude).tail_mass().mean().item() <= AUTO_K_TAIL:
            k = cand
            break
    return min(k, V)


def reference_logits(provider, samples: SampleSet, k, exclude: int | None, log=print):
    """(compact reference logits of every scored position, full logits [m, V] of up to
    CALIB_MAX evenly spaced positions of window 0 (the calibration set), their indices).
    k = "auto" picks it from window 0 (choose_k)."""
    out, calib, cidx = None, None, None
    for w in range(len(samples.windows)):
        sel = torch.from_numpy(samples.masks[w])
        lg = provider.window_logits(samples.clean(w), samples.noisy(w), sel)
        if k == "auto":
            k = choose_k(lg, samples.targets(w), exclude)
            log(
                f"  compact reference logits: top-{k} (smallest of {list(AUTO_K_LADDER)} with a mean tail mass "
                f"<= {AUTO_K_TAIL:g} on window 0, the whole vocabulary if smaller, else the largest)"
            )
        c = compact(lg, samples.targets(w), int(k), exclude)
        if w == 0:
            cidx = torch.linspace(0, lg.shape[0] - 1, min(CALIB_MAX, lg.shape[0])).round().long().unique()
            calib = lg[cidx].float().clone()
        out = c if out is None else out.cat(c)
        log(f"  reference: window {w + 1}/{len(samples.windows)} ({int(sel.sum())} positions)")
    return out, calib, cidx


def save_compact(path: Path, c: CompactLogits, meta: dict, calib=None, cidx=None) -> None:
    extra = {} if calib is None else {"calib_logits": calib.numpy(), "calib_idx": cidx.numpy()}
    with output_file(path, force=True) as f:
        np.savez(f, meta=np.array(json.dumps(meta)), **c.to_numpy(), **extra)


def load_compact(path: Path):
    with np.load(path) as z:
        meta = json.loads(str(z["meta"]))
        c = CompactLogits.from_numpy({k: z[k] for k in ("top_ids", "top_logits", "lse", "target_logp", "tail_logp")})
        calib = torch.from_numpy(z["calib_logits"]) if "calib_logits" in z else None
        cidx = torch.from_numpy(z["calib_idx"]).long() if "calib_idx" in z else None
        return c, meta, calib, cidx


# ---- scoring ----------------------------------------------------------------------------


def _check_finite(provider, lg: torch.Tensor, exclude: int | None, w: int, noisy) -> None:
    """Non-finite logits are not scored into a NaN KL: the run stops, naming the first
    non-finite tensor when the provider's debug pass finds it."""
    bad = ~torch.isfinite(lg)
    if exclude is not None:
        bad[:, exclude] = False  # the mask token's column is never a prediction
    if bool(bad.any()):
        block = [int(x) for x in noisy[0, 0]]
        raise NonFiniteError(f"{provider.name}: non-finite logits in window {w}{provider.diagnose(block)}")


def score(
    provider, samples: SampleSet, ref: CompactLogits, exclude: int | None, log=print, calib=None, cidx=None
) -> tuple[dict[str, np.ndarray], dict]:
    """Per-position metrics of one provider against the compact reference, and the
    calibration: on the positions whose full reference logits were kept, the exact KL next
    to the compact-form KL_c and its bound."""
    parts, start, cal = [], 0, {}
    for w in range(len(samples.windows)):
        sel = torch.from_numpy(samples.masks[w])
        n = int(sel.sum())
        lg = provider.window_logits(samples.clean(w), samples.noisy(w), sel)
        _check_finite(provider, lg, exclude, w, samples.noisy(w))
        r = ref.slice(start, start + n)
        pm = position_metrics(r, lg, samples.targets(w), exclude)
        parts.append(pm)
        if w == 0 and calib is not None:
            full = kl_full(calib, lg[cidx], exclude).numpy()
            kc, bd = pm["kl"][cidx.numpy()], pm["kl_bound"][cidx.numpy()]
            cal = {
                "n": int(full.size),
                "kl_mean_full": float(full.mean()),
                "kl_mean_compact": float(kc.mean()),
                "kl_mean_bound": float(bd.mean()),
                "max_abs_error": float(np.abs(full - kc).max()),
                "mean_abs_error": float(np.abs(full - kc).mean()),
                "bracket_holds": bool(np.all(kc <= full + 1e-6) and np.all(full <= kc + bd + 1e-6)),
            }
        start += n
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}, cal


def summaries(pm: dict[str, np.ndarray], samples: SampleSet) -> dict:
    meta = samples.meta
    out = {"overall": summarize(pm), "by_ratio": {}, "by_history": {}, "probes": {}}
    for ri, r in enumerate(samples.ratios):
        out["by_ratio"][f"{r:g}"] = summarize(pm, np.nonzero(meta["ratio"] == ri)[0])
    hb = np.array([history_bin(int(b)) for b in meta["block"]])
    for lab in dict.fromkeys(hb.tolist()):
        s = summarize(pm, np.nonzero(hb == lab)[0])
        s["history_blocks"] = lab
        out["by_history"][lab] = s
    pb = np.array([probe_bin(int(d)) or "" for d in meta["probe_dist"]])
    out["probes"]["all"] = summarize(pm, np.nonzero(pb != "")[0])
    for lab in sorted({x for x in pb.tolist() if x}, key=lambda s: int(s.split("-")[0].rstrip("+"))):
        out["probes"][lab] = summarize(pm, np.nonzero(pb == lab)[0])
    return out


# ---- generation -------------------------------------------------------------------------


def load_prompts(path, tokenizer=None, limit: int | None = None, vocab_size: int | None = None) -> list[dict]:
    """JSONL: {"id", "text"} (needs the tokenizer) or {"id", "ids": [...]} per line."""
    out = []
    try:
        lines = Path(path).read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise QualityError(f"{path}: not UTF-8 text (byte {e.start})") from None
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        where = f"{path}:{i + 1}"
        try:
            o = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:
            raise QualityError(f"{where}: not JSON ({e})") from None
        if not isinstance(o, dict):
            raise QualityError(f'{where}: expected an object with "ids" or "text"')
        if "ids" in o:
            ids = o["ids"]
            if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
                raise QualityError(f'{where}: "ids" must be a list of integers')
            bad = [x for x in ids if vocab_size is not None and not 0 <= x < vocab_size]
            if bad:
                raise QualityError(f"{where}: token {bad[0]} is not an id in [0, {vocab_size - 1}]")
        elif not isinstance(o.get("text"), str):
            raise QualityError(f'{where}: expected "ids" or a "text" string')
        elif tokenizer is not None:
            ids = tokenizer.encode(o["text"])
        else:
            raise QualityError(f"{where}: a text prompt needs a tokenizer (none in the model dir)")
        out.append({"id": o.get("id", str(i)), "ids": ids})
    if not out:
        raise QualityError(f"{path}: no prompts")
    return out[:limit] if limit else out


def schedules(block_size: int, steps: int | None = None, threshold: float = DEFAULT_THRESHOLD) -> dict[str, dict]:
    s = steps if steps is not None else max(1, block_size // 2)
    return {
        f"steps={s}": {"steps": s, "threshold": None},
        f"threshold={threshold:g}": {"steps": None, "threshold": threshold},
    }


def run_generation(gen_fn, prompts, cfg_base: dict, scheds: dict) -> dict:
    """gen_fn(prompt_ids, GenerationConfig) -> GenerationResult, for each prompt and schedule:
    {schedule: {"tokens": [[...]], "steps_per_block", "tokens_per_step", "seconds"}}"""
    from ...generation.config import GenerationConfig

    res = {}
    for name, s in scheds.items():
        toks, steps, nblk, ntok, t0 = [], 0, 0, 0, time.perf_counter()
        for p in prompts:
            cfg = GenerationConfig(**cfg_base, steps=s["steps"], threshold=s["threshold"])
            g = gen_fn(p["ids"], cfg)
            toks.append(list(g.tokens))
            steps += sum(b.steps for b in g.blocks)
            nblk += len(g.blocks)
            ntok += sum(b.n_tokens for b in g.blocks)
        res[name] = {
            "tokens": toks,
            "steps_per_block": steps / max(nblk, 1),
            "tokens_per_step": ntok / max(steps, 1),
            "seconds": time.perf_counter() - t0,
        }
    return res


# ---- options ------------------------------------------------------------------------------


@dataclass
class Sampling:
    """What is scored: a corpus (text files, or documents of token ids), windows of blocks at
    mask ratios (corpus.build_samples), and the reference logits kept per position."""

    corpus: list | None = None  # files; None: the held-out stdlib modules
    docs: list[Document] | None = None  # token documents instead of a corpus
    n_windows: int = 6
    n_blocks: int = 64
    block_size: int | None = None  # None: the model's
    ratios: tuple[float, ...] = DEFAULT_RATIOS
    seed: int = DEFAULT_SEED
    top_k: int | str = DEFAULT_TOP_K

    def validate(self) -> None:
        for name, lo in (("n_windows", 1), ("n_blocks", 1), ("seed", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise QualityError(f"{name} {v!r}: must be an integer >= {lo}")
        if self.block_size is not None and not 1 <= self.block_size <= MAX_BLOCK:
            raise QualityError(f"block_size {self.block_size}: must be an integer in [1, {MAX_BLOCK}]")
        if not self.ratios or any(not (math.isfinite(r) and 0 < r <= 1) for r in self.ratios):
            raise QualityError(f"ratios {list(self.ratios)}: every mask ratio must be in (0, 1]")
        if self.top_k != "auto" and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1):
            raise QualityError(f"top_k {self.top_k!r}: must be an integer >= 1 or 'auto'")

    def check_supply(self, docs, B: int) -> None:
        """--blocks and --windows against what the corpus holds, before any work: a window
        is at most a document long, and there are only so many distinct windows."""
        blocks = [len(d.tokens) // B for d in docs]
        longest = max(blocks, default=0)
        if longest >= 2 and self.n_blocks > longest:
            raise QualityError(
                f"--blocks {self.n_blocks}: the corpus's longest document holds {longest} blocks of {B} tokens"
            )
        # corpus.build_samples draws distinct (document, offset) windows: this many exist
        distinct = sum(max(0, n - self.n_blocks) + 1 for n in blocks if n >= 2)
        if distinct and self.n_windows > distinct:
            raise QualityError(
                f"--windows {self.n_windows}: the corpus holds {distinct} distinct windows of up to "
                f"{self.n_blocks} blocks of {B} tokens"
            )

    def build(self, B: int, mask_token_id: int, tokenizer) -> SampleSet:
        if self.docs is None:
            docs, cinfo = load_corpus(self.corpus, tokenizer)
        else:
            docs = self.docs
            cinfo = {
                "corpus": "documents given by the caller (token ids)",
                "documents": len(docs),
                "tokens": int(sum(len(d.tokens) for d in docs)),
            }
        self.check_supply(docs, B)
        return build_samples(
            docs,
            B,
            self.n_windows,
            self.n_blocks,
            self.ratios,
            self.seed,
            mask_token_id,
            identifier_predicate(tokenizer) if tokenizer else None,
            cinfo,
        )


@dataclass
class Generation:
    """The generation agreement: greedy generation of a prompt set with a ``steps`` and a
    ``threshold`` schedule, compared token by token with the reference's."""

    enabled: bool = True
    prompts: str | Path | None = None  # JSONL; None: DEFAULT_PROMPTS
    n_prompts: int | None = None
    max_new_tokens: int = 64
    steps: int | None = None  # None: block_size / 2
    threshold: float = DEFAULT_THRESHOLD
    providers: tuple[str, ...] | None = None  # providers that generate; None: all

    def load_prompts(self, tokenizer, vocab_size: int) -> list[dict]:
        if not self.enabled:
            return []
        return load_prompts(
            Path(self.prompts) if self.prompts else DEFAULT_PROMPTS, tokenizer, self.n_prompts, vocab_size
        )

    def validate(self) -> None:
        if self.max_new_tokens < 1 or (self.n_prompts is not None and self.n_prompts < 1):
            raise QualityError("max_new_tokens and n_prompts must be >= 1")
        if self.steps is not None and not 1 <= self.steps <= MAX_BLOCK:
            raise QualityError(f"steps {self.steps}: must be an integer in [1, {MAX_BLOCK}]")
        if not (math.isfinite(self.threshold) and 0 <= self.threshold <= 1):
            raise QualityError(f"threshold {self.threshold}: must be a finite number in [0, 1]")


# ---- provider selection -------------------------------------------------------------------


def select_providers(backend: str) -> tuple[list[str], list[str], tuple[bool, str]]:
    """(providers, notes, (runtime available, detail)) for ``--backend``."""
    rt_ok, rt_why = bk.runtime_status()
    choices = {
        "auto": ["reference-dequant"] + (["runtime"] if rt_ok else []),
        "both": ["reference-dequant", "runtime"],
        "reference": ["reference-dequant"],
        "runtime": ["runtime"],
    }
    if backend not in choices:
        raise QualityError(f"--backend must be reference, runtime, both or auto, not {backend!r}")
    provs, notes = choices[backend], []
    if "runtime" in provs and not rt_ok:
        if backend == "runtime":
            raise QualityError(f"the llama.cpp runtime is not available: {rt_why}")
        provs.remove("runtime")
        notes.append(
            f"runtime not available ({rt_why}): quality comes from the PyTorch reference on "
            "dequantized GGUF weights only"
        )
    elif "runtime" not in provs:
        notes.append(
            "quality comes from the PyTorch reference on dequantized GGUF weights "
            "(the llama.cpp kernels are not exercised)"
        )
    return provs, notes, (rt_ok, rt_why)


def open_provider(prov: str, gguf: Path, threads: int, max_block: int | None = None):
    """(logit provider, generation function) of one GGUF; the runtime's batch holds a block
    of ``max_block`` (the sampling's block size, up to 1024)."""
    from ...generation.loader import RuntimeGenerator, TorchGenerator

    if prov == "reference-dequant":  # the Python generation loop on the dequantized weights
        qm = bk.load_dequantized(gguf)
        return bk.TorchProvider(qm, prov), TorchGenerator(qm).generate
    rt = bk.open_runtime(gguf, threads, max_block=max_block)
    # the runtime's own C++ generation loop (clover_generate), as users run it
    return bk.RuntimeProvider(rt), RuntimeGenerator(rt).generate


# ---- reference logits (load or compute) ---------------------------------------------------


@dataclass
class ReferenceLogits:
    """The reference's compact logits of every scored position, plus the full logits of the
    calibration positions; cached in ``reference-logits.npz`` and reused when its meta match."""

    compact: CompactLogits
    calib: torch.Tensor | None
    cidx: torch.Tensor | None
    seconds: float
    cached: bool  # written to / read from the cache file

    @classmethod
    def load_or_compute(cls, model, samples: SampleSet, top_k, exclude: int, meta: dict, cache, notes, log):
        t0 = time.perf_counter()
        if cache and cache.is_file():
            try:
                c, m, cl, ci = load_compact(cache)
                if all(m.get(k) == v for k, v in meta.items()):
                    log(f"reusing reference logits {cache}")
                    return cls(c, cl, ci, time.perf_counter() - t0, True)
            except Exception as e:  # unreadable cache: recompute
                notes.append(f"could not reuse {cache}: {e}")
        c, calib, cidx = reference_logits(bk.TorchProvider(model, "reference-bf16"), samples, top_k, exclude, log)
        if cache:
            save_compact(cache, c, meta, calib, cidx)
        return cls(c, calib, cidx, time.perf_counter() - t0, bool(cache))

    def describe(self, load_seconds: float, generation: dict) -> dict:
        tail = self.compact.tail_mass().numpy()
        return {
            "provider": "reference-bf16 (PyTorch, float32 compute on the BF16 checkpoint weights)",
            "nll_bits": float((-self.compact.target_logp.numpy() / np.log(2)).mean()),
            "load_seconds": load_seconds,
            "score_seconds": self.seconds,
            "compact": {
                "top_k": int(self.compact.k),
                "tail_mass_mean": float(tail.mean()),
                "tail_mass_p99": float(np.percentile(tail, 99)),
                "tail_mass_max": float(tail.max()),
                "file": "reference-logits.npz" if self.cached else None,
                "bound": "KL_c <= KL <= KL_c + delta per position (metrics.py)",
            },
            "generation": generation,
        }


# ---- generation agreement -----------------------------------------------------------------


class GenerationAgreement:
    """The reference's tokens for the prompt set, generated once; each provider's agreement."""

    def __init__(self, opts: Generation, ref_model, B: int, prompts: list[dict]):
        cfg = ref_model.config
        self.opts = opts
        self.cfg = {
            "max_new_tokens": opts.max_new_tokens,
            "block_size": B,
            "mask_token_id": cfg.mask_token_id,
            "eos_token_id": cfg.eos_token_id,
            "temperature": 0.0,
        }
        self.schedules = schedules(B, opts.steps, opts.threshold)
        self.prompts, self.reference = prompts, {}
        if opts.enabled:
            from ...generation.loader import TorchGenerator

            self.reference = run_generation(TorchGenerator(ref_model).generate, self.prompts, self.cfg, self.schedules)

    def wanted(self, provider: str) -> bool:
        return self.opts.enabled and (self.opts.providers is None or provider in self.opts.providers)

    def compare(self, gen_fn) -> dict:
        got = run_generation(gen_fn, self.prompts, self.cfg, self.schedules)
        return {
            s: {
                **agreement(self.reference[s]["tokens"], got[s]["tokens"]),
                "steps_per_block": got[s]["steps_per_block"],
                "ref_steps_per_block": self.reference[s]["steps_per_block"],
                "tokens_per_step": got[s]["tokens_per_step"],
            }
            for s in self.schedules
        }

    def describe(self) -> dict:
        return {
            **self.cfg,
            "schedules": self.schedules,
            "prompts": str(self.opts.prompts or DEFAULT_PROMPTS) if self.opts.enabled else None,
            "n_prompts": len(self.prompts),
        }

    def describe_reference(self) -> dict:
        return {
            s: {"steps_per_block": v["steps_per_block"], "tokens_per_step": v["tokens_per_step"]}
            for s, v in self.reference.items()
        }


# ---- scoring per GGUF ---------------------------------------------------------------------


def score_gguf(
    gguf: Path,
    name: str | None,
    provs,
    samples: SampleSet,
    ref: ReferenceLogits,
    gen: GenerationAgreement,
    threads,
    log,
) -> dict:
    """The GGUF's file info and, per provider, its summaries against the reference."""
    info = gguf_file_info(gguf)
    if name:
        info["name"] = name
    entry = {**info, "providers": {}}
    exclude = gen.cfg["mask_token_id"]
    for prov in provs:
        log(f"{gguf.name}: {prov}")
        t0 = time.perf_counter()
        p, gen_fn = open_provider(prov, gguf, threads, max_block=samples.block_size)
        t_load = time.perf_counter() - t0
        try:  # the GGUF's name on a non-finite step, scoring or generating
            pm, cal = score(p, samples, ref.compact, exclude, log, ref.calib, ref.cidx)
            res = summaries(pm, samples)
            res["calibration"] = cal
            res["seconds"] = {"load": t_load, "score": time.perf_counter() - t0 - t_load}
            if gen.wanted(prov):
                t1 = time.perf_counter()
                res["generation"] = gen.compare(gen_fn)
                res["seconds"]["generation"] = time.perf_counter() - t1
        except NonFiniteError as e:
            raise NonFiniteError(f"{gguf}: {e}") from None
        o = res["overall"]
        log(
            f"  KL mean {o['kl_mean']:.5f} (+<= {o['kl_mean_bound']:.1e})  p99 {o['kl_p99']:.4f}  "
            f"same-top1 {o['same_top1']:.4f}  NLL {o['q_nll_bits']:.4f} vs ref {o['ref_nll_bits']:.4f} bits"
        )
        entry["providers"][prov] = res
    return entry


# ---- the run ------------------------------------------------------------------------------


@dataclass
class QualityRun:
    """A quality run as written to ``quality.json`` (schema SCHEMA, kind "quality")."""

    config: dict
    samples: dict
    reference: dict
    runtime: dict
    models: list[dict]
    notes: list[str]
    seconds: float

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "kind": "quality",
            "config": self.config,
            "samples": self.samples,
            "reference": self.reference,
            "runtime": self.runtime,
            "models": self.models,
            "notes": self.notes,
            "seconds": self.seconds,
        }

    def save(self, path) -> Path:
        path = Path(path)
        write_json(path, self.to_dict())
        return path


_SAME_CONFIG = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "conv_kernel_size",
    "mask_token_id",
    "eos_token_id",
)


def tokens_sha256(tokens) -> str:
    h = hashlib.sha256()
    for t in tokens:
        b = t if isinstance(t, bytes) else t.encode("utf-8")
        h.update(len(b).to_bytes(4, "little") + b)
    return h.hexdigest()


def check_matches_reference(gguf: Path, reference: Path, cfg, reference_sha256=None) -> str | None:
    """The GGUF is a conversion of the reference: architecture, shapes and special ids of the
    config, every tensor's shape, the tokenizer's token strings (by hash), the source weights'
    fingerprint the converter recorded (clover_gguf.source_weights_sha256, compared with
    ``reference_sha256()``, by default convert.fingerprint.weights_sha256 of the reference), and
    the weights themselves: a few rows of every tensor, dequantized, within the type's error
    bound of the reference's (weights.compare_weights), whatever the fingerprint says.
    Raises QualityError naming the first difference; returns a note for a GGUF without the
    fingerprint (an older clover-gguf's or another converter's), checked by the rest only."""
    from ...convert.metadata import load_vocab
    from ...gguf_io.reader import config_from_reader, gguf_shapes, open_gguf, shown_name, token_strings

    def differs(what: str):
        return QualityError(f"{gguf}: does not match the reference {reference}: {what}")

    r = open_gguf(gguf)
    q = config_from_reader(r, gguf)  # also every check the runtime makes (GGUFReadError)
    for key in _SAME_CONFIG:
        a, b = getattr(q, key), getattr(cfg, key)
        if a != b:
            raise differs(f"{key} is {a}, the reference's is {b}")
    want = gguf_shapes(cfg)
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        if want.get(t.name) != shape:
            raise differs(
                f"tensor {shown_name(t.name.encode())} has shape {list(shape)}, the reference's is {list(want.get(t.name, ()))}"
            )
    try:
        vocab, _ = load_vocab(reference, cfg)
    except Exception as e:  # the converter's own error (ConvertError): the reference's tokenizer is broken
        raise QualityError(f"{reference}: {e}") from None
    got, ref = token_strings(r), vocab.tokens
    if tokens_sha256(got) != tokens_sha256(ref):
        i = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b.encode("utf-8")), min(len(got), len(ref)))
        a = got[i].decode("utf-8", "replace") if i < len(got) else None
        b = ref[i] if i < len(ref) else None
        raise differs(
            f"tokenizer token strings differ (sha256 {tokens_sha256(got)[:12]} vs {tokens_sha256(ref)[:12]}; "
            f"first at token {i}: {a!r} vs {b!r})"
        )
    note = _check_weights_sha256(r, gguf, reference, reference_sha256, differs)
    from ...checkpoint import CheckpointError
    from .weights import compare_weights

    try:
        ck = Checkpoint(reference, cfg)
        ck.validate()  # names, shapes and dtypes: the rows read below are the ones meant
    except CheckpointError as e:  # the reference's own fault, named by the checkpoint reader
        raise QualityError(str(e)) from None
    why = compare_weights(r, ck)
    if why:
        raise differs(f"{why}: it is not a conversion of this reference, whatever its fingerprint says")
    return note


def _check_weights_sha256(r, gguf: Path, reference: Path, reference_sha256, differs) -> str | None:
    from ...checkpoint import Checkpoint
    from ...constants import Keys
    from ...convert.fingerprint import weights_sha256

    f = r.fields.get(Keys.SOURCE_WEIGHTS_SHA256)
    if f is None:
        return (
            f"{gguf.name} has no {Keys.SOURCE_WEIGHTS_SHA256} (converted by an older clover-gguf or another "
            "converter): matched to the reference by config, shapes and tokenizer only"
        )
    try:
        got = bytes(f.parts[f.data[0]]).decode("ascii")
    except (IndexError, UnicodeDecodeError, TypeError):
        got = None
    want = reference_sha256() if reference_sha256 is not None else weights_sha256(Checkpoint(reference))
    if got != want:
        raise differs(
            f"its source weights' fingerprint ({Keys.SOURCE_WEIGHTS_SHA256}) is "
            f"{(got or 'not a sha256')[:16]}..., the reference's weights hash to {want[:16]}...: it is not a "
            "conversion of this reference"
        )
    return None


def _tokenizer(model_dir: Path):
    if not (model_dir / "tokenizer.json").is_file():
        return None
    from ...tokenizer import CloverTokenizer

    return CloverTokenizer.from_dir(model_dir)


def checked_inputs(sampling: Sampling, generation: Generation, threads, reference, ggufs, out_dir):
    """The run's settings checked (QualityError naming the bad one), paths as Paths, threads
    defaulted, out_dir created: (threads, reference, ggufs, out_dir)."""
    sampling.validate()
    generation.validate()
    if threads is not None and threads < 1:
        raise QualityError(f"threads {threads}: must be at least 1")
    threads = threads or default_threads()
    reference, ggufs = Path(reference), [Path(g) for g in ggufs]
    for g in ggufs:
        if not g.is_file():
            raise QualityError(f"GGUF not found: {g}")
    out_dir = Path(out_dir) if out_dir else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    return threads, reference, ggufs, out_dir


def mismatch_notes(ggufs: list[Path], reference: Path, cfg: CloverConfig) -> list[str]:
    """check_matches_reference for each GGUF, before any scoring (a GGUF of another model would
    score nonsense); the reference's weights are hashed once, only if a GGUF needs it."""
    ref_sha = functools.cache(lambda: weights_sha256(Checkpoint(reference)))
    return [n for n in (check_matches_reference(g, reference, cfg, ref_sha) for g in ggufs) if n]


def cached_reference_logits(ref_model, ref_hash: str, reference: Path, samples, top_k: int, cfg: CloverConfig, out_dir,
                     notes: list[str], log=print) -> ReferenceLogits:  # fmt: skip
    """The reference's compact logits on the samples, from out_dir's reference-logits.npz when it
    was computed for this reference, these samples and this top_k, else computed (and saved)."""
    cache_meta = {
        "reference": str(reference),
        "reference_sha256": ref_hash,
        "samples": samples.fingerprint(),
        "top_k": top_k,
        "exclude_token": cfg.mask_token_id,
    }
    return ReferenceLogits.load_or_compute(
        ref_model,
        samples,
        top_k,
        cfg.mask_token_id,
        cache_meta,
        out_dir / "reference-logits.npz" if out_dir else None,
        notes,
        log,
    )


def run_quality(
    reference,
    ggufs,
    sampling: Sampling | None = None,
    generation: Generation | None = None,
    backend: str = "auto",
    out_dir=None,
    *,
    threads: int | None = None,
    runtime_threads: int | None = None,
    names: list[str] | None = None,
    log=print,
) -> QualityRun:
    """Compare GGUFs with the reference; writes ``quality.json`` and ``reference-logits.npz``
    under ``out_dir`` (when given). See the module docstring."""
    t_start = time.perf_counter()
    sampling, generation = sampling or Sampling(), generation or Generation()
    threads, reference, ggufs, out_dir = checked_inputs(sampling, generation, threads, reference, ggufs, out_dir)
    torch.set_num_threads(threads)
    provs, notes, (rt_ok, rt_why) = select_providers(backend)

    cfg = CloverConfig.load(reference)
    notes += mismatch_notes(ggufs, reference, cfg)  # before any scoring
    B = int(sampling.block_size or cfg.block_size)
    tokenizer = _tokenizer(reference)
    prompts = generation.load_prompts(tokenizer, cfg.vocab_size)
    samples = sampling.build(B, cfg.mask_token_id, tokenizer)  # checks what the corpus can supply
    log(
        f"samples: {len(samples.windows)} windows x <= {sampling.n_blocks} blocks of {B}, ratios "
        f"{list(samples.ratios)}, {samples.n_positions} scored positions"
    )
    log(f"loading reference {reference}")
    ref_model, t_load = bk.timed(bk.load_reference, reference)
    ref_hash = bk.model_dir_hash(reference)
    ref = cached_reference_logits(ref_model, ref_hash, reference, samples, sampling.top_k, cfg, out_dir, notes, log)
    gen = GenerationAgreement(generation, ref_model, B, prompts)
    rt_threads = runtime_threads or threads
    models = [
        score_gguf(g, names[i] if names and i < len(names) else None, provs, samples, ref, gen, rt_threads, log)
        for i, g in enumerate(ggufs)
    ]
    run = QualityRun(
        config={
            "reference": str(reference),
            "reference_sha256": ref_hash,
            "ggufs": [str(g) for g in ggufs],
            "providers": provs,
            "backend_option": backend,
            "block_size": B,
            "top_k": sampling.top_k,
            "threads": threads,
            "runtime_threads": rt_threads,
            "generation_providers": list(generation.providers) if generation.providers else provs,
            "n_windows": sampling.n_windows,
            "n_blocks": sampling.n_blocks,
            "ratios": list(samples.ratios),
            "seed": sampling.seed,
            "generation": gen.describe(),
            "kl_units": "nats",
            "nll_units": "bits/token",
            "mask_token_excluded": True,
            "environment": environment(threads),
        },
        samples=samples.describe(),
        reference=ref.describe(t_load, gen.describe_reference()),
        runtime={"available": rt_ok, "detail": rt_why},
        models=models,
        notes=notes,
        seconds=time.perf_counter() - t_start,
    )
    if out_dir:
        run.save(out_dir / "quality.json")
    return run
