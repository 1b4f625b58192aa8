"""Clover's passes side by side with llama.cpp's own, one build, one process: a synthetic
Clover-35B-A3B and its Qwen3-MoE twin, interleaved round by round. What each pass is, as the
report states it: ABOUT in render/passes.py.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...config import preset
from ...outputs import write_json
from ...reference.generate import GenerationConfig
from ..quality.metrics import spread
from ..render.passes import render_passes

HEADS = {  # lm_head variants: experts Q4_K, the rest Q8_0 | q4_k_m (Q6_K output)
    "q8_0": dict(recipe=None, outtype="q8_0", experts="q4_k"),
    "q4_k_m": dict(recipe="q4_k_m"),
}
# targets of the runtime issue: Clover time / upstream time
TARGETS = {"commit": 1.0, "denoise": 1.1, "prefill": 1 / 0.95}


@dataclass
class PassesConfig:
    layers: tuple[int, ...] = (2, 4)
    threads: tuple[int, ...] = (1, 2)
    heads: tuple[str, ...] = ("q8_0", "q4_k_m")
    rounds: int = 5
    n_gpu_layers: int = 0
    block: int = 32
    prompt: int = 64
    prefill: int = 256
    gen_tokens: int = 64
    steps: tuple[int, ...] = (8, 16)
    masked: tuple[int, ...] = (32, 16, 4)
    work: Path = Path("out/bench-passes-work")
    out: Path = Path("out/bench-passes")
    seed: int = 0
    extra: dict = field(default_factory=dict)


def model_pair(work: Path, layers: int, head: str, log=print) -> tuple[Path, Path]:
    """The synthetic Clover GGUF and its Qwen3-MoE twin (written once, reused)."""
    from ...synthetic import write_synthetic_gguf
    from .upstream import write_twin

    work.mkdir(parents=True, exist_ok=True)
    clover = work / f"clover-35b-a3b-{layers}l-{head}.gguf"
    twin = work / f"qwen3moe-twin-{layers}l-{head}.gguf"
    if not clover.exists():
        log(f"writing {clover}")
        write_synthetic_gguf(clover, preset("clover-35b-a3b"), layers=layers, progress=False, **HEADS[head])
    if not twin.exists():
        log(f"writing {twin}")
        write_twin(clover, twin)
    return clover, twin


def _timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - t) * 1e3


def measure(clover: Path, twin: Path, threads: int, cfg: PassesConfig, log=print) -> dict:
    """Interleaved rounds of every pass on one thread count; ms per pass (or tok/s)."""
    from ...reference.sampling import step_key
    from ...runtime.runtime import CloverRuntime
    from .upstream import Upstream

    B, P = cfg.block, cfg.prompt
    rng = random.Random(cfg.seed)
    rt = CloverRuntime(clover, n_threads=threads, n_gpu_layers=cfg.n_gpu_layers, n_ubatch=512, n_ctx=4096)
    up = Upstream(twin, n_threads=threads, n_gpu_layers=cfg.n_gpu_layers, n_batch=512, n_ctx=4096)
    V, mask = rt.n_vocab, rt.mask_token_id
    ids = lambda n: [rng.randrange(256, V - 8) for _ in range(n)]  # noqa: E731
    prompt, block, long = ids(P), ids(B), ids(cfg.prefill)
    m: dict[str, list[float]] = defaultdict(list)
    breakdown: dict[str, list[dict]] = defaultdict(list)
    try:
        for r in range(cfg.rounds + 1):  # round 0 warms up
            keep = r > 0
            rt.reset()
            rt.commit(prompt, B)
            t_c = _timed(rt.commit, block, B)
            up.clear()
            up.decode(prompt, 0, 1)
            t_u = _timed(up.decode, block, P, 0)
            up.forget_from(P)
            if keep:
                m["commit/clover"].append(t_c)
                m["commit/upstream"].append(t_u)
            for n in cfg.masked:
                blk = list(block)
                for i in rng.sample(range(B), n):
                    blk[i] = mask
                t_c = _timed(rt.block_candidates, blk, 0.0, step_key(r, 0, n))
                t_u = _timed(up.decode, block, P, n)
                up.forget_from(P)
                if keep:
                    m[f"denoise{n}/clover"].append(t_c)
                    m[f"denoise{n}/upstream"].append(t_u)
            rt.reset()
            t_c = _timed(rt.commit, long, B)
            up.clear()
            t_u = _timed(up.decode, long, 0, 1)
            if keep:
                m["prefill/clover"].append(cfg.prefill / t_c * 1e3)
                m["prefill/upstream"].append(cfg.prefill / t_u * 1e3)
            for steps in cfg.steps:
                g = GenerationConfig(max_new_tokens=cfg.gen_tokens, block_size=B, steps=steps)
                rt.generate(prompt, g)
                pf = rt.last_perf
                if keep:
                    m[f"gen{steps}/clover"].append(pf["n_gen"] / pf["t_gen_ms"] * 1e3)
                    n_steps = max(1, pf["n_steps"])
                    breakdown[f"gen{steps}"].append(
                        {
                            "ms_per_step": (pf["t_gen_ms"] - pf["t_commit_ms"]) / n_steps,
                            "graph_build_ms": pf["t_step_graph_ms"] / n_steps,
                            "compute_ms": pf["t_step_compute_ms"] / n_steps,
                            "host_ms": pf["t_step_host_ms"] / n_steps,
                            "other_ms": pf["t_step_other_ms"] / n_steps,
                            "graphs_built": pf["n_step_graphs"],
                            "steps": pf["n_steps"],
                            "steps_on_device": pf["n_steps_device"],
                            "commit_ms_per_block": pf["t_commit_ms"] / max(1, pf["n_blocks"] - 1),
                        }
                    )
            up.clear()
            up.decode(prompt, 0, 1)
            toks = ids(cfg.gen_tokens)
            t_u = _timed(up.decode_each, toks, P)
            if keep:
                m["tg/upstream"].append(cfg.gen_tokens / t_u * 1e3)
            log(f"    round {r}{' (warm-up)' if not keep else ''} done")
    finally:
        rt.close()
        up.close()
    out = {k: spread(v) for k, v in m.items()}
    out["breakdown"] = {k: {f: spread([d[f] for d in v])["median"] for f in v[0]} for k, v in breakdown.items() if v}
    return out


def ratios(res: dict, cfg: PassesConfig) -> dict:
    """Clover time / upstream time for each pass (generation: upstream tg / Clover tok/s)."""
    med = lambda k: res[k]["median"]  # noqa: E731
    out = {
        "commit": med("commit/clover") / med("commit/upstream"),
        "prefill": med("prefill/upstream") / med("prefill/clover"),
    }
    for n in cfg.masked:
        out[f"denoise{n}"] = med(f"denoise{n}/clover") / med(f"denoise{n}/upstream")
    for s in cfg.steps:
        out[f"gen{s}_vs_tg"] = med(f"gen{s}/clover") / med("tg/upstream")
    return out


def run_passes(cfg: PassesConfig, log=print) -> dict:
    from ..sysinfo import environment

    runs = []
    env0 = environment(threads=max(cfg.threads))
    for layers in cfg.layers:
        for head in cfg.heads:
            clover, twin = model_pair(cfg.work, layers, head, log)
            for threads in cfg.threads:
                log(f"  {layers} layers, lm_head {head}, {threads} thread(s)")
                res = measure(clover, twin, threads, cfg, log)
                runs.append(
                    {"layers": layers, "head": head, "threads": threads, "results": res, "ratios": ratios(res, cfg)}
                )
    bundle = {
        "schema": "clover-gguf-eval/1",
        "kind": "passes",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "targets": TARGETS,
        "environment": env0,
        "environment_end": environment(threads=max(cfg.threads)),
        "runs": runs,
    }
    cfg.out.mkdir(parents=True, exist_ok=True)
    write_json(cfg.out / "passes.json", bundle)
    render_passes(bundle, cfg.out)
    return bundle
