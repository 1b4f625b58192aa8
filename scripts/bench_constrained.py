#!/usr/bin/env python
"""What a JSON-schema constraint costs: tokens per denoising step and generation tok/s, free
decoding against the same prompts constrained by a schema (and by the tool-call grammar),
side by side in one process, rounds interleaved, same build. Prints a table; writes JSON.

    python scripts/bench_constrained.py out/clover-tiny-q4_k.gguf --threads 1 --rounds 5 \\
        [--threshold 0.9 | --steps 4] [--out evaldata/speed/constrained/clover-tiny.json]

Per round, every prompt runs once in each mode (chat prompts, thinking off, max 128 tokens,
block 16); a round's figure is the total over its prompts (generated positions / steps, and
generated positions / generation seconds). Reported: median and p10/p90 over rounds, with the
load average before and after. Run it on a quiet machine: nothing else building, training or
testing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from clover_gguf.eval.quality.metrics import spread  # noqa: E402
from clover_gguf.eval.sysinfo import cpu_info  # noqa: E402
from clover_gguf.reference.generate import GenerationConfig  # noqa: E402
from clover_gguf.runtime.grammar import json_schema_to_grammar, tool_call_grammar  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "line": {"type": "integer"},
        "severity": {"enum": ["low", "medium", "high"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["path", "line", "severity", "tags"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "grep",
            "parameters": {
                "type": "object",
                "properties": {"pattern": {"type": "string"}, "ignore_case": {"type": "boolean"}},
                "required": ["pattern", "ignore_case"],
            },
        },
    },
]
PROMPTS = [
    "Report the first problem in os.py as JSON",
    "Which line of shutil.py copies permissions?",
    "Find where json.loads is defined",
    "Show me the tests of pathlib",
    "Summarise the bug in tarfile.py",
    "Where is argparse's help formatter?",
    "List the TODO comments in asyncio",
    "Explain what functools.partial does",
]


def run(rt, prompts, cfg) -> dict:
    n_pos = n_steps = 0
    ms = 0.0
    for ids in prompts:
        res = rt.generate(ids, cfg)
        n_pos += sum(b.n_tokens for b in res.blocks)
        n_steps += sum(b.steps for b in res.blocks)
        ms += res.total_ms - res.prefill_ms
    return {"tokens_per_step": n_pos / n_steps, "tok_s": n_pos / (ms / 1e3), "positions": n_pos, "steps": n_steps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--threshold", type=float, default=None)
    g.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    a = ap.parse_args(argv)

    from clover_gguf.runtime.runtime import CloverRuntime

    load0 = os.getloadavg()
    rt = CloverRuntime(a.gguf, n_threads=a.threads)
    chat = [rt.tokenize(rt.chat_prompt([{"role": "user", "content": p}], enable_thinking=False)) for p in PROMPTS]
    tool_chat = [
        rt.tokenize(rt.chat_prompt([{"role": "user", "content": p}], enable_thinking=False, tools=TOOLS))
        for p in PROMPTS
    ]
    base = dict(max_new_tokens=a.max_tokens, block_size=a.block_size, threshold=a.threshold, steps=a.steps)
    modes = {
        "free": (chat, GenerationConfig(**base)),
        "json_schema": (chat, GenerationConfig(**base, grammar=json_schema_to_grammar(SCHEMA))),
        "free (tools prompt)": (tool_chat, GenerationConfig(**base)),
        "tool_call": (tool_chat, GenerationConfig(**base, grammar=tool_call_grammar(TOOLS, parallel=False))),
    }
    for prompts, cfg in modes.values():  # warm-up: graphs, caches
        rt.generate(prompts[0], cfg)
    rounds: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(a.rounds):
        for m, (prompts, cfg) in modes.items():
            rounds[m].append(run(rt, prompts, cfg))
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr, flush=True)
    load1 = os.getloadavg()
    out = {
        "model": Path(a.gguf).name,
        "threads": a.threads,
        "schedule": f"steps={a.steps}" if a.steps else f"threshold={a.threshold or 0.9}",
        "block_size": a.block_size,
        "max_tokens": a.max_tokens,
        "prompts": len(PROMPTS),
        "rounds": a.rounds,
        "cpu": cpu_info()["model"],
        "loadavg_before": [round(x, 2) for x in load0],
        "loadavg_after": [round(x, 2) for x in load1],
        "modes": {
            m: {k: spread(x[k] for x in v) for k in ("tokens_per_step", "tok_s")} | {"positions": v[0]["positions"]}
            for m, v in rounds.items()
        },
    }
    print(
        f"\n{out['model']}, {a.threads} thread(s), {out['schedule']}, B={a.block_size}, {len(PROMPTS)} prompts x "
        f"{a.rounds} rounds, load {out['loadavg_before']} -> {out['loadavg_after']}"
    )
    print("| mode | tokens/step, median (p10-p90) | tok/s, median (p10-p90) | positions/round |")
    print("|---|---|---|---|")
    for m, d in out["modes"].items():
        t, s = d["tokens_per_step"], d["tok_s"]
        print(
            f"| {m} | {t['median']:.2f} ({t['p10']:.2f}-{t['p90']:.2f}) | {s['median']:.0f} "
            f"({s['p10']:.0f}-{s['p90']:.0f}) | {d['positions']} |"
        )
    if a.out:
        p = Path(a.out)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1) + "\n")
        tmp.replace(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
