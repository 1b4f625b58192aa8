"""What a user asks about a stdlib file, and what the assistant does about it: one exchange of
a chat transcript (train/transcripts.py assembles them).

Each intent takes a random.Random and a file's facts (train/corpus_facts.py) and returns an
Exchange: the user's request, the assistant turns that call tools (their calls, with the
tools' results computed from the real file where a real answer exists: excerpts, grep lines,
definitions, line counts, lint findings; test runs, commit logs and documentation hits are
made up, naming real functions), and the final answer. The request names everything a call
needs (paths, names, line numbers, options), in varied words, so that the right tool and its
arguments follow from it; a second call takes its arguments from the first one's result.
Intents without tools are questions answered in a sentence and thanks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from random import Random

from .corpus_facts import Corpus, FileFacts, Symbol
from .toolset import DOC_SECTIONS

MAX_RESULT_LINES = 12


@dataclass
class Call:
    name: str
    arguments: dict


@dataclass
class Step:
    """One assistant turn that calls tools, and what the tools answered."""

    calls: list[Call]
    results: list[str]
    think: str = ""
    preface: str = ""  # text before the calls (rare)


@dataclass
class Exchange:
    user: str
    steps: list[Step] = field(default_factory=list)
    answer: str = ""
    answer_think: str = ""

    @property
    def tools(self) -> list[str]:
        out: list[str] = []
        for s in self.steps:
            for c in s.calls:
                if c.name not in out:
                    out.append(c.name)
        return out

    @property
    def n_turns(self) -> int:
        return len(self.steps) + 1


# --- helpers ---------------------------------------------------------------------------------


def q(rng: Random, s: str) -> str:
    """A name as users write it: in backticks or bare."""
    return f"`{s}`" if rng.random() < 0.6 else s


def excerpt(f: FileFacts, a: int, b: int) -> str:
    """Lines a..b of the file, numbered, at most MAX_RESULT_LINES of them."""
    a, b = max(1, a), min(len(f.lines), b)
    shown = [f"{n}: {f.lines[n - 1]}" for n in range(a, min(b, a + MAX_RESULT_LINES - 1) + 1)]
    more = b - a + 1 - len(shown)
    return "\n".join(shown + ([f"... ({more} more lines)"] if more > 0 else []))


def enclosing(f: FileFacts, line: int) -> Symbol | None:
    inner = [s for s in f.of_kind("function", "method", "class") if s.line <= line <= s.end]
    return min(inner, key=lambda s: s.end - s.line) if inner else None


def first_sentence(doc: str) -> str:
    para = " ".join(doc.strip().split("\n\n")[0].split())
    m = re.match(r"(.+?[.!?])(\s|$)", para)
    s = m.group(1) if m else para
    return s if len(s) <= 160 else s[:157].rsplit(" ", 1)[0] + "..."


def matches(f: FileFacts, word: str, ignore_case: bool = False) -> list[int]:
    rx = re.compile(r"\b" + re.escape(word) + r"\b", re.I if ignore_case else 0)
    return [i + 1 for i, line in enumerate(f.lines) if rx.search(line)]


def grep_lines(f: FileFacts, lines: list[int], limit: int) -> str:
    out = [f"{f.path}:{n}: {f.lines[n - 1].strip()}" for n in lines[:limit]]
    if len(lines) > limit:
        out.append(f"... ({len(lines) - limit} more matches)")
    return "\n".join(out) if out else "No matches."


def pick_symbol(rng: Random, f: FileFacts, *kinds: str, public: float = 0.85) -> Symbol | None:
    syms = f.of_kind(*kinds)
    if not syms:
        return None
    pub = [s for s in syms if not s.short.startswith("_")]
    return rng.choice(pub if pub and rng.random() < public else syms)


def test_name(s: Symbol) -> str:
    snake = re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", s.short).lower().strip("_")
    return "test_" + snake


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


# --- reading ---------------------------------------------------------------------------------


def read_range(rng: Random, f: FileFacts, corpus: Corpus) -> Exchange | None:
    if len(f.lines) < 12:
        return None
    a = rng.randint(1, len(f.lines) - 8)
    b = min(len(f.lines), a + rng.randint(4, 30))
    p = f.path
    user = rng.choice(
        [
            f"Show me lines {a}-{b} of {p}.",
            f"Can you open {p} at lines {a} to {b}?",
            f"Read {p}, lines {a} through {b}.",
            f"I need to see {p} from line {a} to line {b}.",
            f"Print lines {a} to {b} of {q(rng, p)} please.",
        ]
    )
    sym = enclosing(f, a)
    answer = f"Those are lines {a}-{b} of {p}" + (f", inside `{sym.name}`." if sym else ".")
    step = Step(
        [Call("read_file", {"path": p, "start_line": a, "end_line": b})],
        [excerpt(f, a, b)],
        think=f"The user wants lines {a} to {b} of {p}. read_file takes the path and the line range.",
    )
    return Exchange(user, [step], answer, answer_think="I have the lines; say where they are.")


def read_head(rng: Random, f: FileFacts, corpus: Corpus) -> Exchange | None:
    p = f.path
    if rng.random() < 0.5:
        n = rng.choice([5, 10, 15, 20, 25, 30, 40, 50])
        user = rng.choice(
            [f"Show me the first {n} lines of {p}.", f"What are the first {n} lines of {q(rng, p)}?"],
        )
        args = {"path": p, "start_line": 1, "end_line": n}
    else:
        n = len(f.lines)
        user = rng.choice([f"Open {p}.", f"Show me {q(rng, p)}.", f"Read the file {p} for me."])
        args = {"path": p}
    doc = first_sentence(f.doc) if f.doc else ""
    answer = f"{p} has {plural(len(f.lines), 'line')}." + (f" Its docstring begins: {doc}" if doc else "")
    step = Step(
        [Call("read_file", args)],
        [excerpt(f, 1, n)],
        think=f"The user wants to read {p}. read_file with the path" + (" and lines 1 to n." if len(args) > 1 else "."),
    )
    return Exchange(user, [step], answer, answer_think="Summarise what the file starts with.")


def find_symbol_call(rng: Random, f: FileFacts, s: Symbol, with_module: bool) -> Call:
    args = {"name": s.name, "kind": s.kind}
    if with_module:
        args["module"] = f.module
    return Call("find_symbol", args)


def symbol_request(rng: Random, f: FileFacts, s: Symbol, with_module: bool) -> str:
    n, m = q(rng, s.name), f.module
    where = f" in {m}" if with_module else ""
    return rng.choice(
        {
            "function": [
                f"Where is the function {n} defined{where}?",
                f"Find the definition of the function {n}{where}.",
            ],
            "class": [f"Where is the class {n} defined{where}?", f"Which file defines the class {n}{where}?"],
            "method": [f"Where is the method {n} defined{where}?", f"Find the method {n}{where}."],
            "constant": [f"Where is the constant {n} set{where}?", f"Find the constant {n}{where}."],
        }[s.kind]
    )


def definition_line(f: FileFacts, s: Symbol) -> str:
    return f"{f.path}:{s.line}-{s.end}: {f.lines[s.line - 1].strip()}"


def find_symbol(rng: Random, f: FileFacts, corpus: Corpus) -> Exchange | None:
    s = pick_symbol(rng, f, *rng.choice([("function",), ("class",), ("method",), ("constant",)]))
    if s is None:
        return None
    with_module = rng.random() < 0.5
    step = Step(
        [find_symbol_call(rng, f, s, with_module)],
        [definition_line(f, s)],
        think=f"The user wants the definition of the {s.kind} {s.name}. find_symbol with kind {s.kind}.",
    )
    answer = f"`{s.name}` is defined in {f.path} at line {s.line}."
    return Exchange(symbol_request(rng, f, s, with_module), [step], answer, "Report the file and line.")


def symbol_source(rng: Random, f: FileFacts, corpus: Corpus) -> Exchange | None:
    """find_symbol, then read_file with the span it returned."""
    s = pick_symbol(rng, f, "function", "class", "method")
    if s is None:
        return None
    with_module = rng.random() < 0.5
    n, where = q(rng, s.name), f" in {f.module}" if with_module else ""
    user = rng.choice(
        [
            f"Show me the source of the {s.kind} {n}{where}.",
            f"Find the {s.kind} {n}{where} and show me its code.",
            f"I want to read the code of the {s.kind} {n}{where}.",
        ]
    )
    steps = [
        Step(
            [find_symbol_call(rng, f, s, with_module)],
            [definition_line(f, s)],
            think=f"First find where the {s.kind} {s.name} is, with find_symbol; then read those lines.",
        ),
        Step(
            [Call("read_file", {"path": f.path, "start_line": s.line, "end_line": s.end})],
            [excerpt(f, s.line, s.end)],
            think=f"find_symbol says {f.path} lines {s.line}-{s.end}. Read them with read_file.",
        ),
    ]
    answer = f"That is `{s.name}`, lines {s.line}-{s.end} of {f.path}."
    if s.doc:
        answer += f" Its docstring says: {first_sentence(s.doc)}"
    return Exchange(user, steps, answer, "Show where it is and what it does.")


# --- searching -------------------------------------------------------------------------------


def grep(rng: Random, f: FileFacts, corpus: Corpus) -> Exchange | None:
    if not f.names:
        return None
    w, p = rng.choice(f.names), f.path
    args = {"pattern": w, "path": p}
    style = rng.choice(["plain", "plain", "case", "limit"])
    if style == "case":
        args["ignore_case"] = True
        user = rng.choice(
            [
                f"Find the lines in {p} that mention {q(rng, w)}, ignoring case.",
                f"Search {p} for {q(rng, w)}, case-insensitive.",
            ]
        )
    elif style == "limit":
        k = rng.choice([3, 5, 10, 20])
        args["max_results"] = k
        user = rng.choice(
            [
                f"Grep {p} for {q(rng, w)}, first {k} matches only.",
                f"Show at most {k} lines of {p} that use {q(rng, w)}.",
            ]
        )
    else:
        user = rng.choice(
            [f"Search {p} for {q(rng, w)}.", f"Where does {p} use {q(rng, w)}?", f"Grep for {q(rng, w)} in {p}."]
        )
    lines = matches(f, w, ignore_case=style == "case")
    step = Step(
        [Call("grep", args)],
        [grep_lines(f, lines, args.get("max_results", 8))],
        think=f"The user wants the lines of {p} with {w}. grep takes the pattern and the path.",
    )
    answer = (
        f"{q(rng, w)} appears on {plural(len(lines), 'line')} of {p}; the first is line {lines[0]}."
        if lines
        else f"{p} does not mention {w}."
    )
    return Exchange(user, [step], answer, "Count the matches.")


def grep_two(rng: Random, f: FileFacts, corpus: Corpus) -> Exchange | None:
    """Two grep calls in one turn (parallel calls): one word in two files of a package."""
    sib = [g for g in corpus.by_package.get(f.package, []) if g.path != f.path]
    if not sib or not f.names:
        return None
    g = rng.choice(sib)
    w = rng.choice(f.names)
    user = rng.choice(
        [f"Search {f.path} and {g.path} for {q(rng, w)}.", f"Does {q(rng, w)} appear in {f.path} or in {g.path}?"]
    )
    la, lb = matches(f, w), matches(g, w)
    step = Step(
        [Call("grep", {"pattern": w, "path": f.path}), Call("grep", {"pattern": w, "path": g.path})],
        [grep_lines(f, la, 8), grep_lines(g, lb, 8)],
        think=f"Two files to search for {w}: call grep once for each.",
    )
    answer = f"{w}: {plural(len(la), 'line')} in {f.path}, {plural(len(lb), 'line')} in {g.path}."
    return Exchange(user, [step], answer, "Compare the two counts.")


def find_references(rng: Random, f: FileFacts, corpus: Corpus) -> Exchange | None:
    if not f.names:
        return None
    pkg, w = f.package, rng.choice(f.names)
    scope = {"package": pkg}
    private = rng.random() < 0.3
    if private:
        scope["include_private"] = True
    tail = ", private modules included" if private else ""
    user = rng.choice(
        [
            f"Find references to {q(rng, w)} in {pkg}{tail}.",
            f"Which lines of {pkg} use {q(rng, w)}{tail}?",
            f"List the uses of {q(rng, w)} across {pkg}{tail}.",
        ]
    )
    files = [g for g in corpus.by_package[pkg] if private or not g.path.rsplit("/", 1)[-1].startswith("_")]
    hits = [(g, n) for g in files for n in matches(g, w)]
    out = [f"{g.path}:{n}: {g.lines[n - 1].strip()}" for g, n in hits[:8]]
    if len(hits) > 8:
        out.append(f"... ({len(hits) - 8} more)")
    step = Step(
        [Call("find_references", {"symbol": w, "scope": scope})],
        ["\n".join(out) or "No references."],
        think=f"Uses of {w} in {pkg}: find_references with scope package {pkg}.",
    )
    answer = f"{w} is used on {plural(len(hits), 'line')} of {pkg}." if hits else f"Nothing in {pkg} uses {w}."
    return Exchange(user, [step], answer, "Count the references.")


def list_dir(rng: Random, f: FileFacts, corpus: Corpus) -> Exchange | None:
    if "/" not in f.path:
        return None
    d = f.package
    args = {"path": d}
    files = sorted(g.path for g in corpus.files if g.path.startswith(d + "/"))
    style = rng.choice(["plain", "recursive", "pattern"])
    if style == "recursive":
        args["recursive"] = True
        user = rng.choice(
            [f"List everything under {d}, recursively.", f"Show all files below {d}/, subdirectories too."]
        )
        names = [p[len(d) + 1 :] for p in files]
    else:
        names = [p[len(d) + 1 :] for p in files if "/" not in p[len(d) + 1 :]]
        if style == "pattern":
            stem = rng.choice(names).removesuffix(".py").strip("_")[:4] or "init"
            args["pattern"] = f"*{stem}*"
            names = [n for n in names if stem in n]
            user = rng.choice(
                [f"Which files in {d} match *{stem}*?", f"List the files of {d} with {stem} in the name."]
            )
        else:
            user = rng.choice([f"What files are in {d}?", f"List the directory {d}.", f"What is in the {d} package?"])
    step = Step(
        [Call("list_dir", args)],
        ["\n".join(names) or "(empty)"],
        think=f"The user wants the files of {d}. list_dir with that path.",
    )
    return Exchange(user, [step], f"{d} holds {plural(len(names), 'matching file')}.", "Count the files.")


# --- tests and edits -------------------------------------------------------------------------


def test_output(rng: Random, f: FileFacts, tests: list[str], fail: Symbol | None, verbose: bool) -> str:
    n = len(tests) if tests else rng.randint(3, 40)
    lines = (
        [f"{t} ({f.module}) ... {'FAIL' if fail and t == test_name(fail) else 'ok'}" for t in tests] if verbose else []
    )
    if fail is not None:
        line = rng.randint(fail.line + 1, max(fail.line + 1, fail.end))
        line = min(line, len(f.lines))
        lines += [
            f"FAIL: {test_name(fail)} ({f.module})",
            "Traceback (most recent call last):",
            f'  File "{f.path}", line {line}, in {fail.short}',
            f"    {f.lines[line - 1].strip()}",
            "AssertionError",
        ]
    lines += ["", f"Ran {plural(n, 'test')} in 0.{rng.randint(1, 999):03d}s", ""]
    lines.append("FAILED (failures=1)" if fail else "OK")
    return "\n".join(lines)


def run_tests(rng: Random, f: FileFacts, corpus: Corpus) -> Exchange | None:
    funcs = f.of_kind("function", "method")
    if not funcs:
        return None
    m = f.module
    args: dict = {"target": m}
    style = rng.choice(["plain", "named", "verbose", "timeout"])
    tests: list[str] = []
    if style == "named":
        picked = rng.sample(funcs, min(len(funcs), rng.randint(1, 3)))
        tests = [test_name(s) for s in picked]
        args["tests"] = tests
        user = rng.choice(
            [f"Run only {', '.join(tests)} for {m}.", f"Run the tests {' and '.join(tests)} of {q(rng, m)}."]
        )
    elif style == "verbose":
        args["verbose"] = True
        tests = [test_name(s) for s in rng.sample(funcs, min(len(funcs), 3))]
        user = rng.choice([f"Run the {m} tests verbosely.", f"Run the tests for {q(rng, m)} with verbose output."])
    elif style == "timeout":
        t = rng.choice([10, 30, 60, 120, 300])
        args["timeout"] = t
        user = rng.choice(
            [f"Run the tests for {m} with a {t}-second timeout.", f"Run {q(rng, m)}'s tests, timeout {t} seconds."]
        )
    else:
        user = rng.choice([f"Run the tests for {m}.", f"Do the tests of {q(rng, m)} pass?", f"Test {m} please."])
    fail = None
    if rng.random() < 0.4:
        pool = [s for s in funcs if test_name(s) in tests] if tests else funcs
        fail = rng.choice(pool or funcs)
    result = test_output(rng, f, tests, fail, style == "verbose")
    steps = [Step([Call("run_tests", args)], [result], think=f"Run the tests of {m} with run_tests.")]
    if fail is None:
        return Exchange(user, steps, "All the tests passed.", "Everything passed.")
    line = int(re.search(r"line (\d+)", result).group(1))
    a, b = max(1, line - 5), min(len(f.lines), line + 5)
    steps.append(
        Step(
            [Call("read_file", {"path": f.path, "start_line": a, "end_line": b})],
            [excerpt(f, a, b)],
            think=f"{test_name(fail)} failed at line {line} of {f.path}. Read lines {a} to {b} around it.",
        )
    )
    answer = f"{test_name(fail)} fails: the assertion is hit in `{fail.short}` at line {line} of {f.path}."
    return Exchange(user, steps, answer, "Explain where the failure is.")


def rename_to(rng: Random, w: str) -> str:
    return rng.choice([w.lstrip("_") if w.startswith("_") else "_" + w, w + "_", w + "2", "new_" + w.lstrip("_")])


def apply_patch(rng: Random, f: FileFacts, corpus: Corpus) -> Exchange | None:
    if not f.names:
        return None
    w = rng.choice(f.names)
    lines = [n for n in matches(f, w) if len(f.lines[n - 1]) < 100]
    if not lines:
        return None
    new = rename_to(rng, w)
    picked = sorted(rng.sample(lines, min(len(lines), rng.choice([1, 1, 2]))))
    edits = [{"line": n, "old": w, "new": new} for n in picked]
    p = f.path
    where = f"line {picked[0]}" if len(picked) == 1 else f"lines {picked[0]} and {picked[1]}"
    user = rng.choice(
        [
            f"In {p}, replace {q(rng, w)} with {q(rng, new)} on {where}.",
            f"On {where} of {p}, rename {q(rng, w)} to {q(rng, new)}.",
            f"Change {q(rng, w)} to {q(rng, new)} in {p}, {where}.",
        ]
    )
    then_test = rng.random() < 0.3
    if then_test:
        user += " Then run its tests."
    steps = [
        Step(
            [Call("apply_patch", {"path": p, "edits": edits})],
            [f"Applied {plural(len(edits), 'edit')} to {p}."],
            think=f"Edit {p}: one edit per line, old {w}, new {new}. apply_patch takes a list of edits.",
        )
    ]
    answer = f"Done: {w} is now {new} on {where} of {p}."
    if then_test:
        n = rng.randint(3, 40)
        steps.append(
            Step(
                [Call("run_tests", {"target": f.module})],
                [f"Ran {plural(n, 'test')} in 0.{rng.randint(1, 999):03d}s\n\nOK"],
                think=f"The edit is applied; now run_tests for {f.module}.",
            )
        )
        answer += " The tests still pass."
    return Exchange(user, steps, answer, "Confirm the edit.")


# --- introspection ---------------------------------------------------------------------------


def get_signature(rng: Random, f: FileFacts, corpus: Corpus) -> Exchange | None:
    s = pick_symbol(rng, f, "function", "class", "method")
    if s is None:
        return None
    m, n = f.module, q(rng, s.name)
    user = rng.choice(
        [
            f"What arguments does {m}.{s.name} take?",
            f"Show me the signature of {n} in {m}.",
            f"How do I call {n} from {m}? What are its parameters?",
        ]
    )
    sig = f"{s.short}{s.signature}"
    step = Step(
        [Call("get_signature", {"module": m, "name": s.name})],
        [sig],
        think=f"get_signature with module {m} and name {s.name}.",
    )
    return Exchange(user, [step], f"The signature is `{sig}`.", "Quote the signature.")


def get_docstring(rng: Random, f: FileFacts, corpus: Corpus) -> Exchange | None:
    m = f.module
    s = pick_symbol(rng, f, "function", "class", "method")
    full = rng.random() < 0.3
    if s is not None and s.doc and rng.random() < 0.75:
        args: dict = {"module": m, "name": s.name}
        doc, what = s.doc, f"{m}.{s.name}"
    elif f.doc:
        args, doc, what = {"module": m}, f.doc, f"the module {m}"
    else:
        return None
    if full:
        args["full"] = True
    user = rng.choice(
        [
            f"Show me the {'full ' if full else ''}docstring of {what}.",
            f"What does the {'whole ' if full else ''}docstring of {what} say?",
        ]
    )
    text = doc if full else doc.strip().split("\n\n")[0]
    if len(text) > 600:
        text = text[:600].rsplit(" ", 1)[0] + " ..."
    step = Step([Call("get_docstring", args)], [text], think=f"get_docstring for {what}.")
    return Exchange(user, [step], f"It says: {first_sentence(doc)}", "Give the first sentence.")


def count_lines(rng: Random, f: FileFacts, corpus: Corpus) -> Exchange | None:
    p = f.path
    kind = rng.choice(["all", "all", "code", "comment", "blank"])
    blank = sum(1 for t in f.lines if not t.strip())
    comment = sum(1 for t in f.lines if t.strip().startswith("#"))
    n = {"all": len(f.lines), "blank": blank, "comment": comment, "code": len(f.lines) - blank - comment}[kind]
    args = {"path": p}
    if kind != "all" or rng.random() < 0.3:
        args["kind"] = kind
    word = {"all": "", "code": " of code", "comment": " of comments", "blank": " that are blank"}[kind]
    user = rng.choice([f"How many lines{word} does {p} have?", f"Count the lines{word} in {q(rng, p)}."])
    label = {"all": "", "code": "code ", "comment": "comment ", "blank": "blank "}[kind]
    step = Step([Call("count_lines", args)], [str(n)], think=f"count_lines on {p}, kind {kind}.")
    return Exchange(user, [step], f"{p} has {plural(n, label + 'line')}.", "Report the count.")


def lint_findings(f: FileFacts, rules: list[str], limit: int) -> list[str]:
    out = []
    for i, t in enumerate(f.lines, 1):
        if "line-length" in rules and len(t) > limit:
            out.append(f"{f.path}:{i}: line-length ({len(t)} > {limit})")
        if "trailing-whitespace" in rules and t != t.rstrip():
            out.append(f"{f.path}:{i}: trailing-whitespace")
        if "bare-except" in rules and re.match(r"\s*except\s*:", t):
            out.append(f"{f.path}:{i}: bare-except")
        if "unused-import" in rules:
            m = re.match(r"import (\w+)$|from [\w.]+ import (\w+)$", t)
            name = m and (m.group(1) or m.group(2))
            if name and len(matches(f, name)) == 1:
                out.append(f"{f.path}:{i}: unused-import ({name})")
    return out


def lint(rng: Random, f: FileFacts, corpus: Corpus) -> Exchange | None:
    p = f.path
    style = rng.choice(["length", "length", "whitespace", "imports"])
    args: dict = {"path": p}
    if style == "length":
        k = rng.choice([72, 79, 80, 88, 99, 100, 120])
        args["rules"], args["max_line_length"] = ["line-length"], k
        user = rng.choice(
            [f"Check {p} for lines longer than {k} characters.", f"Lint {q(rng, p)} with a {k}-column limit."]
        )
    elif style == "whitespace":
        args["rules"] = ["trailing-whitespace", "bare-except"]
        user = rng.choice(
            [
                f"Lint {p} for trailing whitespace and bare excepts.",
                f"Does {p} have trailing whitespace or a bare except?",
            ]
        )
    else:
        args["rules"] = ["unused-import"]
        user = rng.choice([f"Run the unused-import check on {p}.", f"Does {q(rng, p)} import anything it never uses?"])
    found = lint_findings(f, args["rules"], args.get("max_line_length", 79))
    result = "\n".join(found[:8] + ([f"... ({len(found) - 8} more)"] if len(found) > 8 else [])) or "No problems found."
    step = Step([Call("lint", args)], [result], think=f"lint {p} with rules {', '.join(args['rules'])}.")
    answer = f"{plural(len(found), 'problem')} in {p}" + (
        f"; the first is on line {found[0].split(':')[1]}." if found else "."
    )
    return Exchange(user, [step], answer, "Summarise the findings.")


def run_python(rng: Random, f: FileFacts, corpus: Corpus) -> Exchange | None:
    s = pick_symbol(rng, f, "function", "class")
    if s is None or s.short.startswith("_"):
        return None
    m = f.module
    code, out = rng.choice(
        [
            (f"import {m}; print({m}.{s.name}.__qualname__)", s.name),
            (f"import {m}; print({m}.{s.name}.__module__)", m),
            (f"import {m}; print(callable({m}.{s.name}))", "True"),
        ]
    )
    args: dict = {"code": code}
    tail = ""
    if rng.random() < 0.35:
        args["timeout"] = rng.choice([5, 10, 30, 60])
        tail = f" with a timeout of {args['timeout']} seconds"
    user = rng.choice([f"Run `{code}`{tail}.", f"What does `{code}` print? Run it{tail}."])
    step = Step([Call("run_python", args)], [out], think="Run the snippet with run_python.")
    return Exchange(user, [step], f"It prints `{out}`.", "Report the output.")


COMMIT_MESSAGES = ["Fix {} for empty input", "Document {}", "Speed up {}", "Add type hints to {}", "Simplify {}"]


def git_log(rng: Random, f: FileFacts, corpus: Corpus) -> Exchange | None:
    syms = f.of_kind("function", "class", "method")
    if not syms:
        return None
    p = f.path
    args: dict = {"path": p}
    if rng.random() < 0.6:
        k = rng.choice([1, 2, 3, 5])
        args["max_count"] = k
        user = rng.choice(
            [f"Show the last {k} commits that touched {p}.", f"What are the {k} latest changes to {q(rng, p)}?"]
        )
    else:
        k = 3
        user = rng.choice([f"What changed recently in {p}?", f"Show me the git log of {q(rng, p)}."])
    commits = [
        f"{rng.getrandbits(28):07x} gh-{rng.randint(90000, 119999)}: {rng.choice(COMMIT_MESSAGES).format(rng.choice(syms).name)}"
        for _ in range(k)
    ]
    step = Step([Call("git_log", args)], ["\n".join(commits)], think=f"git_log for {p}.")
    return Exchange(user, [step], f"The latest commit is {commits[0]}.", "Give the latest commit.")


def search_docs(rng: Random, f: FileFacts, corpus: Corpus) -> Exchange | None:
    m = f.module
    s = pick_symbol(rng, f, "function", "class")
    section = rng.choice(DOC_SECTIONS)
    query = f"{m}.{s.name}" if s is not None and rng.random() < 0.6 else m
    args: dict = {"query": query}
    words = {
        "library": "the library reference",
        "reference": "the language reference",
        "howto": "the HOWTOs",
        "tutorial": "the tutorial",
    }
    if rng.random() < 0.6:
        args["section"] = section
        where = words[section]
    else:
        where = "the docs"
    if rng.random() < 0.35:
        args["limit"] = rng.choice([1, 3, 5])
        user = f"Search {where} for {q(rng, query)}, {plural(args['limit'], 'result')} at most."
    else:
        user = rng.choice([f"Look up {q(rng, query)} in {where}.", f"Search {where} for {q(rng, query)}."])
    hits = [f"{query}: {first_sentence(s.doc if s is not None and s.doc and '.' in query else f.doc) or 'no summary'}"]
    step = Step([Call("search_docs", args)], ["\n".join(hits)], think=f"search_docs for {query}.")
    return Exchange(user, [step], f"The docs have an entry for {query}.", "Report the hit.")


# --- parallel reads --------------------------------------------------------------------------


def read_two(rng: Random, f: FileFacts, corpus: Corpus) -> Exchange | None:
    """Two read_file calls in one turn."""
    sib = [g for g in corpus.by_package.get(f.package, []) if g.path != f.path]
    if not sib:
        return None
    g = rng.choice(sib)
    n = rng.choice([5, 10, 20])
    user = rng.choice(
        [
            f"Show me the first {n} lines of {f.path} and of {g.path}.",
            f"Open {f.path} and {g.path}, first {n} lines each.",
        ]
    )
    step = Step(
        [Call("read_file", {"path": x.path, "start_line": 1, "end_line": n}) for x in (f, g)],
        [excerpt(x, 1, n) for x in (f, g)],
        think="Two files: one read_file call for each, lines 1 to n.",
    )
    return Exchange(user, [step], f"Here are the first {n} lines of both files.", "Both are shown.")


# --- without tools ---------------------------------------------------------------------------


def explain(rng: Random, f: FileFacts, corpus: Corpus) -> Exchange | None:
    s = pick_symbol(rng, f, "function", "class")
    if s is not None and s.doc and rng.random() < 0.6:
        user = rng.choice(
            [
                f"Briefly, what does {q(rng, s.name)} in {f.module} do?",
                f"In one sentence, what is {f.module}.{s.name} for?",
                f"Explain {q(rng, s.name)} from {f.module} in a sentence; no need to look anything up.",
            ]
        )
        return Exchange(
            user, answer=f"`{s.name}`: {first_sentence(s.doc)}", answer_think="I know this; answer directly."
        )
    if not f.doc:
        return None
    user = rng.choice(
        [
            f"What is the {f.module} module for?",
            f"In one sentence, what does {f.module} do?",
            f"Explain {q(rng, f.module)} briefly.",
        ]
    )
    return Exchange(user, answer=f"{f.module}: {first_sentence(f.doc)}", answer_think="Answer from what I know.")


def thanks(rng: Random, f: FileFacts, corpus: Corpus) -> Exchange | None:
    user = rng.choice(["Thanks!", "Great, that's all.", "Perfect, thank you.", "OK, thanks."])
    return Exchange(
        user, answer=rng.choice(["You're welcome.", "Glad to help.", "Any time."]), answer_think="Nothing to do."
    )


CALL_INTENTS = {
    "read_range": (read_range, 6),
    "read_head": (read_head, 3),
    "find_symbol": (find_symbol, 6),
    "symbol_source": (symbol_source, 4),
    "grep": (grep, 6),
    "grep_two": (grep_two, 2),
    "find_references": (find_references, 3),
    "list_dir": (list_dir, 3),
    "run_tests": (run_tests, 4),
    "apply_patch": (apply_patch, 4),
    "get_signature": (get_signature, 4),
    "get_docstring": (get_docstring, 3),
    "count_lines": (count_lines, 3),
    "lint": (lint, 3),
    "run_python": (run_python, 2),
    "git_log": (git_log, 2),
    "search_docs": (search_docs, 2),
    "read_two": (read_two, 2),
}
NO_CALL_INTENTS = {"explain": explain, "thanks": thanks}
