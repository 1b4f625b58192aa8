#!/usr/bin/env python
"""How often clover-tiny's function completions parse, beyond the model card's one figure
(greedy, 64 tokens): greedy at more token limits, and sampled over several seeds, which is a
less noisy comparison of two models than 20 greedy completions.

    python scripts/function_parse_rates.py models/clover-tiny out/clover-tiny-v2
    python scripts/function_parse_rates.py models/clover-tiny --max-new-tokens 64 128 --seeds 5
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clover_gguf.reference.model import CloverModel  # noqa: E402
from clover_gguf.tokenizer import CloverTokenizer  # noqa: E402
from clover_gguf.train import model_checks as Q  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="model folders (safetensors + config.json + tokenizer)")
    ap.add_argument("--max-new-tokens", type=int, nargs="+", default=[64, 128], help="greedy token limits")
    ap.add_argument("--seeds", type=int, default=5, help="sampled completions per prompt (0: none)")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    prompts = Q.load_function_prompts()
    for d in a.models:
        model = CloverModel.from_pretrained(d).eval()
        tok = CloverTokenizer.from_dir(d)
        t0 = time.time()
        for n in a.max_new_tokens:
            r = Q.function_completions(model, tok, prompts, max_new_tokens=n)
            print(f"{d}: greedy, {n} tokens: {r['n_parse']}/{r['n_prompts']} parse", flush=True)
        if a.seeds:
            kw = dict(max_new_tokens=64, temperature=a.temperature, top_p=a.top_p)
            hits = sum(Q.function_completions(model, tok, prompts, seed=s, **kw)["n_parse"] for s in range(a.seeds))
            print(
                f"{d}: sampled (T={a.temperature}, top-p {a.top_p}, {a.seeds} seeds, 64 tokens): "
                f"{hits}/{a.seeds * len(prompts)} parse ({time.time() - t0:.0f} s)",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
