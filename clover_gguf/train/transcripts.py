"""Chat transcripts for clover-tiny v3: a program of ours, deterministic from a seed, that writes
conversations in which a user asks about a real stdlib module of one split (train or held-out)
and the assistant answers, or (thinking first, in some) calls tools whose arguments name real
paths, functions and lines of the corpus, reads the tools' results and answers.

A transcript is what a chat request holds: `tools` (1 to 8 of toolset.TOOLS, in random order;
a few transcripts have none) and `messages` (an optional system turn, then 1 to 3 user requests,
each followed by the assistant's calls, the `tool` results and its answer; at most 6 assistant
turns). `mode` says how the assistant thinks:
- "think": assistant turns after the last user request carry reasoning_content (<think>);
- "plain": no reasoning; the prompt is rendered with thinking on (the server's default);
- "nothink": the prompt of the last assistant turn is rendered with enable_thinking=false (the
  empty think block), as the server renders a request that turns thinking off.

Transcripts are only ever rendered through CloverTokenizer.apply_chat_template, so training text
is exactly what the server renders (render_training_text, render_prompt).

Splits: training transcripts talk about train-split modules only and never offer a tool set that
toolset.heldout_combination reserves; held-out transcripts talk about held-out modules and
offer only reserved sets (so two or more tools).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from random import Random

import numpy as np

from . import intents as I
from .corpus_facts import Corpus, split_corpus
from .toolset import MAX_OFFERED, TOOL_NAMES, TOOLS, heldout_combination

GENERATOR_VERSION = "v3.1"  # part of the token-stream cache key: bump when the output changes
MODES = ("think", "plain", "nothink")
MODE_WEIGHTS = (0.35, 0.4, 0.25)
MAX_ASSISTANT_TURNS = 6
TOOL_COUNT_DECAY = 0.7  # P(k + 1 tools offered) / P(k)
SYSTEM_PROMPTS = [
    "You are a coding assistant working in the CPython standard library (Lib/).",
    "You help with Python code. Paths are relative to the standard library directory.",
    "You are Clover, an agent for the Python standard library. Use the tools when they help.",
]


def _exchange(rng: Random, corpus: Corpus, f, first: bool):
    """One exchange about file f: a tool intent (most), an explanation or thanks."""
    r = rng.random()
    if not first and r < 0.12:
        return I.thanks(rng, f, corpus)
    if r < 0.25:
        ex = I.explain(rng, f, corpus)
        if ex is not None:
            return ex
    names = list(I.CALL_INTENTS)
    weights = [I.CALL_INTENTS[n][1] for n in names]
    for _ in range(20):
        fn = I.CALL_INTENTS[rng.choices(names, weights)[0]][0]
        ex = fn(rng, f, corpus)
        if ex is not None and sum(len(s.calls) for s in ex.steps):
            return ex
    return I.thanks(rng, f, corpus)


def offered_tools(rng: Random, needed: list[str], split: str) -> list[str] | None:
    """The tools a transcript offers: those its calls need, plus others up to 1-8 in all, in
    random order; a combination toolset.heldout_combination reserves only in the held-out split."""
    rest = [n for n in TOOL_NAMES if n not in needed]
    for _ in range(200):
        lo = max(1, len(needed), 2 if split == "heldout" else 1)
        # every size up to 8, fewer tools more often (each signature is 100-180 tokens)
        k = rng.choices(range(lo, MAX_OFFERED + 1), [TOOL_COUNT_DECAY**i for i in range(MAX_OFFERED + 1 - lo)])[0]
        names = needed + rng.sample(rest, k - len(needed))
        if heldout_combination(names) == (split == "heldout"):
            rng.shuffle(names)
            return names
    return None


def _assistant(text: str, think: str, calls=None, with_think: bool = False) -> dict:
    m: dict = {"role": "assistant", "content": text}
    if with_think and think:
        m["reasoning_content"] = think
    if calls:
        m["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return m


def _messages(rng: Random, exchanges, mode: str) -> list[dict]:
    msgs: list[dict] = []
    if rng.random() < 0.4:
        msgs.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for ex in exchanges:
        msgs.append({"role": "user", "content": ex.user})
        think = mode == "think"
        for st in ex.steps:
            msgs.append(_assistant(st.preface, st.think, st.calls, think))
            msgs += [{"role": "tool", "content": r} for r in st.results]
        msgs.append(_assistant(ex.answer, ex.answer_think, None, think))
    return msgs


def make_transcript(split: str, seed: int, index: int) -> dict:
    """Transcript `index` of a split's stream for `seed` (the same on every machine with the
    same stdlib)."""
    corpus = split_corpus(split)
    rng = Random(f"clover-transcript:{GENERATOR_VERSION}:{split}:{seed}:{index}")
    while True:
        f = rng.choice(corpus.files)
        n_ex = rng.choices([1, 2, 3], [0.5, 0.35, 0.15])[0]
        exchanges, turns = [], 0
        for i in range(n_ex):
            ex = _exchange(rng, corpus, f, first=i == 0)
            if turns + ex.n_turns > MAX_ASSISTANT_TURNS:
                break
            exchanges.append(ex)
            turns += ex.n_turns
            if rng.random() < 0.3:  # the next request is about another file of the package
                f = rng.choice(corpus.by_package.get(f.package) or [f])
        needed = list(dict.fromkeys(n for ex in exchanges for n in ex.tools))
        if not needed and rng.random() < 0.25:
            tools: list[str] | None = []  # a plain chat, no tools section
        else:
            tools = offered_tools(rng, needed, split)
        if tools is None or (split == "heldout" and len(tools) < 2):
            continue
        mode = rng.choices(MODES, MODE_WEIGHTS)[0]
        for ex in exchanges:
            if ex.steps and rng.random() < 0.12:
                ex.steps[0].preface = rng.choice(["Let me check.", "I'll look that up.", "Checking the code."])
        return {
            "id": f"{split}-{seed}-{index}",
            "split": split,
            "module": f.module,
            "mode": mode,
            "tools": tools,
            "messages": _messages(rng, exchanges, mode),
        }


# --- rendering -------------------------------------------------------------------------------


def request_tools(t: dict, schemas: dict | None = None) -> list[dict] | None:
    schemas = schemas or TOOLS
    return [schemas[n] for n in t["tools"]] or None


def render_prompt(tok, t: dict, k: int, schemas: dict | None = None) -> str:
    """The prompt of assistant message k (an index into t["messages"]): the history before it,
    rendered as the server renders a request (generation prompt; thinking off in "nothink")."""
    kw = {"enable_thinking": False} if t["mode"] == "nothink" else {}
    return tok.apply_chat_template(t["messages"][:k], tools=request_tools(t, schemas), add_generation_prompt=True, **kw)


def render_training_text(tok, t: dict) -> str:
    """The whole transcript as training text: its rendering, or in "nothink" the last assistant
    turn's prompt (thinking off) followed by that turn as the template renders it."""
    tools = request_tools(t)
    msgs = t["messages"]
    full = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=False)
    if t["mode"] != "nothink":
        return full
    head = tok.apply_chat_template(msgs[:-1], tools=tools, add_generation_prompt=True)
    if not full.startswith(head):
        raise AssertionError(f"{t['id']}: the template's prompt is not a prefix of the transcript")
    prompt = tok.apply_chat_template(msgs[:-1], tools=tools, add_generation_prompt=True, enable_thinking=False)
    return prompt + full[len(head) :]


