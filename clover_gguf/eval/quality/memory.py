"""`clover-gguf eval memory`: what quantization and the block size do to Clover's compressed
memory (issue 46).

Everything before the current block reaches a Clover only through its Gated DeltaNet state, so
an instruction or a fact from the start of a long agent trace must survive N tool results in
that state. The traces (train/memory_traces.py: held-out files only, rendered as the transcripts
of `eval tools` are) put an instruction or a fact in the first request, N filler tool results
after it, and a final request that needs it; each file generates the final turn after the
trace's history, as the server renders the request, and the reply is read as the server reads
it (tools.py: `<tool_call>` sections, validated against the offered tools' schemas).

Per file (the BF16 PyTorch reference, free decoding; each GGUF through the runtime, free and/or
constrained = the server's lazy tool_choice "auto" grammar), block size (prefill commits in
blocks of that size too) and N: exact recall (the call carries the fact exactly), compliance
(the instruction's rule holds), the rule's rate on control traces without the instruction
(how often it holds anyway), valid calls, tokens per denoising step, and the distance in tokens
from the fact to the end of the prompt. A figure is the median and p10/p90 over seeds (each
seed an independent draw of the traces) of the rate within the seed.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ...train import memory_traces as MT
from .metrics import spread
from .tool_blocks import IM_END, gen_config
from .tools import MODES, ReferenceDecoder, RuntimeDecoder, generate_turn, outside_call

BLOCK_SIZES = (8, 16, 32, 64)
N_RESULTS = (1, 4, 16, 64)
# the groups a figure is given for: the two families, each kind, and the controls
GROUPS = ("every", "recall", "compliance", "control", *MT.KINDS, *(f"control_{k}" for k in MT.COMPLIANCE_KINDS))
FIGURES = ("recall", "recall_path", "compliance", "valid_calls", "called", "right_tool", "tokens_per_step")
TEXT_KEEP = 200  # characters of each reply kept in the records


@dataclass
class MemoryConfig:
    block_sizes: tuple = BLOCK_SIZES
    n_results: tuple = N_RESULTS
    seeds: int = 3  # independent draws of the traces: seeds first_seed .. first_seed + seeds - 1
    first_seed: int = 0
    traces: int = 1  # traces per kind and seed
    kinds: tuple = MT.KINDS
    controls: bool = True  # compliance kinds also without their instruction
    probe: bool = True  # recall traces: the likelihood of the fact's path against distractors
    modes: tuple = MODES  # the GGUFs' decoding (the reference decodes free)
    max_new_tokens: int = 64
    steps: int | None = None
    threshold: float = 0.9
    temperature: float = 0.0
    threads: int | None = None


def check_config(cfg: MemoryConfig) -> None:
    """ValueError naming the option, before anything loads."""
    from ...limits import BY_CONFIG

    bmax = int(BY_CONFIG["block_size"].hi)
    if not cfg.block_sizes or any(not 1 <= b <= bmax for b in cfg.block_sizes):
        raise ValueError(f"--block-sizes {','.join(map(str, cfg.block_sizes))}: each must be in [1, {bmax}]")
    if not cfg.n_results or any(n < 0 or n > 1024 for n in cfg.n_results):
        raise ValueError(f"--n-results {','.join(map(str, cfg.n_results))}: each must be in [0, 1024]")
    if cfg.steps is not None and cfg.steps > min(cfg.block_sizes):
        raise ValueError(f"--steps {cfg.steps}: must be at most the smallest block size ({min(cfg.block_sizes)})")
    bad = [m for m in cfg.modes if m not in MODES]
    if bad or not cfg.modes:
        raise ValueError(f"--modes: {bad[0] if bad else '(none)'!r} is not one of {', '.join(MODES)}")
    bad = [k for k in cfg.kinds if k not in MT.KINDS]
    if bad or not cfg.kinds:
        raise ValueError(f"--kinds: {bad[0] if bad else '(none)'!r} is not one of {', '.join(MT.KINDS)}")
    if cfg.seeds < 1 or cfg.traces < 1:
        raise ValueError("--seeds and --traces must be at least 1")


# ----------------------------------------------------------------------------- traces


def trace_indices(cfg: MemoryConfig) -> list[int]:
    """The trace indices of one seed: `traces` of each chosen kind (kinds rotate with the index)."""
    per = len(MT.KINDS)
    return [r * per + MT.KINDS.index(k) for r in range(cfg.traces) for k in cfg.kinds]


def fact_distance(tok, trace: dict, schemas=None) -> tuple[int, int | None]:
    """(prompt tokens, tokens from the fact to the end of the prompt): the prompt as the
    reference renders it; the fact's position is the token holding the first character of its
    first occurrence (None for a control trace)."""
    from ...train.transcripts import render_prompt

    text = render_prompt(tok, trace, MT.final_index(trace), schemas)
    enc = tok._tok.encode(text, add_special_tokens=False)
    n = len(enc.ids)
    if not trace["fact"]:
        return n, None
    at = text.find(trace["fact"]["text"])
    if at < 0:
        raise AssertionError(f"{trace['id']}: the fact is not in its prompt")
    first = next(i for i, (a, b) in enumerate(enc.offsets) if b > at)
    return n, n - first


def make_turns(cfg: MemoryConfig, tok) -> list[dict]:
    """Every (seed, trace, N[, control]) turn: the trace, its final assistant turn as tools.py's
    turns hold it, and its distances."""
    from ...train.toolset import TOOLS
    from ...train.transcripts import expected_calls, render_prompt, render_training_text

    turns = []
    for s in range(cfg.first_seed, cfg.first_seed + cfg.seeds):
        for i in trace_indices(cfg):
            controls = [False, True] if cfg.controls and MT.kind_of(i) in MT.COMPLIANCE_KINDS else [False]
            for n in cfg.n_results:
                for ctl in controls:
                    t = MT.make_trace(s, i, n, control=ctl)
                    k = MT.final_index(t)
                    n_tok, dist = fact_distance(tok, t)
                    reply = None
                    if t["probe"]:  # the expected reply as training renders it, after the prompt
                        full, head = render_training_text(tok, t), render_prompt(tok, t, k)
                        if not full.startswith(head):
                            raise AssertionError(f"{t['id']}: the prompt is not a prefix of the trace")
                        reply = full[len(head) :]
                    turns.append(
                        {
                            "id": t["id"],
                            "transcript": t,
                            "k": k,
                            "thinking": t["mode"] != "nothink",
                            "tools": [TOOLS[x] for x in t["tools"]],
                            "expected": expected_calls(t["messages"][k]),
                            "prompt_tokens": n_tok,
                            "distance": dist,
                            "reply_text": reply,
                        }
                    )
    return turns


# ----------------------------------------------------------------------------- one reply


def run_reply(dec, turn: dict, cfg: MemoryConfig, mode: str, block_size: int) -> dict:
    """Generate the final turn of one trace with this block size and read it."""
    t = turn["transcript"]
    gt = generate_turn(dec, turn, gen_config(dec, cfg, t["seed"], block_size=block_size), mode)
    ids, res, text, content, calls = gt.ids, gt.res, gt.text, gt.content, gt.sections
    ended = IM_END in text or dec.eos in res.tokens
    score = MT.score_reply(t, calls, content, ended)
    if t["check"]["type"] == "one_sentence" and outside_call(content):
        score["compliance"] = False  # a call's JSON written as text is no answer
    return {
        "id": turn["id"],
        "kind": t["kind"],
        "control": t["control"],
        "seed": t["seed"],
        "n_results": t["n_results"],
        "block_size": block_size,
        "mode": mode,
        "text": text.split(IM_END)[0][:TEXT_KEEP],
        "calls": [{k: c[k] for k in ("name", "arguments", "schema")} for c in calls if c["json"]],
        "ended": ended,
        "score": score,
        "prompt_tokens": len(ids),
        "distance": turn["distance"],
        "tokens": len(res.tokens),
        "steps": sum(b.steps for b in res.blocks),
        "committed": sum(b.n_tokens for b in res.blocks),
        "call_blocks": gt.blocks["call"],  # [tokens, steps] of the blocks mostly inside a call
    }


def _path_scores(dec, turn: dict, prefix: str, candidates: list[str], block_size: int) -> list[tuple[float, bool]]:
    """(mean log-probability per token, greedy writes it) of each candidate written left to right
    after the turn's prompt and `prefix`, in the block after them."""
    import torch

    from .metrics import masked_log_softmax

    ids, pre = dec.prompt(turn), dec.gen.tokenize(prefix)
    backend = dec.backend()
    backend.prefill(ids + pre, block_size)
    rows: dict[tuple, torch.Tensor] = {}  # visible tokens -> log-probabilities at the next position

    def row(seen: tuple) -> torch.Tensor:
        if seen not in rows:
            block = list(seen) + [dec.mask] * (block_size - len(seen))
            logits = torch.as_tensor(backend.block_logits(block)).float()[len(seen)]
            rows[seen] = masked_log_softmax(logits, dec.mask)
        return rows[seen]

    out = []
    for c in candidates:
        both = dec.gen.tokenize(prefix + c)
        t = (both[len(pre) :] if both[: len(pre)] == pre else dec.gen.tokenize(c))[:block_size]
        lps = [row(tuple(t[:i])) for i in range(len(t))]
        mean = float(sum(lp[x] for lp, x in zip(lps, t))) / len(t)
        out.append((mean, all(int(lp.argmax()) == x for lp, x in zip(lps, t))))
    return out


