"""`clover-gguf eval quality`: how far each GGUF is from the BF16 reference.

Pipeline (docs in the module docstrings of corpus.py and metrics.py):

1. corpus -> windows of blocks -> masked copies at several ratios (fixed seeds);
2. the reference (PyTorch, BF16 weights) scores every masked position once; its logits are
   saved compactly (top-k + log-sum-exp + true-token log-prob, ``reference-logits.npz``)
   and reused by every later comparison on the same samples;
3. each GGUF runs through the chosen providers (``reference-dequant``: the PyTorch
   reference on its dequantized weights; ``runtime``: the patched llama.cpp) and each
   scored position gives NLL, KL ref‖q (from the compact form, with its error bound),
   same-top-1 and Δp; summaries overall, per mask ratio, per history length (blocks
   committed before the scored block) and for the long-range recall probes;
4. greedy generation of a prompt set with a ``steps`` and a ``threshold`` schedule:
   agreement with the reference's tokens, steps per block.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from ..util import EVALDATA, default_threads
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
from .sysinfo import environment, gguf_file_info

DEFAULT_PROMPTS = EVALDATA / "prompts" / "clover-tiny-code.jsonl"
DEFAULT_TOP_K = "auto"
SCHEMA = "clover-gguf-eval/1"


class QualityError(RuntimeError):
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
    np.savez(path, meta=np.array(json.dumps(meta)), **c.to_numpy(), **extra)


def load_compact(path: Path):
    with np.load(path) as z:
        meta = json.loads(str(z["meta"]))
        c = CompactLogits.from_numpy({k: z[k] for k in ("top_ids", "top_logits", "lse", "target_logp", "tail_logp")})
        calib = torch.from_numpy(z["calib_logits"]) if "calib_logits" in z else None
        cidx = torch.from_numpy(z["calib_idx"]).long() if "calib_idx" in z else None
        return c, meta, calib, cidx


# ---- scoring ----------------------------------------------------------------------------


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


def load_prompts(path, tokenizer=None, limit: int | None = None) -> list[dict]:
    """JSONL: {"id", "text"} (needs the tokenizer) or {"id", "ids": [...]} per line."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        o = json.loads(line)
        if "ids" in o:
            ids = [int(x) for x in o["ids"]]
        elif tokenizer is not None:
            ids = tokenizer.encode(o["text"])
        else:
            raise QualityError(f"{path}:{i + 1}: a text prompt needs a tokenizer (none in the model dir)")
        out.append({"id": o.get("id", str(i)), "ids": ids})
    return out[:limit] if limit else out


