"""Long synthetic agent traces for `clover-gguf eval memory` (issue 46): an early instruction or
fact, N tool results, then a final request that needs the instruction or the fact.

Clover keeps everything before the current block in a compressed Gated DeltaNet state, so what
was said at the start of a trace reaches the last turn only through that state. A trace tests
it: the first user request carries an instruction (compliance) or a fact (exact recall), N
filler tool calls with their results follow (intents.py's call intents on *other* held-out
files, so N = 64 is a few thousand tokens), the assistant closes the work in one sentence, and
the final user request can only be answered right by following the instruction or by writing
the fact back as a call's argument. Kinds (KINDS, one per trace index in turn):

- recall_request: the request names a file ("The file I am working on is P"); the final request
  refers to it without naming it ("count the lines of the file I named at the start"): the
  call's `path` must be P exactly.
- recall_result: the first call is find_symbol, its result "P:L-E: def name(...)" the fact;
  the final request asks to read the definition found first: read_file's `path` must be P and
  `start_line` L.
- comply_tests: "whenever you run tests, run them verbosely" (or "with a T-second timeout");
  the final request asks for a module's tests: run_tests with verbose true (timeout T). The
  fillers never run tests.
- comply_grep: "only use grep to find things in files, never find_symbol or read_file" (all
  three offered); the final request asks where a symbol of a named file is defined, which
  training answers with find_symbol: the call must be grep. The fillers never call
  find_symbol or read_file.
- comply_sentence: "answer in one sentence from now on"; the final request asks for a summary
  of the work: a text answer of one sentence, no call.

With ``control=True`` a compliance trace is the same trace without the instruction (the same
fillers, the same final request): how often the rule holds anyway. A recall trace also names
N_DISTRACTORS other held-out paths that it never mentions (``probe``): eval memory's likelihood
probe asks whether the model prefers the fact's path to them where the call writes the path,
against the same trace with the fact swapped for a distractor (swap_fact).

Only held-out files (corpus_facts.split_corpus("heldout")) are talked about, and the tools
offered are a combination toolset.heldout_combination reserves for held-out transcripts. A
trace is a transcript dict (id, split, module, mode, tools, messages: the same renderers read
it, transcripts.render_prompt) whose last message is the expected final assistant turn, plus
what the scorer needs: ``kind``, ``n_results``, ``fact`` (the text whose first occurrence in
the rendered prompt is where the fact or the instruction sits; ``message``: the message that
holds it) and ``check`` (what makes the final turn right). Deterministic from (seed, index):
the trace of index i for N results holds the first N fillers of one stream, so the same trace
at N = 1, 4, 16, 64 differs only in how many results lie between the fact and the question.
"""

from __future__ import annotations

import json
import re
from random import Random

from . import intents as I
from .corpus_facts import Corpus, FileFacts, split_corpus
from .toolset import TOOL_NAMES
from .transcripts import offered_tools

MEMORY_VERSION = "m1"  # bump when a trace changes
KINDS = ("recall_request", "recall_result", "comply_tests", "comply_grep", "comply_sentence")
RECALL_KINDS = KINDS[:2]
COMPLIANCE_KINDS = KINDS[2:]
MODE = "nothink"  # the final prompt is rendered with thinking off: the reply is the answer itself
FILLER_RESULT_LINES = 4  # a filler's tool result keeps this many lines (and says how many more)
N_DISTRACTORS = 4  # held-out paths a recall trace never mentions (the probe's alternatives to the fact)
# the intents whose steps make fillers (single-call steps; grep_two/read_two call twice)
FILLER_INTENTS = [n for n in I.CALL_INTENTS if n not in ("grep_two", "read_two")]
# tools a kind's fillers never call: the instruction forbids them, or the final call is the test
FORBIDDEN_IN_FILLERS = {
    "comply_tests": {"run_tests"},
    "comply_grep": {"find_symbol", "read_file"},
}

SYSTEM_PROMPT = "You are Clover, an agent for the Python standard library. Use the tools when they help."


# ----------------------------------------------------------------------------- fillers


def _trim(result: str, n: int = FILLER_RESULT_LINES) -> str:
    lines = result.split("\n")
    if len(lines) <= n:
        return result
    return "\n".join(lines[:n] + [f"... ({len(lines) - n} more lines)"])