def probe_fact(dec, turn: dict, block_size: int) -> dict | None:
    """The likelihood probe of a recall trace. The prompt and the expected reply up to the path
    (`<tool_call>` ... `{"path": "`) are prefilled in blocks of `block_size`; each candidate path
    (the fact, and the trace's distractors: held-out paths it never mentions) is scored by the
    mean log-probability per token of writing it left to right in the next block (token i
    predicted with tokens < i visible and the rest of the block masked; the mask token excluded;
    at most a block's worth of tokens). The same is done on the swapped trace (the fact's path
    replaced by the first distractor in the history: memory_traces.swap_fact), so a path's
    prior cancels out:

    - lift: how much being the path mentioned early raises a path's score, in nats per token,
      the mean over the fact (real trace against swapped) and the first distractor (swapped
      against real); 0 = the memory holds nothing of the mention;
    - mentioned_first: in each of the two traces, whether the mentioned path scores above the
      other four (chance 1/5 each);
    - fact_first, margin: the real trace alone (the fact against the distractors' mean; a path's
      prior is in these); argmax: greedy left-to-right denoising would write the fact."""
    pr = turn["transcript"].get("probe")
    if not pr or not turn.get("reply_text"):
        return None
    from ...train.memory_traces import swap_fact

    reply = turn["reply_text"]
    prefix = reply[: reply.index(pr["value"])]
    cands = [pr["value"], *pr["distractors"]]
    real = _path_scores(dec, turn, prefix, cands, block_size)
    swapped = _path_scores(dec, {**turn, "transcript": swap_fact(turn["transcript"])}, prefix, cands, block_size)
    r, s = [x[0] for x in real], [x[0] for x in swapped]
    others = r[1:]
    return {
        "fact": r[0],
        "distractors": others,
        "swapped": s,
        "fact_first": r[0] > max(others),
        "margin": r[0] - sum(others) / len(others),
        "lift": ((r[0] - s[0]) + (s[1] - r[1])) / 2,
        "mentioned_first": [r[0] > max(r[1:]), s[1] > max([s[0], *s[2:]])],
        "argmax": real[0][1],
    }