def schedules(block_size: int, steps: int | None = None, threshold: float = 0.9) -> dict[str, dict]:
    s = steps if steps is not None else max(1, block_size // 2)
    return {
        f"steps={s}": {"steps": s, "threshold": None},
        f"threshold={threshold:g}": {"steps": None, "threshold": threshold},
    }


def run_generation(gen_fn, prompts, cfg_base: dict, scheds: dict) -> dict:
    """gen_fn(prompt_ids, GenerationConfig) -> GenerationResult, for each prompt and schedule:
    {schedule: {"tokens": [[...]], "steps_per_block", "tokens_per_step", "seconds"}}"""
    from ..reference.generate import GenerationConfig

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


# ---- the command ------------------------------------------------------------------------


def _gen_backend_torch(model):
    """The Python generation loop (generate.generate) on the PyTorch model."""
    from ..reference.generate import TorchBackend, generate

    return lambda prompt, cfg: generate(TorchBackend(model), prompt, cfg)


def _gen_backend_runtime(rt):
    """The runtime's own C++ generation loop (clover_generate), as users run it."""
    return lambda prompt, cfg: rt.generate(prompt, cfg)


def run_quality(
    reference,
    ggufs,
    corpus=None,
    backend: str = "auto",
    out_dir=None,
    *,
    docs: list[Document] | None = None,
    n_windows: int = 6,
    n_blocks: int = 64,
    block_size: int | None = None,
    ratios=DEFAULT_RATIOS,
    seed: int = DEFAULT_SEED,
    top_k=DEFAULT_TOP_K,
    prompts=None,
    max_new_tokens: int = 64,
    gen_steps: int | None = None,
    gen_threshold: float = 0.9,
    n_prompts: int | None = None,
    threads: int | None = None,
    runtime_threads: int | None = None,
    generation_providers=None,
    generation: bool = True,
    names: list[str] | None = None,
    log=print,
) -> dict:
    """Compare GGUFs with the reference; returns the run dict and writes ``quality.json`` and
    ``reference-logits.npz`` under ``out_dir`` (when given). See the module docstring."""
    t_start = time.perf_counter()
    threads = threads or default_threads()
    torch.set_num_threads(threads)
    reference = Path(reference)
    ggufs = [Path(g) for g in ggufs]
    for g in ggufs:
        if not g.is_file():
            raise QualityError(f"GGUF not found: {g}")
    out_dir = Path(out_dir) if out_dir else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    notes = []

    # providers to use
    rt_ok, rt_why = bk.runtime_status()
    if backend == "auto":
        provs = ["reference-dequant"] + (["runtime"] if rt_ok else [])
    elif backend == "both":
        provs = ["reference-dequant", "runtime"]
    elif backend == "reference":
        provs = ["reference-dequant"]
    elif backend == "runtime":
        provs = ["runtime"]
    else:
        raise QualityError(f"--backend must be reference, runtime, both or auto, not {backend!r}")
    if "runtime" in provs and not rt_ok:
        if backend in ("runtime",):
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

    # reference model, tokenizer, corpus, samples
    log(f"loading reference {reference}")
    ref_model, t_load = bk.timed(bk.load_reference, reference)
    cfg = ref_model.config
    B = int(block_size or cfg.block_size)
    tokenizer = None
    if (reference / "tokenizer.json").is_file():
        from ..tokenizer import CloverTokenizer

        tokenizer = CloverTokenizer.from_dir(reference)
    if docs is None:
        docs, cinfo = load_corpus(corpus, tokenizer)
    else:
        cinfo = {
            "corpus": "documents given by the caller (token ids)",
            "documents": len(docs),
            "tokens": int(sum(len(d.tokens) for d in docs)),
        }
    samples = build_samples(
        docs,
        B,
        n_windows,
        n_blocks,
        ratios,
        seed,
        cfg.mask_token_id,
        identifier_predicate(tokenizer) if tokenizer else None,
        cinfo,
    )
    log(
        f"samples: {len(samples.windows)} windows x <= {n_blocks} blocks of {B}, ratios {list(samples.ratios)}, "
        f"{samples.n_positions} scored positions"
    )
    exclude = cfg.mask_token_id

    # reference compact logits (cached under out_dir)
    ref_hash = bk.model_dir_hash(reference)
    cmeta = {
        "reference": str(reference),
        "reference_sha256": ref_hash,
        "samples": samples.fingerprint(),
        "top_k": top_k,
        "exclude_token": exclude,
    }
    cpath = out_dir / "reference-logits.npz" if out_dir else None
    ref_c, calib, cidx = None, None, None
    if cpath and cpath.is_file():
        try:
            c, m, cl, ci = load_compact(cpath)
            if all(m.get(k) == v for k, v in cmeta.items()):
                ref_c, calib, cidx = c, cl, ci
                log(f"reusing reference logits {cpath}")
        except Exception as e:  # unreadable cache: recompute
            notes.append(f"could not reuse {cpath}: {e}")
    t0 = time.perf_counter()
    ref_prov = bk.TorchProvider(ref_model, "reference-bf16")
    if ref_c is None:
        ref_c, calib, cidx = reference_logits(ref_prov, samples, top_k, exclude, log)
        if cpath:
            save_compact(cpath, ref_c, cmeta, calib, cidx)
    t_ref = time.perf_counter() - t0
    tail = ref_c.tail_mass().numpy()
    ref_nll = float((-ref_c.target_logp.numpy() / np.log(2)).mean())

    # reference generation
    gen_cfg = {
        "max_new_tokens": max_new_tokens,
        "block_size": B,
        "mask_token_id": cfg.mask_token_id,
        "eos_token_id": cfg.eos_token_id,
        "temperature": 0.0,
    }
    scheds = schedules(B, gen_steps, gen_threshold)
    plist, ref_gen = [], None
    if generation:
        ppath = Path(prompts) if prompts else DEFAULT_PROMPTS
        plist = load_prompts(ppath, tokenizer, n_prompts)
        ref_gen = run_generation(_gen_backend_torch(ref_model), plist, gen_cfg, scheds)

    models = []
    for gi, g in enumerate(ggufs):
        info = gguf_file_info(g)
        if names and gi < len(names):
            info["name"] = names[gi]
        entry = {**info, "providers": {}}
        for prov in provs:
            log(f"{g.name}: {prov}")
            t0 = time.perf_counter()
            if prov == "reference-dequant":
                qm = bk.load_dequantized(g)
                p = bk.TorchProvider(qm, prov)
                make_gen = _gen_backend_torch(qm)
            else:
                rt = bk.open_runtime(g, runtime_threads or threads)
                p = bk.RuntimeProvider(rt)
                make_gen = _gen_backend_runtime(rt)
            t_load_q = time.perf_counter() - t0
            pm, cal = score(p, samples, ref_c, exclude, log, calib, cidx)
            res = summaries(pm, samples)
            res["calibration"] = cal
            res["seconds"] = {"load": t_load_q, "score": time.perf_counter() - t0 - t_load_q}
            if generation and (generation_providers is None or prov in generation_providers):
                t1 = time.perf_counter()
                qg = run_generation(make_gen, plist, gen_cfg, scheds)
                res["generation"] = {}
                for s in scheds:
                    a = agreement(ref_gen[s]["tokens"], qg[s]["tokens"])
                    res["generation"][s] = {
                        **a,
                        "steps_per_block": qg[s]["steps_per_block"],
                        "ref_steps_per_block": ref_gen[s]["steps_per_block"],
                        "tokens_per_step": qg[s]["tokens_per_step"],
                    }
                res["seconds"]["generation"] = time.perf_counter() - t1
            o = res["overall"]
            log(
                f"  KL mean {o['kl_mean']:.5f} (+<= {o['kl_mean_bound']:.1e})  p99 {o['kl_p99']:.4f}  "
                f"same-top1 {o['same_top1']:.4f}  NLL {o['q_nll_bits']:.4f} vs ref {o['ref_nll_bits']:.4f} bits"
            )
            entry["providers"][prov] = res
            del p
        models.append(entry)

    run = {
        "schema": SCHEMA,
        "kind": "quality",
        "config": {
            "reference": str(reference),
            "reference_sha256": ref_hash,
            "ggufs": [str(g) for g in ggufs],
            "providers": provs,
            "backend_option": backend,
            "block_size": B,
            "top_k": top_k,
            "threads": threads or torch.get_num_threads(),
            "runtime_threads": runtime_threads or threads,
            "generation_providers": list(generation_providers) if generation_providers else provs,
            "n_windows": n_windows,
            "n_blocks": n_blocks,
            "ratios": list(samples.ratios),
            "seed": seed,
            "generation": {
                **gen_cfg,
                "schedules": scheds,
                "prompts": str(prompts or DEFAULT_PROMPTS) if generation else None,
                "n_prompts": len(plist),
            },
            "kl_units": "nats",
            "nll_units": "bits/token",
            "mask_token_excluded": True,
            "environment": environment(threads or torch.get_num_threads()),
        },
        "samples": samples.describe(),
        "reference": {
            "provider": "reference-bf16 (PyTorch, float32 compute on the BF16 checkpoint weights)",
            "nll_bits": ref_nll,
            "load_seconds": t_load,
            "score_seconds": t_ref,
            "compact": {
                "top_k": int(ref_c.k),
                "tail_mass_mean": float(tail.mean()),
                "tail_mass_p99": float(np.percentile(tail, 99)),
                "tail_mass_max": float(tail.max()),
                "file": "reference-logits.npz" if cpath else None,
                "bound": "KL_c <= KL <= KL_c + delta per position (metrics.py)",
            },
            "generation": {
                s: {"steps_per_block": v["steps_per_block"], "tokens_per_step": v["tokens_per_step"]}
                for s, v in (ref_gen or {}).items()
            },
        },
        "runtime": {"available": rt_ok, "detail": rt_why},
        "models": models,
        "notes": notes,
        "seconds": time.perf_counter() - t_start,
    }
    if out_dir:
        (out_dir / "quality.json").write_text(json.dumps(run, indent=1) + "\n")
    return run
