"""`clover-gguf eval tools`: what quantization does to tool calls.

The held-out chat transcripts (evaldata/tools/heldout.jsonl, written by
clover_gguf.train.transcripts: held-out stdlib modules, tool combinations training never offered)
are replayed turn by turn: every assistant turn's history is rendered with the model's chat
template as the server renders the request (tools in the system turn; thinking on, or off for
"nothink" transcripts), the model generates the turn, and the reply is read as the server reads it
(reasoning split off, `<tool_call>` sections). Expected: the turn's calls in the transcript, or
none.

Decoding: the PyTorch reference on the BF16 model folder (free decoding only: it has no grammar
sampler) and each GGUF through the llama.cpp runtime, free and constrained. Constrained = the
server's `tool_choice: "auto"` (serve/tools.py:request_constraint): free text, and from the first
`<tool_call>` on the tool-call grammar (a lazy grammar), so every call it starts matches a schema.

Per file, provider and decoding mode (median and p10/p90 over --repeats, which need a temperature):
- call rate: turns expecting a call where the reply has a `<tool_call>` section;
- valid calls: expected calls answered by a section whose JSON parses and validates against the
  named tool's schema (jsonschema), the named tool being offered (the issue's 80 % target);
- name accuracy: expected calls answered with the right tool name (the 70 % target);
- JSON validity and schema validity of the sections emitted (a section the token limit cut counts
  as emitted and invalid), and the schema validity of the calls the server returns (the sections that
  parse as a call: constrained, the grammar's guarantee); the sections the limit cut, and the replies
  that wrote a call's JSON outside any section (the lazy grammar never sees those);
- exact arguments: against the transcript, and against the BF16 reference's call in the same turn;
- calls where none is expected;
- tokens per step of the schedule on blocks inside calls vs prose (and thinking) blocks.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...reference.generate import GenerationConfig
from ...tokenizer import END_TOOL_CALL, tool_call_sections
from .metrics import spread
from .tool_blocks import BLOCK_CLASSES, IM_END, block_steps, gen_config, token_labels

MODES = ("free", "constrained")


@dataclass
class ToolsConfig:
    heldout: str | None = None  # default evaldata/tools/heldout.jsonl
    limit: int | None = None  # the first N transcripts
    modes: tuple = MODES
    max_new_tokens: int = 160
    block_size: int | None = None  # default: the model's
    steps: int | None = None
    threshold: float = 0.9
    temperature: float = 0.0
    repeats: int = 1
    seed: int = 0
    stability_turns: int = 0  # formatting stability (stability.py) on this many call turns
    threads: int | None = None


# ----------------------------------------------------------------------------- turns


def load_turns(path=None, limit: int | None = None) -> tuple[list[dict], dict]:
    """(turns, tool schemas): every assistant turn of the held-out transcripts, with its history,
    offered tools, thinking mode and expected calls."""
    from ...train.transcripts import HELDOUT_DIR, assistant_turns, expected_calls, load_heldout_set

    p = Path(path) if path else HELDOUT_DIR / "heldout.jsonl"
    if not p.is_file():
        raise ValueError(f"{p}: no such held-out transcript file")
    try:
        rows, schemas = load_heldout_set(p)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{p}: not a held-out transcript set ({e})") from None
    rows = rows[:limit] if limit else rows
    turns = []
    for t in rows:
        missing = [n for n in t["tools"] if n not in schemas]
        if missing:
            raise ValueError(f"{p}: transcript {t['id']} offers {missing[0]!r}, which tools.json does not define")
        for k in assistant_turns(t):
            turns.append(
                {
                    "id": f"{t['id']}#{k}",
                    "transcript": t,
                    "k": k,
                    "thinking": t["mode"] != "nothink",
                    "tools": [schemas[n] for n in t["tools"]],
                    "expected": expected_calls(t["messages"][k]),
                }
            )
    return turns, schemas


# ----------------------------------------------------------------------------- decoders


class _Decoder:
    """What both decoders hand to the generation loader's model (``self.gen``)."""

    def backend(self):
        return self.gen.logits_backend()

    def generate(self, ids, cfg: GenerationConfig, on_block=None):
        return self.gen.generate(ids, cfg, on_block)

    def text(self, ids) -> str:
        return self.gen.detokenize(ids)

    def token_id(self, s: str):
        return self.gen.token_id(s)

    def close(self):
        self.gen.close()


class ReferenceDecoder(_Decoder):
    """The PyTorch reference on a BF16 model folder, its tokenizer and chat template."""

    name, grammar = "reference-bf16", False

    def __init__(self, model_dir):
        from ...generation.loader import load

        self.gen = load(model_dir)
        self.tok = self.gen.tokenizer
        self.block_size = self.gen.block_size
        self.eos, self.mask = self.tok.eos_id, self.tok.mask_id

    def prompt(self, turn: dict) -> list[int]:
        from ...train.transcripts import render_prompt

        schemas = {t["function"]["name"]: t for t in turn["tools"]}
        return self.gen.tokenize(render_prompt(self.tok, turn["transcript"], turn["k"], schemas))