def _filler_steps(rng: Random, corpus: Corpus, offered: list[str], forbidden: set, needles: list[str]):
    """An endless stream of filler steps (one call and its result each) on held-out files whose
    paths are not among `needles`, calling only offered tools and none of `forbidden`, whose
    calls and results never contain any of `needles` (the fact appears once; the probe's
    distractors never)."""
    others = [f for f in corpus.files if f.path not in needles]
    allowed = set(offered) - set(forbidden)
    weights = [I.CALL_INTENTS[n][1] for n in FILLER_INTENTS]
    misses = 0
    while True:
        if misses > 1000:  # pragma: no cover - every offered set has an intent that fits some file
            raise RuntimeError(f"no filler fits the tools {sorted(allowed)}")
        f = rng.choice(others)
        ex = None
        for _ in range(20):
            ex = I.CALL_INTENTS[rng.choices(FILLER_INTENTS, weights)[0]][0](rng, f, corpus)
            if ex is not None and ex.steps and set(ex.tools) <= allowed:
                break
            ex = None
        if ex is None:
            misses += 1
            continue
        misses = 0
        for st in ex.steps:
            if len(st.calls) != 1:
                break
            st.results = [_trim(r) for r in st.results]
            blob = json.dumps([st.calls[0].arguments, st.results])
            if any(n in blob for n in needles):
                break
            yield st


# ----------------------------------------------------------------------------- the kinds


def _recall_request(rng: Random, corpus: Corpus, f: FileFacts) -> dict:
    p = f.path
    first = rng.choice(
        [
            f"The file I am working on is {p}. Before we change it, look through some other files of the library.",
            f"Keep {p} in mind: it is the file I will ask about at the end. First, have a look around the "
            "other modules.",
            f"My task is in {p}. Start by exploring the rest of the standard library for me.",
        ]
    )
    tool = rng.choice(["count_lines", "git_log", "lint"])
    ref = rng.choice(["the file I named at the start", "the file I mentioned first", "my file from the beginning"])
    args: dict = {"path": p}
    if tool == "count_lines":
        final = rng.choice([f"Now count the lines of {ref}.", f"How many lines does {ref} have?"])
    elif tool == "git_log":
        final = rng.choice([f"Show me the git log of {ref}.", f"What changed recently in {ref}?"])
    else:
        args["rules"] = ["trailing-whitespace"]
        final = rng.choice([f"Lint {ref} for trailing whitespace.", f"Does {ref} have trailing whitespace? Lint it."])
    return {
        "first": first,
        "fact_text": p,
        "final": final,
        "expect": {"name": tool, "arguments": args},
        "check": {"type": "recall", "name": tool, "arguments": {"path": p}},
        "needles": [p],
    }


def _recall_result(rng: Random, corpus: Corpus, f: FileFacts) -> dict | None:
    s = I.pick_symbol(rng, f, "function", "class", "method")
    if s is None:
        return None
    first = I.symbol_request(rng, f, s, with_module=True) + rng.choice(
        [" Then look through some other files of the library.", " After that, explore the other modules for me."]
    )
    call = I.find_symbol_call(rng, f, s, with_module=True)
    result = I.definition_line(f, s)
    n = rng.choice([5, 10, 15])
    final = rng.choice(
        [
            f"Now read {n} lines of the definition you found first, starting at its line.",
            f"Go back to the definition you found at the start and show me {n} lines from its first line.",
        ]
    )
    return {
        "first": first,
        "first_step": I.Step([call], [result]),
        "fact_text": f"{f.path}:{s.line}-",
        "final": final,
        "expect": {
            "name": "read_file",
            "arguments": {"path": f.path, "start_line": s.line, "end_line": s.line + n - 1},
        },
        "check": {"type": "recall", "name": "read_file", "arguments": {"path": f.path, "start_line": s.line}},
        "needles": [f.path],
    }


def _task(rng: Random) -> str:
    return rng.choice(
        [
            " Now look through some files of the library for me.",
            " Start by exploring the standard library.",
            " First, have a look around the modules.",
        ]
    )


def _comply_tests(rng: Random, corpus: Corpus, f: FileFacts) -> dict | None:
    if not f.of_kind("function", "method"):
        return None
    if rng.random() < 0.5:
        rule = {"verbose": True}
        instruction = rng.choice(
            [
                "Whenever you run tests, run them with verbose output.",
                "Always run tests verbosely.",
                "Rule for this session: every test run must be verbose.",
            ]
        )
    else:
        t = rng.choice([10, 30, 60, 120, 300])
        rule = {"timeout": t}
        instruction = rng.choice(
            [
                f"Whenever you run tests, give them a {t}-second timeout.",
                f"Always run tests with a timeout of {t} seconds.",
            ]
        )
    m = f.module
    final = rng.choice([f"Run the tests for {m}.", f"Do the tests of {m} pass?", f"Test {m} please."])
    return {
        "first": instruction + _task(rng),
        "fact_text": instruction,
        "instruction": instruction,
        "final": final,
        "expect": {"name": "run_tests", "arguments": {"target": m, **rule}},
        "check": {"type": "rule_arguments", "name": "run_tests", "arguments": rule},
        "needles": [],
    }


