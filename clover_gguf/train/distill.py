"""Self-distillation targets for certainty forcing (dParallel, arXiv 2509.26488): the model's
own greedy continuations of the train split's def lines, and its own replies to train-split
chat turns, kept only where they are right (a body that parses; every tool call valid JSON
that fits its schema, and calls exactly where the transcript makes one). Trained on with the
certainty term, they teach the model to be sure of what it would write anyway, so the
threshold schedule unmasks several positions a step; on the corpus itself a 10M model is
rarely right, so the term has little to act on (evaldata/train-certainty/)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from . import TrainError, data
from .model_checks import body_parses, function_body, load_function_prompts

TOOL_CALL_END = "</tool_call>"
DEF_LINE = re.compile(r"^\s*(def [A-Za-z_]\w*\(.*\)(\s*->\s*[^:]+)?:)\s*$")


def train_signatures(seed: int = 0) -> list[str]:
    """One-line def statements of the train split, dedented, each once, shuffled; the held-out
    function prompts are left out."""
    held = set(load_function_prompts())
    sigs = set()
    for f in data.train_files():
        for ln in f.read_text(errors="replace").split("\n"):
            m = DEF_LINE.match(ln)
            if m and len(m.group(1)) < 90:
                sigs.add(m.group(1).strip() + "\n")
    out = sorted(sigs - held)
    random.Random(seed).shuffle(out)
    return out


def write_targets(model_dir, out: Path, n: int, seed: int = 0, max_new_tokens: int = 64, block_size: int = 16):
    """Greedy continuations (one token a step) of n train signatures, appended to the JSONL
    `out` (a cut-off run goes on where it stopped). A row: prompt, prompt_ids, ids, parses."""
    from ..generation.loader import TorchGenerator
    from ..reference.model import CloverModel
    from ..tokenizer import CloverTokenizer

    tok = CloverTokenizer.from_dir(model_dir)
    gen = TorchGenerator(CloverModel.from_pretrained(model_dir, dtype=torch.float32).eval(), tok)
    cfg = gen.config(max_new_tokens=max_new_tokens, block_size=block_size, steps=block_size)
    done = {json.loads(ln)["prompt"] for ln in out.read_text().splitlines()} if out.is_file() else set()
    todo = [p for p in train_signatures(seed)[:n] if p not in done]
    with out.open("a") as fh:
        for p in tqdm(todo, desc="distill targets", unit="prompt"):
            ids = gen.tokenize(p)
            res = gen.generate(ids, cfg)
            text = gen.detokenize(list(res.tokens))
            body = function_body(text, len(res.tokens) < max_new_tokens)
            row = {"prompt": p, "prompt_ids": ids, "ids": [int(t) for t in res.tokens], "parses": body_parses(p, body)}
            fh.write(json.dumps(row) + "\n")
            fh.flush()


def right_reply(pieces: list[str], thinking: bool, tools: list[dict], expected: list[dict]) -> int | None:
    """How many of a generated assistant turn's tokens (`pieces`, their texts) make a target, or
    None: its first len(expected) tool calls must all parse and fit the offered tools' schemas.
    The target ends where the transcript's turn would, after that many calls (the turn's end
    token follows it), so a reply that goes on calling still teaches the calls it got right."""
    from ..eval.quality.tools import parse_sections, split_turn

    text = "".join(pieces)
    _, content = split_turn(text, thinking)
    sections = parse_sections(content, tools)
    n = len(expected)
    if not n or len(sections) < n or not all(s["json"] and s["schema"] for s in sections[:n]):
        return None
    # the n valid sections come before the turn's end (split_turn cut there), so this finds them
    prefix = ""
    for j, p in enumerate(pieces):
        prefix += p
        if prefix.count(TOOL_CALL_END) >= n:
            return j + 1
    return None


def write_tool_targets(model_dir, out: Path, n: int, seed: int = 3, max_new_tokens: int = 160, block_size: int = 16):
    """The model's greedy replies (one token a step) to the assistant turns that call a tool in
    train-split transcripts 0..n-1 of `seed`, appended to
    the JSONL `out` (a cut-off run goes on where it stopped). "parses": right_reply found a
    target (then "ids" is it, with the turn's end token), else "ids" is the whole reply; the
    prompt is the history rendered as the server renders a request. Prose turns are left out:
    the model's prose is not right often enough to be worth being sure of."""
    from ..eval.quality.tool_blocks import IM_END
    from ..generation.loader import load
    from .transcripts import assistant_turns, expected_calls, make_transcript, render_prompt, request_tools

    gen = load(model_dir)
    tok = gen.tokenizer
    cfg = gen.config(max_new_tokens=max_new_tokens, block_size=block_size, steps=block_size)
    end_id = gen.token_id(IM_END)
    done = {json.loads(ln)["prompt"] for ln in out.read_text().splitlines()} if out.is_file() else set()
    kept = 0
    with out.open("a") as fh, tqdm(range(n), desc="tool targets", unit="transcript") as bar:
        for i in bar:
            t = make_transcript("train", seed, i)
            for k in assistant_turns(t):
                key, expected = f"{t['id']}#{k}", expected_calls(t["messages"][k])
                if key in done or not expected:
                    continue
                ids = gen.tokenize(render_prompt(tok, t, k))
                res = gen.generate(ids, cfg, lambda toks, st: end_id not in toks)
                out_ids = [int(x) for x in res.tokens]
                pieces = [gen.detokenize([x]) for x in out_ids]
                cut = right_reply(pieces, t["mode"] != "nothink", request_tools(t) or [], expected)
                if cut is not None:
                    out_ids = out_ids[:cut] + [end_id]
                kept += cut is not None
                row = {"prompt": key, "prompt_ids": ids, "ids": out_ids, "parses": cut is not None}
                fh.write(json.dumps(row) + "\n")
                fh.flush()
            bar.set_postfix(kept=kept)


def distill_stream(path: Path, only_parsing: bool = True):
    """The targets as a stream for trainer.train(distill=...): (ids, starts, scored), each row
    its prompt (clean context) then its continuation (noised and scored)."""
    try:
        rows = [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise TrainError(f"--distill {path}: {e}") from None
    rows = [r for r in rows if r["parses"] or not only_parsing]
    if not rows:
        raise TrainError(f"--distill {path}: no rows to train on")
    ids, scored, starts, n = [], [], [], 0
    for r in rows:
        starts.append(n)
        ids += r["prompt_ids"] + r["ids"]
        scored += [False] * len(r["prompt_ids"]) + [True] * len(r["ids"])
        n += len(r["prompt_ids"]) + len(r["ids"])
    return (
        torch.tensor(ids, dtype=torch.int64),
        torch.tensor(starts, dtype=torch.int64),
        torch.from_numpy(np.array(scored, dtype=bool)),
    )