class RuntimeDecoder(_Decoder):
    """A GGUF through the llama.cpp runtime, with the GGUF's own chat template."""

    name, grammar = "runtime", True

    def __init__(self, gguf, threads=None):
        from ...generation.loader import load
        from ...util import default_threads

        self.gen = load(gguf, threads=threads or default_threads())
        self.block_size = self.gen.block_size
        self.eos, self.mask = self.gen.eos_token_id, self.gen.mask_token_id

    def prompt(self, turn: dict) -> list[int]:
        msgs = turn["transcript"]["messages"][: turn["k"]]
        return self.gen.tokenize(self.gen.chat_prompt(msgs, enable_thinking=turn["thinking"], tools=turn["tools"]))


# ----------------------------------------------------------------------------- reading replies


def split_turn(text: str, thinking: bool) -> tuple[str, str]:
    """(reasoning, content) of the generated turn, cut at the end of the turn."""
    from ...serve.text import split_reasoning

    text = text.split(IM_END)[0]
    r, c = split_reasoning(text) if thinking else (None, text)
    return r or "", c


def parse_sections(content: str, tools: list[dict]) -> list[dict]:
    """Every `<tool_call>` section of a reply (one left open at the end counts, unparsable):
    name, arguments, whether the JSON is a call and whether it fits the named offered tool."""
    from ...train.toolset import schema_errors

    out = []
    for _, body, end in tool_call_sections(content):
        inner, closed = content[body:end].strip(), end is not None
        s = {"closed": closed, "json": False, "schema": False, "name": None, "arguments": None}
        try:
            obj = json.loads(inner) if closed else None
        except ValueError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict):
            s.update(json=True, name=obj["name"], arguments=obj["arguments"])
            s["schema"] = not schema_errors(obj["name"], obj["arguments"], tools)
        out.append(s)
    return out


_BARE_CALL = re.compile(r'\{\s*"name"\s*:\s*"')


def outside_call(content: str) -> bool:
    """Whether the reply writes a call's JSON (`{"name": "...`) outside every `<tool_call>` section:
    a call the server does not return, and which a lazy grammar never constrains."""
    keep, pos = [], 0
    for i, _, j in tool_call_sections(content):
        keep.append(content[pos:i])
        pos = len(content) if j is None else j + len(END_TOOL_CALL)
    keep.append(content[pos:])
    return any(_BARE_CALL.search(k) for k in keep)


def match_calls(expected: list[dict], emitted: list[dict]) -> list[dict | None]:
    """The emitted section answering each expected call: the first unused one with its name,
    else the first unused one (None: too few sections)."""
    used, out = set(), []
    for e in expected:
        j = next((i for i, s in enumerate(emitted) if i not in used and s["name"] == e["name"]), None)
        if j is None:
            j = next((i for i in range(len(emitted)) if i not in used), None)
        if j is not None:
            used.add(j)
        out.append(emitted[j] if j is not None else None)
    return out


# ----------------------------------------------------------------------------- one turn


def constrain(dec, g: GenerationConfig, turn: dict) -> GenerationConfig:
    """The server's tool_choice "auto" grammar: lazy, from the first <tool_call> token on."""
    from ...serve.tools import check_tools, request_constraint

    c = request_constraint(check_tools(turn["tools"]), "auto", True, None, None, turn["thinking"], dec.token_id)
    g.grammar, g.grammar_triggers = c.grammar, [dec.token_id(c.trigger)] if c.trigger else None
    return g


@dataclass
class Generated:
    """An assistant turn generated after its transcript, up to <|im_end|>, and read."""

    ids: list[int]  # the prompt
    res: object  # the decoder's result (tokens, blocks)
    text: str
    content: str  # the text after any think block
    sections: list[dict]  # parse_sections of the content
    blocks: dict  # block_steps: [tokens, steps] per block class


def generate_turn(dec, turn: dict, g: GenerationConfig, mode: str) -> Generated:
    """Generate the turn with g (constrained: the server's tool_choice auto grammar) and read it."""
    ids = dec.prompt(turn)
    if mode == "constrained":
        g = constrain(dec, g, turn)
    end_id = dec.token_id(IM_END)
    res = dec.generate(ids, g, lambda toks, st: end_id not in toks)
    text = dec.text(res.tokens)
    _, content = split_turn(text, turn["thinking"])
    pieces = [dec.text([t]) for t in res.tokens]
    blocks = block_steps(res, token_labels(pieces, turn["thinking"]))
    return Generated(ids, res, text, content, parse_sections(content, turn["tools"]), blocks)