def assistant_turns(t: dict) -> list[int]:
    return [i for i, m in enumerate(t["messages"]) if m["role"] == "assistant"]


def expected_calls(message: dict) -> list[dict]:
    """[{"name", "arguments"}] of an assistant message (empty: no call expected)."""
    return [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in message.get("tool_calls") or []
    ]


# --- token streams ---------------------------------------------------------------------------


ASSISTANT_OPEN, TURN_END = "<|im_start|>assistant\n", "<|im_end|>"


def assistant_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of what the assistant writes in a rendered transcript: from after each
    `<|im_start|>assistant\n` through its `<|im_end|>` (a nothink turn's empty think block is
    part of the prompt the server renders, so it is not in the span)."""
    out, pos = [], 0
    while (i := text.find(ASSISTANT_OPEN, pos)) >= 0:
        a = i + len(ASSISTANT_OPEN)
        if text.startswith("<think>\n\n</think>\n\n", a):
            a += len("<think>\n\n</think>\n\n")
        e = text.find(TURN_END, a)
        e = len(text) if e < 0 else e + len(TURN_END)
        out.append((a, e))
        pos = e
    return out


def _assistant_mask(enc, text: str) -> np.ndarray:
    """Per token of `enc` (a tokenizers Encoding of text): does it start inside an assistant span."""
    spans = assistant_spans(text)
    starts = np.asarray([o[0] for o in enc.offsets], dtype=np.int64)
    m = np.zeros(len(starts), dtype=bool)
    for a, e in spans:
        m |= (starts >= a) & (starts < e)
    return m


def transcript_tokens(tok, split: str, seed: int, n: int, cache_dir: Path | None = None):
    """(ids, starts, assistant): n transcripts of a split rendered and encoded, `<|endoftext|>`
    after each; starts[i] is where transcript i begins; assistant[j] whether token j is one the
    assistant writes (assistant_spans). Cached in cache_dir by (generator version, split, seed, n,
    tokenizer, held-out manifest)."""
    from .data import HELDOUT_MANIFEST

    key = hashlib.sha256(
        f"{GENERATOR_VERSION}:{split}:{seed}:{n}:{tok.fingerprint()}".encode() + HELDOUT_MANIFEST.read_bytes()
    ).hexdigest()[:16]
    path = Path(cache_dir) / f"chat-{split}-{key}.npz" if cache_dir is not None else None
    if path is not None and path.is_file():
        z = np.load(path)
        if "assistant" in z:  # (caches written before the mask was added lack it)
            return z["ids"], z["starts"], z["assistant"]
    texts = [render_training_text(tok, make_transcript(split, seed, i)) for i in range(n)]
    parts, masks, starts, pos = [], [], [], 0
    for text, enc in zip(texts, tok._tok.encode_batch(texts, add_special_tokens=False)):
        starts.append(pos)
        parts.append(np.asarray(list(enc.ids) + [tok.eos_id], dtype=np.int32))
        masks.append(np.append(_assistant_mask(enc, text), False))
        pos += len(enc.ids) + 1
    arr, st, am = np.concatenate(parts), np.asarray(starts, dtype=np.int64), np.concatenate(masks)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}.npz")
        np.savez(tmp, ids=arr, starts=st, assistant=am)
        os.replace(tmp, path)
    return arr, st, am


# --- the committed held-out set --------------------------------------------------------------

HELDOUT_DIR = Path(__file__).resolve().parents[2] / "evaldata" / "tools"
HELDOUT_SEED = 23


def write_heldout_set(out_dir: Path = HELDOUT_DIR, n: int = 150, seed: int = HELDOUT_SEED) -> dict:
    """evaldata/tools/: heldout.jsonl (one held-out transcript a line: id, module, mode, the
    offered tools' names, messages; every assistant turn is evaluated, its tool_calls the
    expected calls, none meaning no call) and tools.json (the signatures the names refer to)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [make_transcript("heldout", seed, i) for i in range(n)]
    used = sorted({name for t in rows for name in t["tools"]})
    for name, obj in (("tools.json", {n_: TOOLS[n_] for n_ in used}), ("heldout.jsonl", None)):
        tmp = out_dir / f".{name}.tmp"
        if obj is not None:
            tmp.write_text(json.dumps(obj, indent=1) + "\n")
        else:
            tmp.write_text("".join(json.dumps({k: v for k, v in t.items() if k != "split"}) + "\n" for t in rows))
        os.replace(tmp, out_dir / name)
    turns = [m for t in rows for m in t["messages"] if m["role"] == "assistant"]
    return {
        "transcripts": n,
        "assistant_turns": len(turns),
        "turns_with_calls": sum(1 for m in turns if m.get("tool_calls")),
        "calls": sum(len(m.get("tool_calls") or []) for m in turns),
    }


def load_heldout_set(path: Path = HELDOUT_DIR / "heldout.jsonl") -> tuple[list[dict], dict]:
    """(transcripts, tool schemas by name) of a held-out set written by write_heldout_set."""
    path = Path(path)
    schemas = json.loads((path.parent / "tools.json").read_text())
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows, schemas