# ----------------------------------------------------------------------------- figures


def _group_of(r: dict) -> list[str]:
    if r["control"]:
        return ["every", "control", f"control_{r['kind']}"]
    fam = "recall" if r["kind"] in MT.RECALL_KINDS else "compliance"
    return ["every", fam, r["kind"]]


def _rate(recs, key):
    v = [r["score"][key] for r in recs if key in r["score"]]
    return sum(map(bool, v)) / len(v) if v else None


def cell_figures(recs: list[dict]) -> dict:
    """The figures of one seed's records of one cell: rates, tokens per step, distance."""
    calls = [r for r in recs if r["kind"] != "comply_sentence"]
    paths = [r["score"]["recall_by_argument"]["path"] for r in recs if "recall_by_argument" in r["score"]]
    return {
        "n": len(recs),
        "recall": _rate(recs, "recall"),
        "recall_path": sum(paths) / len(paths) if paths else None,
        "compliance": _rate(recs, "compliance"),
        "valid_calls": _rate(calls, "valid"),
        "called": _rate(calls, "called"),
        "right_tool": _rate(recs, "right_tool"),
        "tokens_per_step": sum(r["committed"] for r in recs) / max(1, sum(r["steps"] for r in recs)),
        "distance": [r["distance"] for r in recs if r["distance"] is not None],
    }