def run_turn(dec, turn: dict, cfg: ToolsConfig, mode: str, seed: int) -> dict:
    """Generate one assistant turn and read it: sections, matches, block classes."""
    gt = generate_turn(dec, turn, gen_config(dec, cfg, seed), mode)
    return {
        "id": turn["id"],
        "mode": mode,
        "seed": seed,
        "text": gt.text.split(IM_END)[0],
        "emitted": gt.sections,
        "outside_call": outside_call(gt.content),
        "matched": match_calls(turn["expected"], gt.sections),
        "blocks": gt.blocks,
        "prompt_tokens": len(gt.ids),
        "tokens": len(gt.res.tokens),
    }


# ----------------------------------------------------------------------------- figures


def _same_call(a: dict | None, b: dict | None) -> bool:
    return bool(a and b and a["json"] and b["json"] and a["name"] == b["name"] and a["arguments"] == b["arguments"])


def figures(turns: list[dict], recs: list[dict], ref: dict | None = None) -> dict:
    """The figures of one (file, provider, mode, repeat): recs in the order of turns; `ref`: the
    BF16 reference's records of the same repeat by turn id (free decoding)."""
    exp_calls = n_turns_call = with_call = emitted = json_ok = schema_ok = 0
    valid = names = exact = 0
    vs_ref = [0, 0]
    no_call = false_call = 0
    cut = outside = 0
    steps = {k: [0, 0] for k in BLOCK_CLASSES}
    for t, r in zip(turns, recs):
        for k in BLOCK_CLASSES:
            steps[k][0] += r["blocks"][k][0]
            steps[k][1] += r["blocks"][k][1]
        emitted += len(r["emitted"])
        json_ok += sum(s["json"] for s in r["emitted"])
        schema_ok += sum(s["schema"] for s in r["emitted"])
        cut += sum(not s["closed"] for s in r["emitted"])
        outside += bool(r.get("outside_call"))
        if not t["expected"]:
            no_call += 1
            false_call += bool(r["emitted"])
            continue
        n_turns_call += 1
        with_call += bool(r["emitted"])
        rr = ref.get(t["id"]) if ref else None
        for i, (e, s) in enumerate(zip(t["expected"], r["matched"])):
            exp_calls += 1
            valid += bool(s and s["schema"])
            names += bool(s and s["name"] == e["name"])
            exact += bool(s and s["json"] and s["name"] == e["name"] and s["arguments"] == e["arguments"])
            if rr is not None and rr["matched"][i] is not None and rr["matched"][i]["json"] and s and s["json"]:
                vs_ref[0] += 1
                vs_ref[1] += _same_call(s, rr["matched"][i])

    def frac(a, b):
        return a / b if b else None

    return {
        "turns": len(turns),
        "turns_expecting_calls": n_turns_call,
        "expected_calls": exp_calls,
        "call_rate": frac(with_call, n_turns_call),
        "valid_calls": frac(valid, exp_calls),
        "name_accuracy": frac(names, exp_calls),
        "exact_arguments": frac(exact, exp_calls),
        "sections": emitted,
        "json_validity": frac(json_ok, emitted),
        "schema_validity": frac(schema_ok, emitted),
        # a section parses as a call only when closed: those are the calls the server returns
        "returned_calls_valid": frac(schema_ok, json_ok),
        "returned_calls": json_ok,
        "cut_sections": cut,
        "turns_with_outside_call": outside,
        "same_call_as_bf16": frac(vs_ref[1], vs_ref[0]),
        "compared_with_bf16": vs_ref[0],
        "turns_expecting_none": no_call,
        "calls_where_none_expected": frac(false_call, no_call),
        **{f"tokens_per_step_{k}": frac(*steps[k]) for k in BLOCK_CLASSES},
        **{f"{k}_blocks_tokens": steps[k][0] for k in BLOCK_CLASSES},
    }


FIGURES = (
    "call_rate",
    "valid_calls",
    "name_accuracy",
    "exact_arguments",
    "json_validity",
    "schema_validity",
    "returned_calls_valid",
    "same_call_as_bf16",
    "calls_where_none_expected",
    "tokens_per_step_call",
    "tokens_per_step_prose",
    "tokens_per_step_think",
)


def summarize(per_repeat: list[dict]) -> dict:
    """median/p10/p90 over repeats of every figure (and the counts of the first repeat)."""
    out = {k: spread([f[k] for f in per_repeat if f[k] is not None]) for k in FIGURES}
    out["counts"] = {k: v for k, v in per_repeat[0].items() if k not in FIGURES}
    return out


