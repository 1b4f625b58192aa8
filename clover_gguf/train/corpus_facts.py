"""Facts about the stdlib corpus files that the chat transcripts talk about (train/transcripts.py):
each file's path, module name, functions, classes, methods and constants with their lines,
signatures and docstrings, read with `ast`, so that every path, name and line number a
generated tool call carries is real.
"""

from __future__ import annotations

import ast
import builtins
import functools
import keyword
import re
from dataclasses import dataclass, field
from pathlib import Path

from . import data

# data-like or generated units: nothing an agent would be asked about
SKIP_UNITS = frozenset({"encodings", "pydoc_data", "__phello__", "this", "turtledemo", "antigravity"})
_CONSTANT = re.compile(r"[A-Z][A-Z0-9_]{2,}")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{3,}")
# keywords and builtins are not what anyone greps a module for, or renames
NOT_GREP_TARGETS = frozenset(keyword.kwlist) | frozenset(keyword.softkwlist) | frozenset(dir(builtins)) | {"self"}


@dataclass(frozen=True)
class Symbol:
    name: str  # "dumps", "JSONDecoder", "JSONDecoder.decode", "MAXREPEAT"
    kind: str  # function, class, method, constant (toolset.SYMBOL_KINDS)
    line: int  # 1-based, the def/class/assignment line
    end: int
    signature: str  # "(obj, *, skipkeys=False)" ("" for constants)
    doc: str  # the docstring ("" if none)

    @property
    def short(self) -> str:
        return self.name.rsplit(".", 1)[-1]


@dataclass
class FileFacts:
    path: str  # relative POSIX path under the stdlib, as in evaldata/heldout-stdlib.json
    module: str  # dotted module name
    unit: str  # top-level module or package (data.unit_of)
    lines: list[str]
    doc: str
    symbols: list[Symbol] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # identifiers used at least twice (grep targets)

    def of_kind(self, *kinds: str) -> list[Symbol]:
        return [s for s in self.symbols if s.kind in kinds]

    @property
    def package(self) -> str:
        """The directory of a package's file ("xml/dom"), or the unit for a top-level module."""
        return self.path.rsplit("/", 1)[0] if "/" in self.path else self.unit


def module_name(relpath: str) -> str:
    p = relpath.removesuffix(".py").replace("/", ".")
    return p.removesuffix(".__init__")


def _signature(node) -> str:
    try:
        return "(" + ast.unparse(node.args) + ")"
    except Exception:  # pragma: no cover - ast.unparse handles every parsed signature
        return "(...)"


def _class_signature(node: ast.ClassDef) -> str:
    init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    return _signature(init).replace("(self, ", "(").replace("(self)", "()") if init else "()"


def _symbols(tree: ast.Module) -> list[Symbol]:
    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node) or ""
            out.append(Symbol(node.name, "function", node.lineno, node.end_lineno, _signature(node), doc))
        elif isinstance(node, ast.ClassDef):
            doc = ast.get_docstring(node) or ""
            out.append(Symbol(node.name, "class", node.lineno, node.end_lineno, _class_signature(node), doc))
            for m in node.body:
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and not m.name.startswith("__"):
                    sig = _signature(m)
                    out.append(
                        Symbol(
                            f"{node.name}.{m.name}", "method", m.lineno, m.end_lineno, sig, ast.get_docstring(m) or ""
                        )
                    )
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if _CONSTANT.fullmatch(name):
                out.append(Symbol(name, "constant", node.lineno, node.end_lineno, "", ""))
    return out


def _grep_names(text: str, symbols: list[Symbol]) -> list[str]:
    counts: dict[str, int] = {}
    for m in _IDENT.finditer(text):
        counts[m.group()] = counts.get(m.group(), 0) + 1
    keep = {s.short for s in symbols} | {n for n, c in counts.items() if 2 <= c <= 40}
    return sorted(n for n in keep if counts.get(n, 0) >= 2 and n not in NOT_GREP_TARGETS)


def file_facts(root: Path, path: Path) -> FileFacts | None:
    """Facts of one corpus file, or None when it has nothing to ask about (no function or class,
    a data-like unit, or text that does not parse)."""
    relpath = data.rel(path, root)
    unit = data.unit_of(relpath)
    if unit in SKIP_UNITS or unit.startswith("config-"):
        return None
    text = Path(path).read_text(encoding="utf-8")
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    symbols = _symbols(tree)
    if not any(s.kind in ("function", "class") for s in symbols):
        return None
    doc = (ast.get_docstring(tree) or "").strip()
    return FileFacts(
        path=relpath,
        module=module_name(relpath),
        unit=unit,
        lines=text.splitlines(),
        doc=doc,
        symbols=symbols,
        names=_grep_names(text, symbols),
    )


@dataclass
class Corpus:
    """The files one split's transcripts may talk about, and the packages they form."""

    files: list[FileFacts]

    def __post_init__(self):
        self.by_package: dict[str, list[FileFacts]] = {}
        for f in self.files:
            self.by_package.setdefault(f.package, []).append(f)
        self.by_unit: dict[str, list[FileFacts]] = {}
        for f in self.files:
            self.by_unit.setdefault(f.unit, []).append(f)
        self.dirs = sorted(p for p in self.by_package if any("/" in f.path for f in self.by_package[p]))

    @property
    def modules(self) -> list[str]:
        return sorted(self.by_unit)


@functools.lru_cache(maxsize=2)
def split_corpus(split: str) -> Corpus:
    """The train or held-out split's files (data.train_files / data.heldout_files)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split: {split!r}, expected train or heldout")
    root = data.stdlib_root()
    files = data.train_files() if split == "train" else data.heldout_files()
    return Corpus([f for f in (file_facts(root, p) for p in files) if f is not None])