def summarize(recs: list[dict], seeds: list[int]) -> dict:
    """{group: {N or "all": figures}} over the records of one (file, mode, block size): each
    figure's spread over seeds, the counts pooled over seeds, the mean distance in tokens."""
    out: dict = {}
    for g in GROUPS:
        rg = [r for r in recs if g in _group_of(r)]
        if not rg:
            continue
        out[g] = {}
        ns = sorted({r["n_results"] for r in rg})
        for n in [*ns, "all"]:
            rn = [r for r in rg if n == "all" or r["n_results"] == n]
            per_seed = [cell_figures([r for r in rn if r["seed"] == s]) for s in seeds]
            per_seed = [f for f in per_seed if f["n"]]
            fig = {k: spread([f[k] for f in per_seed if f[k] is not None]) for k in FIGURES}
            dist = [d for f in per_seed for d in f["distance"]]
            key = None if g == "every" else "recall" if g in ("recall", *MT.RECALL_KINDS) else "compliance"
            fig["counts"] = {
                "traces": len(rn),
                "hits": sum(bool(r["score"].get(key)) for r in rn) if key else None,
                "per_seed": len(rn) // max(1, len(per_seed)),
            }
            fig["distance_tokens"] = (
                {"mean": sum(dist) / len(dist), "min": min(dist), "max": max(dist)} if dist else None
            )
            fig["prompt_tokens_mean"] = sum(r["prompt_tokens"] for r in rn) / len(rn)
            out[g][str(n)] = fig
    return out


def summarize_probe(recs: list[dict], seeds: list[int]) -> dict:
    """{N or "all": figures} of the likelihood probe records of one (file, block size): the lift,
    the rate at which the mentioned path scores first, the real trace's fact-first rate and
    margin, each a spread over seeds of the seed's mean."""
    out = {}
    for n in [*sorted({r["n_results"] for r in recs}), "all"]:
        rn = [r for r in recs if n == "all" or r["n_results"] == n]
        per_seed = [[r for r in rn if r["seed"] == s] for s in seeds]
        per_seed = [x for x in per_seed if x]
        out[str(n)] = {
            "lift": spread([sum(r["lift"] for r in x) / len(x) for x in per_seed]),
            "mentioned_first": spread(
                [sum(map(sum, (r["mentioned_first"] for r in x))) / (2 * len(x)) for x in per_seed]
            ),
            "fact_first": spread([sum(r["fact_first"] for r in x) / len(x) for x in per_seed]),
            "margin": spread([sum(r["margin"] for r in x) / len(x) for x in per_seed]),
            "argmax": spread([sum(r["argmax"] for r in x) / len(x) for x in per_seed]),
            "counts": {
                "traces": len(rn),
                "lift_positive": sum(r["lift"] > 0 for r in rn),
                "mentioned_first": sum(map(sum, (r["mentioned_first"] for r in rn))),
                "fact_first": sum(r["fact_first"] for r in rn),
            },
            "chance": 1 / (1 + len(rn[0]["distractors"])) if rn else None,
        }
    return out


