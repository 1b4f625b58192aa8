"""The end-of-run evaluation of a saved clover-tiny (train_log.json's "final"): the quality
targets of model_checks.py on the folder's BF16 weights, computed in float32, and the log
lines that report them."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..reference.model import CloverModel
from . import data, model_checks


def final_eval(
    model_dir: str | Path,
    tok,
    train_ids,
    held_ids,
    info: dict,
    threads: int = 1,
    max_tokens: int | None = None,
    tools_limit: int | None = None,
    log=print,
) -> dict:
    """The issue-13 quality targets (and issue 23's, with tool tokens in the vocabulary) of the
    model in model_dir. max_tokens limits the held-out and third-party scores, tools_limit the
    held-out tool transcripts (smoke tests; None: all)."""
    torch.set_num_threads(threads)
    model = CloverModel.from_pretrained(model_dir, dtype=torch.float32)
    t0 = time.time()
    res = {"heldout": model_checks.heldout_quality(model, train_ids, held_ids, max_tokens=max_tokens)}
    res["thirdparty"] = model_checks.thirdparty_quality(model, tok, max_tokens=max_tokens)
    res["functions"] = model_checks.function_completions(model, tok, model_checks.load_function_prompts())
    res["function_speed"] = model_checks.threshold_speed(model, tok, model_checks.load_function_prompts())
    if tok.token_to_id("<tool_call>") is not None:  # the held-out tool transcripts (eval/quality/tools.py)
        res["tools"] = model_checks.tool_call_quality(model_dir, limit=tools_limit, log=log)
    res["targets"] = model_checks.targets(res)
    res["unigram"] = data.unigram_entropy_bits(train_ids, held_ids, vocab_size=model.config.vocab_size)
    res["data"] = info
    res["time_s"] = round(time.time() - t0, 1)
    log_results(res, log)
    return res


def log_results(res: dict, log) -> None:
    for k in ("heldout", "thirdparty"):
        e = res[k]
        log(
            f"{k}: {e['bits_per_token']:.3f} bits/token (masked, ratio 0.5, B=16, {e['n_masked']} of "
            f"{e['n_tokens']} tokens), unigram {e['unigram_bits_per_token']:.3f} on the same tokens: "
            f"ratio {e['ratio']:.3f}"
        )
    f = res["functions"]
    log(f"functions: {f['n_parse']}/{f['n_prompts']} bodies parse")
    log(f"threshold 0.9 on the function prompts: {res['function_speed']['tokens_per_step']:.3f} tokens/step")
    if "tools" in res:
        log(f"tools: { ({k: res['tools'][k] for k in ('valid_calls', 'name_accuracy', 'call_rate')}) }")
    for r in f["rows"]:
        log(f"{'ok ' if r['parses'] else 'BAD'} {r['prompt']!r} -> {r['completion']!r}")
