"""Grammars for constrained generation (GenerationConfig.grammar): llama.cpp's GBNF, its
JSON-schema converter (common's json_schema_to_grammar, through libclover-grammar's C entry
point) and the tool-call grammar of Clover's chat template (spec section 5).

A grammar from here is text; CloverRuntime turns it into llama.cpp's grammar sampler, which
decides at each position which tokens may follow (docs/CONTRACTS.md: constrained decoding).
"""

from __future__ import annotations

import ctypes
import json
import re

from ..errors import CloverError
from . import bindings as B

# what a request may make the server build: larger schemas and grammars are refused
MAX_SCHEMA_BYTES = 256 * 1024
MAX_GRAMMAR_BYTES = 1024 * 1024
# optional properties of one object: llama.cpp's converter takes time that grows with about
# their cube (256: 0.05 s, 800: 2 s, 3000: minutes, found by tests/fuzz/fuzz_server.py)
MAX_OPTIONAL_PROPERTIES = 256

# response_format json_object: any JSON object (OpenAI's JSON mode)
JSON_OBJECT_SCHEMA = {"type": "object"}


class SchemaError(CloverError, ValueError):
    """A JSON schema the converter refuses; the message says why (one line)."""


_CONVERT = None


def _converter():
    global _CONVERT
    if _CONVERT is None:
        lib = B.load()
        path = lib.lib_path.parent / "libclover-grammar.so"
        try:
            so = ctypes.CDLL(str(path))
        except OSError as e:
            raise B.RuntimeNotBuilt(f"{path}: {e}; {B.HINT}") from None
        fn = so.clover_json_schema_to_grammar
        fn.argtypes, fn.restype = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t], ctypes.c_int32
        _CONVERT = fn
    return _CONVERT