@dataclass
class Target:
    name: str
    path: str
    provider: str
    rows: dict = field(default_factory=dict)  # mode -> summary
    records: dict = field(default_factory=dict)  # mode -> [repeat][turn] records


def evaluate(dec, turns, cfg: ToolsConfig, modes, ref_records=None, log=print, label="") -> dict:
    """{mode: (summary, records by repeat)} for one decoder; `ref_records`: {mode: records by
    repeat} of the reply each mode's "same call" compares with."""
    out = {}
    for mode in modes:
        reps, recs_all = [], []
        for rep in range(cfg.repeats):
            recs = []
            for i, t in enumerate(turns):
                recs.append(run_turn(dec, t, cfg, mode, cfg.seed + rep))
                if (i + 1) % 50 == 0:
                    log(f"{label} {mode} repeat {rep}: {i + 1}/{len(turns)} turns")
            base = (ref_records or {}).get(mode)
            ref = {r["id"]: r for r in base[rep]} if base else None
            reps.append(figures(turns, recs, ref))
            recs_all.append(recs)
        out[mode] = (summarize(reps), recs_all)
        f = reps[0]
        log(
            f"{label} {mode}: valid calls {f['valid_calls']}, names {f['name_accuracy']}, call rate "
            f"{f['call_rate']}, calls where none expected {f['calls_where_none_expected']}"
        )
    return out


def check_config(cfg: ToolsConfig) -> None:
    if cfg.repeats > 1 and cfg.temperature == 0:
        raise ValueError("--repeats > 1 needs --temperature > 0: greedy decoding repeats itself exactly")
    bad = [m for m in cfg.modes if m not in MODES]
    if bad:
        raise ValueError(f"--modes: {bad[0]!r} is not one of {', '.join(MODES)}")


def reference_notes(reference, ggufs, log=print) -> list[str]:
    """Each GGUF is a conversion of the reference (run.check_matches_reference: config, shapes,
    token strings, fingerprint, a few rows of every tensor's weights), before anything is
    scored: QualityError names the first that is not. The notes of the files matched without a
    fingerprint, logged."""
    from ...config import CloverConfig
    from .run import mismatch_notes

    notes = mismatch_notes([Path(g) for g in ggufs], Path(reference), CloverConfig.load(reference))
    for n in notes:
        log(f"note: {n}")
    return notes


def run_tools(reference, ggufs, cfg: ToolsConfig, out_dir, names=None, log=print) -> dict:
    """The command: the reference (free), then each GGUF (cfg.modes); writes tools.json,
    report.md and tools.png to out_dir. Returns the run dict."""
    from ..sysinfo import environment

    check_config(cfg)
    turns, _ = load_turns(cfg.heldout, cfg.limit)
    names = list(names or []) + [Path(g).name for g in ggufs[len(names or []) :]]
    notes = reference_notes(reference, ggufs, log)
    log(f"{len(turns)} assistant turns ({sum(bool(t['expected']) for t in turns)} expecting calls)")
    targets = []
    ref_dec = ReferenceDecoder(reference)
    ref = evaluate(ref_dec, turns, cfg, ["free"], log=log, label="reference-bf16")
    ref_records = ref["free"][1]
    targets.append(
        Target(
            "BF16 (PyTorch reference)", str(reference), ref_dec.name, {"free": ref["free"][0]}, {"free": ref_records}
        )
    )
    stab = {}
    if cfg.stability_turns:
        from .stability import stability_of

        stab[targets[0].name] = stability_of(ref_dec, turns, cfg, log)
    # A grammar unmasks a call left to right, so a constrained reply is compared with the first
    # file's constrained reply (BF16 in a baseline), not with the reference's free one.
    refs = {"free": ref_records}
    for name, g in zip(names, ggufs):
        dec = RuntimeDecoder(g, cfg.threads)
        try:
            res = evaluate(dec, turns, cfg, cfg.modes, refs, log, name)
            if "constrained" in res and "constrained" not in refs:
                refs["constrained"] = res["constrained"][1]
            if cfg.stability_turns:
                stab[name] = stability_of(dec, turns, cfg, log)
        finally:
            dec.close()
        targets.append(
            Target(name, str(g), dec.name, {m: v[0] for m, v in res.items()}, {m: v[1] for m, v in res.items()})
        )
    run = {
        "kind": "tools",
        "config": {**asdict(cfg), "turns": len(turns), "environment": environment(cfg.threads)},
        "targets": [
            {"name": t.name, "path": t.path, "provider": t.provider, "modes": t.rows, "records": t.records}
            for t in targets
        ],
        "stability": stab,
        "notes": notes,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "tools.json.tmp"
    tmp.write_text(json.dumps(run, indent=1))
    tmp.replace(out / "tools.json")
    from ..render.tools import render_tools

    render_tools(run, out)
    return run
