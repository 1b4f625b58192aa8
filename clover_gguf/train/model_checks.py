"""clover-tiny's quality targets (issue 13), each measured the same way every time.

- held-out stdlib: masked NLL at ratio 0.5 against the unigram cross-entropy of the train
  split on the same masked tokens (`heldout_quality`);
- third-party code never seen in training: a pure-Python wheel read as a zip (never
  installed), its files split in two by sorted path; the unigram is fit on one half, model
  and unigram scored on the same masked tokens of the other (`thirdparty_quality`);
- function completions: greedy completions of the prompts in evaldata/function-prompts.json,
  the body cut where the function ends, checked with ast.parse (`function_completions`).
"""

from __future__ import annotations

import ast
import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np

from ..util import EVALDATA

FUNCTION_PROMPTS = EVALDATA / "function-prompts.json"
THIRDPARTY_WHEEL = EVALDATA / "thirdparty" / "boltons-26.2.0-py3-none-any.whl"


def scored(model, ids, fit_ids, **kw) -> dict:
    """Masked NLL of `ids` (evaluate_heldout) beside the unigram fit on `fit_ids`, scored on
    exactly the same masked tokens; `ratio` = model / unigram."""
    from .data import unigram_log2p
    from .trainer import evaluate_heldout

    ev = evaluate_heldout(model, ids, unigram_log2p=unigram_log2p(fit_ids, model.config.vocab_size), **kw)
    ev["ratio"] = ev["bits_per_token"] / ev["unigram_bits_per_token"]
    return ev


def heldout_quality(model, train_ids, held_ids, max_tokens: int | None = None) -> dict:
    return scored(model, held_ids, train_ids, block_size=16, mask_ratio=0.5, seed=0, max_tokens=max_tokens)


# --- third-party code ------------------------------------------------------------------------


def wheel_sources(wheel: Path) -> list[tuple[str, str]]:
    """(path, text) of every .py file in a wheel, sorted by path; read from the zip."""
    with zipfile.ZipFile(wheel) as z:
        names = sorted(n for n in z.namelist() if n.endswith(".py"))
        return [(n, z.read(n).decode("utf-8")) for n in names]


def encode_texts(tok, texts: list[str]) -> np.ndarray:
    """Texts encoded one by one, <|endoftext|> between them (as the training streams)."""
    parts: list[int] = []
    for i, t in enumerate(texts):
        if i:
            parts.append(tok.eos_id)
        parts.extend(tok.encode(t))
    return np.asarray(parts, dtype=np.int64)


def thirdparty_quality(model, tok, wheel: Path = THIRDPARTY_WHEEL, max_tokens: int | None = None) -> dict:
    """Files at even positions (sorted by path) fit the unigram; the odd ones are scored."""
    wheel = Path(wheel)
    src = [(n, t) for n, t in wheel_sources(wheel) if t.strip()]
    fit, held = src[0::2], src[1::2]
    ev = scored(
        model,
        encode_texts(tok, [t for _, t in held]),
        encode_texts(tok, [t for _, t in fit]),
        block_size=16,
        mask_ratio=0.5,
        seed=0,
        max_tokens=max_tokens,
    )
    ev.update(
        wheel=wheel.name,
        wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
        fit_files=[n for n, _ in fit],
        scored_files=[n for n, _ in held],
    )
    return ev


# --- function completions --------------------------------------------------------------------


def load_function_prompts(path: Path = FUNCTION_PROMPTS) -> list[str]:
    return json.loads(Path(path).read_text())["prompts"]


def function_body(completion: str, finished: bool) -> str:
    """The generated body: lines up to the first non-blank line at column 0 (the function has
    ended there). If neither that line nor the end of text came (`finished` false: the token
    limit cut the generation), the last line may be cut off and is dropped."""
    lines = completion.split("\n")
    end = next((i for i, ln in enumerate(lines) if ln.strip() and not ln[0].isspace()), None)
    if end is not None:
        lines = lines[:end]
    elif not finished:
        lines = lines[:-1]
    body = "\n".join(lines) + "\n"
    return body if body.strip() else ""


def body_parses(prompt: str, body: str) -> bool:
    """ast.parse accepts prompt + body, and the body holds at least one statement line
    (a prompt that ends in a docstring parses alone)."""
    code = [ln for ln in body.split("\n") if ln.strip() and not ln.strip().startswith("#")]
    if not code:
        return False
    try:
        ast.parse(prompt + body)
    except (SyntaxError, ValueError):
        return False
    return True


