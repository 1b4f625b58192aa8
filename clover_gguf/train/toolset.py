"""The tools of clover-tiny's chat transcripts: fixed JSON-schema signatures (OpenAI function
tools, as a request's `tools` holds them), schema validation of a call, and the rule that
keeps some combinations of tools out of training for the held-out transcripts.

A tool keeps one signature everywhere (as an agent's tools do), so what varies between
transcripts is which tools are offered, not what a tool takes. Between them the signatures
use every argument type the issue asks for: strings, integers, enums, booleans, arrays of
strings and of enums, arrays of objects and a nested object.
"""

from __future__ import annotations

import hashlib

STR = {"type": "string"}
INT = {"type": "integer"}
BOOL = {"type": "boolean"}


def _enum(*values: str) -> dict:
    return {"type": "string", "enum": list(values)}


def _fn(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": False,
            },
        },
    }


SYMBOL_KINDS = ("function", "class", "method", "constant")
LINE_COUNT_KINDS = ("all", "code", "comment", "blank")
LINT_RULES = ("line-length", "trailing-whitespace", "bare-except", "unused-import")
DOC_SECTIONS = ("library", "reference", "howto", "tutorial")

TOOLS: dict[str, dict] = {
    t["function"]["name"]: t
    for t in [
        _fn(
            "read_file",
            "Read a file, or lines start_line..end_line of it.",
            {"path": STR, "start_line": INT, "end_line": INT},
            ["path"],
        ),
        _fn(
            "grep",
            "Search a file for lines matching a pattern.",
            {"pattern": STR, "path": STR, "ignore_case": BOOL, "max_results": INT},
            ["pattern", "path"],
        ),
        _fn(
            "find_symbol",
            "Find where a function, class, method or constant is defined.",
            {"name": STR, "kind": _enum(*SYMBOL_KINDS), "module": STR},
            ["name", "kind"],
        ),
        _fn(
            "list_dir",
            "List the files of a directory.",
            {"path": STR, "recursive": BOOL, "pattern": STR},
            ["path"],
        ),
        _fn(
            "run_tests",
            "Run the tests of a module.",
            {"target": STR, "tests": {"type": "array", "items": STR}, "verbose": BOOL, "timeout": INT},
            ["target"],
        ),
        _fn(
            "apply_patch",
            "Replace text on given lines of a file.",
            {
                "path": STR,
                "edits": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"line": INT, "old": STR, "new": STR},
                        "required": ["line", "old", "new"],
                        "additionalProperties": False,
                    },
                },
            },
            ["path", "edits"],
        ),
        _fn(
            "get_signature",
            "Show the signature of a function or class.",
            {"module": STR, "name": STR},
            ["module", "name"],
        ),
        _fn(
            "get_docstring",
            "Show the docstring of a module, function or class.",
            {"module": STR, "name": STR, "full": BOOL},
            ["module"],
        ),
        _fn(
            "count_lines",
            "Count the lines of a file.",
            {"path": STR, "kind": _enum(*LINE_COUNT_KINDS)},
            ["path"],
        ),
        _fn(
            "lint",
            "Check a file against style rules.",
            {"path": STR, "rules": {"type": "array", "items": _enum(*LINT_RULES)}, "max_line_length": INT},
            ["path", "rules"],
        ),
        _fn(
            "find_references",
            "Find the uses of a name in a package.",
            {
                "symbol": STR,
                "scope": {
                    "type": "object",
                    "properties": {"package": STR, "include_private": BOOL},
                    "required": ["package"],
                    "additionalProperties": False,
                },
            },
            ["symbol", "scope"],
        ),
        _fn(
            "run_python",
            "Run a Python snippet and return its output.",
            {"code": STR, "timeout": INT},
            ["code"],
        ),
        _fn(
            "git_log",
            "Show the recent commits that touched a file.",
            {"path": STR, "max_count": INT},
            ["path"],
        ),
        _fn(
            "search_docs",
            "Search the Python documentation.",
            {"query": STR, "section": _enum(*DOC_SECTIONS), "limit": INT},
            ["query"],
        ),
    ]
}

TOOL_NAMES = tuple(TOOLS)
MAX_OFFERED = 8

# Held-out combinations: of every set of two or more tools, those whose hash falls in
# 1/HELDOUT_COMBO_MOD of the space are offered only by held-out transcripts.
HELDOUT_COMBO_SALT = "clover-tools-v1"
HELDOUT_COMBO_MOD = 8


def heldout_combination(names) -> bool:
    """True if this set of tools is reserved for held-out transcripts (sets of 2 or more)."""
    names = sorted(set(names))
    if len(names) < 2:
        return False
    h = hashlib.sha256(f"{HELDOUT_COMBO_SALT}:{','.join(names)}".encode()).digest()
    return h[0] % HELDOUT_COMBO_MOD == 0


def tool_schemas(names) -> list[dict]:
    """The request `tools` for these names, in this order."""
    return [TOOLS[n] for n in names]


def schema_errors(name: str, arguments, offered=None) -> list[str]:
    """Why a call does not fit its tool (empty: it fits): the name is not an offered tool, or
    the arguments do not validate against the tool's JSON schema (jsonschema, Draft 2020-12)."""
    import jsonschema

    tools = {t["function"]["name"]: t for t in offered} if offered is not None else TOOLS
    if name not in tools:
        return [f"no tool named {name!r}"]
    schema = tools[name]["function"].get("parameters") or {"type": "object"}
    v = jsonschema.Draft202012Validator(schema)
    return [e.message for e in v.iter_errors(arguments)]