def _comply_grep(rng: Random, corpus: Corpus, f: FileFacts) -> dict | None:
    s = I.pick_symbol(rng, f, "function", "class")
    if s is None:
        return None
    instruction = rng.choice(
        [
            "Only use grep to find things in files; never use find_symbol or read_file.",
            "In this session, search files with grep only: no find_symbol, no read_file.",
            "Use grep for every lookup in a file. Do not call find_symbol or read_file.",
        ]
    )
    final = rng.choice(
        [f"Where is the {s.kind} {s.name} defined in {f.path}?", f"Find the definition of {s.name} in {f.path}."]
    )
    return {
        "first": instruction + _task(rng),
        "fact_text": instruction,
        "instruction": instruction,
        "final": final,
        "expect": {"name": "grep", "arguments": {"pattern": s.name, "path": f.path}},
        "check": {"type": "rule_name", "name": "grep"},
        "needles": [],
    }


def _comply_sentence(rng: Random, corpus: Corpus, f: FileFacts) -> dict:
    instruction = rng.choice(
        [
            "Answer in one sentence from now on.",
            "Keep every answer to a single sentence.",
            "Please reply in one sentence only, whatever I ask.",
        ]
    )
    final = rng.choice(
        [
            "Summarize what you found in those files, and what I should look at next.",
            "What did you learn from all that? Give me an overview.",
            "Tell me what you found and which files matter most.",
        ]
    )
    return {
        "first": instruction + _task(rng),
        "fact_text": instruction,
        "instruction": instruction,
        "final": final,
        "expect": None,
        "answer": "I looked through the files you asked about, and nothing there needs a change.",
        "check": {"type": "one_sentence"},
        "needles": [],
    }


BUILDERS = {
    "recall_request": _recall_request,
    "recall_result": _recall_result,
    "comply_tests": _comply_tests,
    "comply_grep": _comply_grep,
    "comply_sentence": _comply_sentence,
}


# ----------------------------------------------------------------------------- a trace


def kind_of(index: int) -> str:
    return KINDS[index % len(KINDS)]


def _call_msg(st: I.Step) -> dict:
    calls = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in st.calls]
    return {"role": "assistant", "content": "", "tool_calls": calls}


def make_trace(seed: int, index: int, n_results: int, control: bool = False) -> dict:
    """Trace `index` of the memory stream for `seed`, with `n_results` filler tool results
    between the fact (or instruction) and the final request; `control`: a compliance trace
    without its instruction."""
    kind = kind_of(index)
    if control and kind not in COMPLIANCE_KINDS:
        raise ValueError(f"control: {kind} is a recall kind (a control trace drops a compliance instruction)")
    corpus = split_corpus("heldout")
    rng = Random(f"clover-memory:{MEMORY_VERSION}:{seed}:{index}")
    while True:
        f = rng.choice(corpus.files)
        spec = BUILDERS[kind](rng, corpus, f)
        if spec is not None:
            break
    final_tool = spec["expect"]["name"] if spec["expect"] else None
    needed = [final_tool] if final_tool else []
    if kind == "recall_result":
        needed.append("find_symbol")
    if kind == "comply_grep":
        needed += ["find_symbol", "read_file"]
    forbidden = FORBIDDEN_IN_FILLERS.get(kind, set())
    # a few tools for the fillers: a held-out combination of at most 8 with the needed ones
    pool = [n for n in TOOL_NAMES if n not in needed and n not in forbidden]
    needed = list(dict.fromkeys(needed + rng.sample(pool, 4 - min(len(needed), 3))))
    tools = offered_tools(rng, needed, "heldout")
    while tools is None:  # pragma: no cover - 200 draws of 1/8 odds each
        tools = offered_tools(rng, needed, "heldout")
    probe = None
    if kind in RECALL_KINDS:  # paths the trace never mentions, for eval memory's likelihood probe
        others = [g.path for g in corpus.files if g.path != f.path]
        probe = {"argument": "path", "value": f.path, "distractors": rng.sample(others, N_DISTRACTORS)}
    needles = [f.path, *spec["needles"], *(probe["distractors"] if probe else [])]
    frng = Random(f"clover-memory:{MEMORY_VERSION}:{seed}:{index}:fillers")
    stream = _filler_steps(frng, corpus, tools, forbidden, needles)
    steps = [next(stream) for _ in range(n_results)]

    first = spec["first"]
    if control:
        first = first.replace(spec["instruction"], "").strip()
    msgs: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": first}]
    fact_message = 1
    if "first_step" in spec:
        msgs.append(_call_msg(spec["first_step"]))
        msgs.append({"role": "tool", "content": spec["first_step"].results[0]})
        fact_message = 3
    for st in steps:
        msgs.append(_call_msg(st))
        msgs += [{"role": "tool", "content": r} for r in st.results]
    msgs.append({"role": "assistant", "content": _closing(rng, len(steps))})
    msgs.append({"role": "user", "content": spec["final"]})
    if spec["expect"]:
        e = spec["expect"]
        call = {"type": "function", "function": {"name": e["name"], "arguments": e["arguments"]}}
        msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
    else:
        msgs.append({"role": "assistant", "content": spec["answer"]})
    return {
        "id": f"memory-{seed}-{index}-n{n_results}" + ("-control" if control else ""),
        "split": "heldout",
        "kind": kind,
        "control": control,
        "seed": seed,
        "index": index,
        "n_results": n_results,
        "module": f.module,
        "mode": MODE,
        "tools": tools,
        "messages": msgs,
        "fact": None if control else {"text": spec["fact_text"], "message": fact_message},
        "check": spec["check"],
        "probe": probe,
    }