def function_completions(
    model,
    tok,
    prompts: list[str],
    max_new_tokens: int = 64,
    block_size: int = 16,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> dict:
    """Completions with the PyTorch reference (`steps` = B, one token per step): greedy, the
    issue's figure, unless a temperature is given."""
    from ..generation.loader import TorchGenerator

    gen = TorchGenerator(model, tok)
    cfg = gen.config(
        max_new_tokens=max_new_tokens,
        block_size=block_size,
        steps=block_size,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
    )
    rows = []
    for p in prompts:
        res = gen.generate(gen.tokenize(p), cfg)
        text = gen.detokenize(list(res.tokens))
        finished = len(res.tokens) < max_new_tokens  # stopped at <|endoftext|>
        body = function_body(text, finished)
        rows.append({"prompt": p, "completion": text, "body": body, "parses": body_parses(p, body)})
    n = sum(r["parses"] for r in rows)
    decoding = "greedy" if temperature == 0 else f"T={temperature}, top-p {top_p}, seed {seed}"
    return {
        "settings": f"{decoding}, B={block_size}, steps={block_size}, max_new_tokens={max_new_tokens}",
        "n_prompts": len(rows),
        "n_parse": n,
        "fraction": n / max(len(rows), 1),
        "rows": rows,
    }


def threshold_speed(
    model, tok, prompts: list[str], threshold: float = 0.9, max_new_tokens: int = 64, block_size: int = 16
) -> dict:
    """Tokens per denoising step of the threshold schedule (greedy) on the prompts: the issue-23
    figure of block diffusion's parallelism (1.0 = one token a step)."""
    from ..generation.loader import TorchGenerator

    gen = TorchGenerator(model, tok)
    cfg = gen.config(max_new_tokens=max_new_tokens, block_size=block_size, threshold=threshold)
    per_prompt = []
    for p in prompts:
        res = gen.generate(gen.tokenize(p), cfg)
        per_prompt.append((sum(b.n_tokens for b in res.blocks), sum(b.steps for b in res.blocks)))
    tokens, steps = sum(t for t, _ in per_prompt), sum(s for _, s in per_prompt)
    return {
        "settings": f"greedy, threshold {threshold}, B={block_size}, max_new_tokens={max_new_tokens}",
        "tokens": tokens,
        "steps": steps,
        "tokens_per_step": tokens / max(steps, 1),
    }


def in_context_copy(model, tok, held_ids, n: int = 50, span: int = 48, repeat: int = 32, seed: int = 0) -> dict:
    """Whether the model copies from its context, as a tool argument copies a path of the request:
    n held-out spans of `span` tokens, then the first `repeat` of them again; greedy (one token a
    step), how many of the next span - repeat tokens continue the repeat, against the same
    continuation of the first `repeat` tokens alone (what the model guesses without the copy)."""
    from ..generation.loader import TorchGenerator

    gen = TorchGenerator(model, tok)
    k = span - repeat
    cfg = gen.config(max_new_tokens=k, block_size=k, steps=k)
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        s = int(rng.integers(0, len(held_ids) - span))
        ids = [int(x) for x in held_ids[s : s + span]]
        want = ids[repeat:]
        with_copy = list(gen.generate(ids + ids[:repeat], cfg).tokens)[:k]
        alone = list(gen.generate(ids[:repeat], cfg).tokens)[:k]
        rows.append(
            {
                "start": s,
                "with_copy": sum(a == b for a, b in zip(with_copy, want)),
                "alone": sum(a == b for a, b in zip(alone, want)),
            }
        )
    total = n * k
    return {
        "settings": f"greedy, {n} held-out spans of {span} tokens, the first {repeat} repeated, B={k}",
        "accuracy_with_copy": sum(r["with_copy"] for r in rows) / total,
        "accuracy_alone": sum(r["alone"] for r in rows) / total,
        "tokens": total,
        "rows": rows,
    }


def tool_call_quality(
    model_dir, limit: int | None = None, max_new_tokens: int = 160, log=None, seed: int | None = None
) -> dict:
    """`clover-gguf eval tools`' figures for the PyTorch reference on a model folder (free decoding,
    greedy, threshold 0.9) on the held-out transcripts (the first `limit` of them); with `seed`, on
    a fresh draw of the held-out set with that seed instead of the committed one."""
    import tempfile

    from ..eval.quality.tools import ReferenceDecoder, ToolsConfig, evaluate, load_turns
    from .transcripts import HELDOUT_SEED, write_heldout_set

    cfg = ToolsConfig(limit=limit, max_new_tokens=max_new_tokens, modes=("free",))
    with tempfile.TemporaryDirectory() as tmp:
        path = None
        if seed is not None:
            write_heldout_set(Path(tmp), **({"n": limit} if limit else {}), seed=seed)  # draws are per index
            path = Path(tmp) / "heldout.jsonl"
        turns, _ = load_turns(path, limit)
    summary, _ = evaluate(ReferenceDecoder(model_dir), turns, cfg, ["free"], log=log or (lambda *a: None))["free"]
    figs = {k: v.get("median") for k, v in summary.items() if k != "counts"}
    settings = f"greedy, threshold 0.9, max_new_tokens={max_new_tokens}"
    return {"settings": settings, "heldout_seed": HELDOUT_SEED if seed is None else seed, **figs, **summary["counts"]}


def targets(q: dict) -> dict:
    """The issue's three targets, each as (value, bound, met)."""
    out = {}
    if "heldout" in q:
        r = q["heldout"]["ratio"]
        out["heldout_ratio"] = {"value": r, "bound": 0.75, "met": bool(r <= 0.75)}
    if "thirdparty" in q:
        r = q["thirdparty"]["ratio"]
        out["thirdparty_ratio"] = {"value": r, "bound": 0.8, "met": bool(r <= 0.8)}
    if "functions" in q:
        f = q["functions"]["fraction"]
        out["functions_parse"] = {"value": f, "bound": 0.5, "met": bool(f >= 0.5)}
    # issue 23 (clover-tiny v3)
    if "function_speed" in q:
        v = q["function_speed"]["tokens_per_step"]
        out["functions_tokens_per_step"] = {"value": v, "bound": 1.5, "met": bool(v >= 1.5)}
    t = q.get("tools")
    if t:
        for key, fig, bound in (("tools_valid_calls", "valid_calls", 0.8), ("tools_right_name", "name_accuracy", 0.7),
                                ("tools_call_tokens_per_step", "tokens_per_step_call", 2.0)):  # fmt: skip
            v = t.get(fig)
            out[key] = {"value": v, "bound": bound, "met": bool(v is not None and v >= bound)}
    return out
