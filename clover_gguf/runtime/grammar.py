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
        _check_optional_properties(json.loads(text) if isinstance(schema, str) else schema)
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
    return out


def _check_optional_properties(schema) -> None:
    stack = [schema]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
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