def _closing(rng: Random, n: int) -> str:
    return rng.choice([f"I have looked at {I.plural(n, 'result')}.", "Done: I went through them.", "That is all."])


def swap_fact(trace: dict) -> dict:
    """The recall trace with its fact's path replaced by its first distractor wherever the history
    names it (the request, or the first call's result): the probe's control, in which the
    distractor is the path mentioned early and the fact is never mentioned."""
    pr = trace["probe"]
    if not pr:
        raise ValueError(f"{trace['id']}: not a recall trace (nothing to swap)")
    k = final_index(trace)
    head = json.loads(json.dumps(trace["messages"][:k]).replace(pr["value"], pr["distractors"][0]))
    return {**trace, "id": trace["id"] + "-swapped", "messages": head + trace["messages"][k:]}


def final_index(trace: dict) -> int:
    """The index of the final assistant message (the turn the eval generates)."""
    return len(trace["messages"]) - 1


# ----------------------------------------------------------------------------- scoring

_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


def one_sentence(text: str) -> bool:
    """Whether a text answer is one sentence: non-empty, on one line, and ending its first
    sentence at its end (a period inside a name, `os.path`, or a number, 3.5, ends nothing)."""
    t = text.strip()
    if not t or "\n" in t:
        return False
    ends = [m.end() for m in _SENTENCE_END.finditer(t)]
    return len(ends) <= 1 and (not ends or ends[0] == len(t))


def score_reply(trace: dict, calls: list[dict], content: str, ended: bool) -> dict:
    """Whether the final reply is right, from the calls it returned (parsed sections: name,
    arguments, schema) and its text content (reasoning removed); ``ended``: the reply closed
    its turn before the token limit. Keys: called (a parsable call), valid (the first call fits
    its offered tool's schema), recall / per-argument recall (recall kinds: the first call with
    the checked name carries each fact exactly), compliance (compliance kinds: the rule holds)."""
    chk = trace["check"]
    parsed = [c for c in calls if c.get("json")]
    out: dict = {"called": bool(parsed), "valid": bool(parsed and parsed[0]["schema"])}
    if chk["type"] == "recall":
        c = next((c for c in parsed if c["name"] == chk["name"]), None)
        got = {k: (c is not None and c["arguments"].get(k) == v and type(c["arguments"].get(k)) is type(v))
               for k, v in chk["arguments"].items()}  # fmt: skip
        out["right_tool"] = c is not None
        out["recall_by_argument"] = got
        out["recall"] = all(got.values())
    elif chk["type"] == "rule_arguments":
        c = next((c for c in parsed if c["name"] == chk["name"]), None)
        out["right_tool"] = c is not None
        out["compliance"] = c is not None and all(
            c["arguments"].get(k) == v and type(c["arguments"].get(k)) is type(v) for k, v in chk["arguments"].items()
        )
    elif chk["type"] == "rule_name":
        out["right_tool"] = bool(parsed) and parsed[0]["name"] == chk["name"]
        out["compliance"] = bool(parsed) and all(c["name"] == chk["name"] for c in parsed)
    elif chk["type"] == "one_sentence":
        out["right_tool"] = not calls  # a text answer, no call
        out["compliance"] = not calls and ended and one_sentence(content)
    else:  # pragma: no cover - the builders make only these
        raise ValueError(f"unknown check {chk['type']!r}")
    return out