def json_schema_to_grammar(schema: dict | bool | str) -> str:
    """GBNF (root rule `root`) for a JSON schema, by llama.cpp's own converter."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    raw = text.encode("utf-8")
    if len(raw) > MAX_SCHEMA_BYTES:
        raise SchemaError(f"the schema has {len(raw)} bytes, more than {MAX_SCHEMA_BYTES}")
    try:
        obj = json.loads(text) if isinstance(schema, str) else schema
        if obj is False or (isinstance(obj, dict) and obj.get("not") in ({}, True)):
            raise SchemaError("no value fits the schema (it is false, or `not` of everything)")
        _check_optional_properties(obj)
    except ValueError as e:  # JSONDecodeError: the converter says what is wrong
        if isinstance(e, SchemaError):
            raise
    fn = _converter()
    size = 1 << 16
    while True:
        buf = ctypes.create_string_buffer(size)
        n = fn(raw, buf, size)
        if abs(n) < size:
            break
        if abs(n) > MAX_GRAMMAR_BYTES:
            raise SchemaError(f"the schema gives a grammar of {abs(n)} bytes, more than {MAX_GRAMMAR_BYTES}")
        size = abs(n) + 1
    out = buf.value.decode("utf-8", "replace")
    if n < 0:
        why = " ".join(out.split())  # the converter's message spans lines
        raise SchemaError(why[:300])
    return _relax_repeats(out)


def _relax_repeats(grammar: str) -> str:
    """x{m,n} with n past GRAMMAR_LIMITS["repeat"] as x{m,}: llama.cpp's parser refuses more than
    2,000 repetitions and expands each into a rule, and agents' schemas ask for more (Claude Code:
    a string of maxLength 524288, an integer maximum of 2^53); a reply is capped far below
    (--n-predict), so the bound constrains nothing a reply can reach. A minimum past it is
    refused."""
    cap = GRAMMAR_LIMITS["repeat"]

    def sub(m: re.Match) -> str:
        lo, comma, hi = m.group(1), m.group(2), m.group(3)
        if int(lo or 0) > cap:
            raise SchemaError(f"the schema asks for at least {lo} repetitions of an item, more than {cap}")
        if comma and hi and int(hi) > cap:
            return "{" + (lo or "0") + ",}"
        return m.group(0)

    out, pos = [], 0
    while pos < len(grammar):  # token by token: braces inside strings and classes are text
        r = _REPEAT.match(grammar, pos) if grammar[pos] == "{" else None
        if r:
            out.append(sub(r))
            pos = r.end()
            continue
        m = _GBNF_TOKEN.match(grammar, pos)
        out.append(m.group(0))
        pos = m.end()
    return "".join(out)


_BOUNDS = (("minItems", "maxItems"), ("minLength", "maxLength"), ("minProperties", "maxProperties"),
           ("minimum", "maximum"), ("minContains", "maxContains"))  # fmt: skip


def _check_optional_properties(schema) -> None:
    """Refuse what no value fits (a minimum past its maximum) and objects with more optional
    properties than the converter handles in reasonable time."""
    stack = [schema]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            for lo_k, hi_k in _BOUNDS:
                lo, hi = v.get(lo_k), v.get(hi_k)
                num = lambda x: isinstance(x, int | float) and not isinstance(x, bool)
                if num(lo) and num(hi) and lo > hi:
                    raise SchemaError(f"'{lo_k}' {lo} is more than '{hi_k}' {hi}: no value fits the schema")
            props, req = v.get("properties"), v.get("required")
            if isinstance(props, dict):
                required = {r for r in req if isinstance(r, str)} if isinstance(req, list) else set()
                n = len(set(props) - required)
                if n > MAX_OPTIONAL_PROPERTIES:
                    raise SchemaError(
                        f"an object of the schema has {n} optional properties, more than {MAX_OPTIONAL_PROPERTIES}"
                    )
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


# GBNF tokens: strings, character classes and token references (which may hold anything),
# comments, identifiers
_GBNF_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|!?<[^<>\s]+>|#[^\n]*|[A-Za-z0-9_-]+|.', re.S)
_IDENT = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")


def prefix_rules(grammar: str, prefix: str, only: str | None = None) -> str:
    """The grammar with every rule name (or only the rule `only`) prefixed, outside strings,
    classes and comments, so that several grammars combine into one without name clashes."""
    out = []
    for m in _GBNF_TOKEN.finditer(grammar):
        t = m.group(0)
        out.append(prefix + t if _IDENT.fullmatch(t) and (only is None or t == only) else t)
    return "".join(out)


class GrammarBudget(CloverError, ValueError):
    """A grammar past what the server builds (GRAMMAR_LIMITS); the message says which limit."""


# What a grammar may ask llama.cpp to build, checked on its text before anything is built:
# llama.cpp's parser recurses per nesting level and per rule reference (100,000 of either crashed
# the server), expands x{m,n} into about n copies of x (x{0,2000000000} never ends; a schema
# with 3,000 strings of maxLength 1999 took 1.65 GB), and its stacks grow with the alternatives a
# position allows (20,000 alternatives under a `*`: 59 s a step). The JSON schemas of every tool
# the coding agents send (Claude Code's 26) stay well inside (docs/CONTRACTS.md).
GRAMMAR_LIMITS = {
    "depth": 64,  # nesting of parentheses
    "rules": 4096,
    "chain": 256,  # the longest chain of rule references without recursion
    "alternatives": 1024,  # in one rule or group
    "repeat": 1024,  # the n of x{m,n}
    "elements": 262_144,  # elements after llama.cpp expands repetitions
}
_REPEAT = re.compile(r"\{\s*(\d*)\s*(,?)\s*(\d*)\s*\}")


_RULE_START = re.compile(r"([A-Za-z][A-Za-z0-9_-]*)[ \t]*::=")


def check_gbnf(grammar: str) -> None:
    """GrammarBudget if the GBNF text is past GRAMMAR_LIMITS (or MAX_GRAMMAR_BYTES) or asks for
    x{m,n} with m > n; a grammar that does not parse is left to llama.cpp's parser (which says
    why). One pass over the text, stopping at the first limit."""
    lim = GRAMMAR_LIMITS
    if len(grammar) > MAX_GRAMMAR_BYTES:
        raise GrammarBudget(f"the grammar has {len(grammar)} characters, more than {MAX_GRAMMAR_BYTES}")
    rules: dict[str, set[str]] = {}
    total = 0
    cur: str | None = None
    # per open group: [alternatives, size of the current alternative, size of the last element]
    stack: list[list[int]] = []

    def close_rule():
        nonlocal total
        if cur is not None and stack:
            total += stack[0][1] + stack[0][0]
        if total > lim["elements"]:
            raise GrammarBudget(
                f"the grammar expands to more than {lim['elements']} elements (its repetitions x{{m,n}} copy x n times)"
            )

    pos, n = 0, len(grammar)
    while pos < n:
        m = _GBNF_TOKEN.match(grammar, pos)
        t, pos = m.group(0), m.end()
        if t.isspace() or t.startswith("#"):
            continue
        if _IDENT.fullmatch(t) and (d := _RULE_START.match(grammar, m.start())):
            if len(stack) > 1:
                raise GrammarBudget(f"rule {t!r} starts inside an open parenthesis")
            close_rule()
            cur = t
            rules.setdefault(t, set())
            if len(rules) > lim["rules"]:
                raise GrammarBudget(f"the grammar has more than {lim['rules']} rules")
            stack = [[1, 0, 0]]
            pos = d.end()
            continue
        if cur is None:
            continue
        top = stack[-1]
        if t == "(":
            stack.append([1, 0, 0])
            if len(stack) - 1 > lim["depth"]:
                raise GrammarBudget(f"the grammar nests parentheses deeper than {lim['depth']} levels")
        elif t == ")":
            if len(stack) == 1:
                continue  # llama.cpp's parser says what is wrong
            alts, size, _ = stack.pop()
            inner = size + alts
            stack[-1][1] += inner
            stack[-1][2] = inner
        elif t == "|":
            top[0] += 1
            if top[0] > lim["alternatives"]:
                raise GrammarBudget(f"a rule or group of the grammar has more than {lim['alternatives']} alternatives")
        elif t == "{":
            r = _REPEAT.match(grammar, m.start())
            if r:
                lo = int(r.group(1) or 0)
                hi = int(r.group(3)) if r.group(3) else (lo if not r.group(2) else None)
                if hi is not None and lo > hi:
                    raise GrammarBudget(f"x{r.group(0)} asks for at least {lo} and at most {hi} repetitions")
                k = max(lo, hi or 0)
                if k > lim["repeat"]:
                    raise GrammarBudget(f"x{r.group(0)} repeats more than {lim['repeat']} times")
                top[1] += top[2] * max(k - 1, 0)
                pos = r.end()
        elif t not in "*+?":  # a string, class, token, or rule reference
            top[1] += 1
            top[2] = 1
            if _IDENT.fullmatch(t):
                rules[cur].add(t)
    close_rule()
    _check_chain(rules, lim["chain"])


def _check_chain(rules: dict[str, set[str]], limit: int) -> None:
    """The longest chain of references from `root` through distinct rules (iterative DFS)."""
    depth: dict[str, int] = {}
    for start in rules:
        if start in depth:
            continue
        stack = [(start, iter(sorted(rules.get(start, ()))))]
        on = {start}
        while stack:
            name, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                on.discard(name)
                depth[name] = 1 + max((depth.get(r, 0) for r in rules.get(name, ()) if r not in on), default=0)
                if depth[name] > limit:
                    raise GrammarBudget(f"the grammar's rule references chain more than {limit} rules deep")
                continue
            if nxt in rules and nxt not in on and nxt not in depth:
                on.add(nxt)
                stack.append((nxt, iter(sorted(rules[nxt]))))
                if len(stack) > limit:
                    raise GrammarBudget(f"the grammar's rule references chain more than {limit} rules deep")


def literal(text: str) -> str:
    """A GBNF string literal matching `text` exactly."""
    return json.dumps(text, ensure_ascii=False)


def tool_call_grammar(tools: list[dict], parallel: bool = True) -> str:
    """The assistant's output as one or more tool calls in the template's form,
    `<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>` (joined by a newline when
    `parallel`), each ARGS matching its tool's `parameters` schema; `tools` are OpenAI tool
    objects. Then the end of the turn."""
    rules, alts = [], []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        rules.append(prefix_rules(json_schema_to_grammar(params), f"t{i}-"))
        head = '{"name": ' + json.dumps(fn["name"], ensure_ascii=False) + ', "arguments": '
        alts.append(f"{literal(head)} t{i}-root")
    call = f'call ::= "<tool_call>\\n" ( {" | ".join(alts)} ) "}}\\n</tool_call>"'
    root = 'root ::= call ( "\\n" call )*' if parallel else "root ::= call"
    return "\n".join([root, call, *rules]) + "\n"