def evaluate(dec, turns, cfg: MemoryConfig, modes, log=print, label="") -> dict:
    """{"modes": {mode: {block size: (summary, records)}}, "probe": {block size: (summary,
    records)}} for one decoder (the probe, a likelihood, does not depend on the decoding mode)."""
    seeds = list(range(cfg.first_seed, cfg.first_seed + cfg.seeds))
    out: dict = {"modes": {}, "probe": {}}
    for mode in modes:
        out["modes"][mode] = {}
        for bs in cfg.block_sizes:
            t0 = time.perf_counter()
            recs = [run_reply(dec, t, cfg, mode, bs) for t in turns]
            s = summarize(recs, seeds)
            out["modes"][mode][str(bs)] = (s, recs)
            rec_ = s.get("recall", {}).get("all", {}).get("recall", {})
            com_ = s.get("compliance", {}).get("all", {}).get("compliance", {})
            log(
                f"{label} {mode} B={bs}: recall {rec_.get('median')}, compliance {com_.get('median')} "
                f"({len(recs)} replies, {time.perf_counter() - t0:.0f} s)"
            )
    if cfg.probe:
        for bs in cfg.block_sizes:
            recs = []
            for t in turns:
                p = probe_fact(dec, t, bs)
                if p is not None:
                    tr = t["transcript"]
                    recs.append(
                        {"id": t["id"], "kind": tr["kind"], "seed": tr["seed"], "n_results": tr["n_results"], **p}
                    )
            if recs:
                s = summarize_probe(recs, seeds)
                out["probe"][str(bs)] = (s, recs)
                log(f"{label} probe B={bs}: lift {s['all']['lift'].get('median')} nats/token")
    return out


def run_memory(reference, ggufs, cfg: MemoryConfig, out_dir, names=None, log=print) -> dict:
    """The command: the reference (free), then each GGUF (cfg.modes), at every block size;
    writes memory.json, report.md and memory.png to out_dir. Returns the run dict."""
    from ..sysinfo import environment

    check_config(cfg)
    t_start = time.perf_counter()
    names = list(names or []) + [Path(g).name for g in ggufs[len(names or []) :]]
    ref_dec = ReferenceDecoder(reference)
    turns = make_turns(cfg, ref_dec.tok)
    log(
        f"{len(turns)} traces ({cfg.seeds} seed(s) x {len(trace_indices(cfg))} traces x {len(cfg.n_results)} N"
        f"{', controls' if cfg.controls else ''}) x {len(cfg.block_sizes)} block size(s) per file and mode"
    )
    targets = []
    res = evaluate(ref_dec, turns, cfg, ["free"], log, "reference-bf16")
    targets.append(("BF16 (PyTorch reference)", str(reference), ref_dec.name, res))
    ref_dec.close()
    for name, g in zip(names, ggufs):
        dec = RuntimeDecoder(g, cfg.threads)
        try:
            res = evaluate(dec, turns, cfg, cfg.modes, log, name)
        finally:
            dec.close()
        targets.append((name, str(g), dec.name, res))
    run = {
        "kind": "memory",
        "config": {
            **asdict(cfg),
            "trace_generator": MT.MEMORY_VERSION,
            "traces_per_file_mode_block": len(turns),
            "environment": environment(cfg.threads),
        },
        "traces": [
            {
                "id": t["id"],
                "kind": t["transcript"]["kind"],
                "control": t["transcript"]["control"],
                "n_results": t["transcript"]["n_results"],
                "prompt_tokens": t["prompt_tokens"],
                "distance": t["distance"],
                "check": t["transcript"]["check"],
            }
            for t in turns
        ],
        "targets": [
            {
                "name": n,
                "path": p,
                "provider": prov,
                "modes": {m: {b: v[0] for b, v in by_b.items()} for m, by_b in r["modes"].items()},
                "records": {m: {b: v[1] for b, v in by_b.items()} for m, by_b in r["modes"].items()},
                "probe": {b: v[0] for b, v in r["probe"].items()},
                "probe_records": {b: v[1] for b, v in r["probe"].items()},
            }
            for n, p, prov, r in targets
        ],
        "seconds": time.perf_counter() - t_start,
    }
    from ...outputs import write_json
    from ..render.memory import render_memory

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "memory.json", run)
    render_memory(run, out)
    return run
