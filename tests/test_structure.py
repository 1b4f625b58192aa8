"""The shape of the package: clover_gguf/'s import graph has no cycles, and no module imports a
private (``_name``) name of another package.

Every import counts, a function's deferred import too: a cycle through a deferred import is
still a circle a reader has to hold in their head. A module's edge to its own parent packages
(``from . import ConvertError`` inside convert/) is not an edge of the graph."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "clover_gguf"


def modules(root: Path = PKG) -> dict[str, tuple[Path, bool]]:
    """dotted name -> (file, is a package)."""
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    return out


def imports(mods: dict[str, tuple[Path, bool]]) -> list[tuple[str, str, str | None, int]]:
    """(importer, imported module, imported name or None, line) for every import of a module of
    the package, relative ones resolved; ``from pkg import mod`` is an import of pkg.mod."""
    top = next(iter(mods)).split(".")[0]
    out = []
    for name, (path, is_pkg) in mods.items():
        here = name if is_pkg else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out += [(name, a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == top]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                if mod.split(".")[0] != top:
                    continue
                for a in node.names:
                    sub = f"{mod}.{a.name}"
                    out.append((name, sub, None, node.lineno) if sub in mods else (name, mod, a.name, node.lineno))
    return out


def graph(mods, imps) -> dict[str, set[str]]:
    g: dict[str, set[str]] = {m: set() for m in mods}
    for src, dst, _, _ in imps:
        if dst in mods and dst != src and not src.startswith(dst + "."):
            g[src].add(dst)
    return g


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def package_of(name: str, mods) -> str:
    return name if mods[name][1] else name.rpartition(".")[0]


@pytest.fixture(scope="module")
def parsed():
    mods = modules()
    return mods, imports(mods)


def test_the_walk_sees_the_package(parsed):
    mods, imps = parsed
    g = graph(mods, imps)
    assert len(mods) > 80
    assert "clover_gguf.convert.converter" in g["clover_gguf.plan.commands"]  # a deferred import inside a command
    assert "clover_gguf.convert.pipeline" in g["clover_gguf.convert.converter"]  # a relative one
    assert "clover_gguf.convert" not in g["clover_gguf.convert.converter"]  # its own package: no edge


def test_the_cycle_finder_finds_cycles():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(g) == [["a", "b", "c"]]


def test_no_import_cycles(parsed):
    mods, imps = parsed
    found = cycles(graph(mods, imps))
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_private_name_from_another_package(parsed):
    mods, imps = parsed
    bad = [
        f"{src} (line {line}) imports {name} from {dst}"
        for src, dst, name, line in imps
        if name
        and name.startswith("_")
        and not name.startswith("__")
        and dst in mods
        and package_of(dst, mods) != package_of(src, mods)
    ]
    assert not bad, "\n".join(bad)


def test_plan_sits_above_convert(parsed):
    """The planner reads the converter's plan; the converter never asks the planner."""
    mods, imps = parsed
    bad = [
        f"{s} imports {d}"
        for s, d, _, _ in imps
        if s.startswith("clover_gguf.convert") and d.startswith("clover_gguf.plan")
    ]
    assert not bad, bad


# Exception classes that are not errors a user acts on: a signal unwinding a conversion like
# Ctrl-C (convert/writer.py), a client gone unwinding its prefill (serve/engine.py), and the
# server's HTTP 400 answer (and its kinds), raised and caught inside it.
NOT_CLOVER_ERRORS = {"Terminated", "_Cancelled", "BadRequest"}


def exception_classes(root: Path = PKG) -> dict[str, list[str]]:
    """class name -> its bases' names, for every class defined under root (at any depth) that
    derives, directly or through other classes there, from a built-in exception."""
    bases: dict[str, list[str]] = {}
    for p in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = [ast.unparse(b).rpartition(".")[2] for b in node.bases]

    def is_exception(name: str, seen: frozenset = frozenset()) -> bool:
        b = getattr(builtins, name, None)
        if isinstance(b, type) and issubclass(b, BaseException):
            return True
        return name not in seen and any(is_exception(x, seen | {name}) for x in bases.get(name, ()))

    return {n: bs for n, bs in bases.items() if is_exception(n)}


def not_clover_errors(classes: dict[str, list[str]]) -> list[str]:
    def derives(name: str, seen: frozenset = frozenset()) -> bool:
        return (
            name == "CloverError"
            or name in NOT_CLOVER_ERRORS
            or (name not in seen and any(derives(b, seen | {name}) for b in classes.get(name, ())))
        )

    return sorted(n for n in classes if n not in NOT_CLOVER_ERRORS and not derives(n))


def test_the_error_walk_finds_a_stray_error(tmp_path):
    (tmp_path / "errors.py").write_text("class CloverError(Exception):\n    pass\n")
    (tmp_path / "a.py").write_text(
        "class AError(CloverError, ValueError):\n    pass\n"
        "class BError(AError):\n    pass\n"
        "class Stray(RuntimeError):\n    pass\n"
        "class Indirect(Stray):\n    pass\n"
        "class NotAnError:\n    pass\n"
    )
    classes = exception_classes(tmp_path)
    assert set(classes) == {"CloverError", "AError", "BError", "Stray", "Indirect"}
    assert not_clover_errors(classes) == ["Indirect", "Stray"]


def test_every_error_is_a_clover_error():
    """One base the CLI turns into one line; each class keeps its built-in base too, so that an
    `except ValueError` written before CloverError still catches it."""
    from clover_gguf.config import ConfigError
    from clover_gguf.convert.pipeline import TensorError
    from clover_gguf.errors import CloverError

    classes = exception_classes()
    assert {"ConfigError", "TensorError", "RuntimeNotBuilt", "FieldProblem"} <= set(classes)
    assert not not_clover_errors(classes), f"not CloverErrors: {not_clover_errors(classes)}"
    assert issubclass(ConfigError, CloverError) and issubclass(ConfigError, ValueError)
    assert issubclass(TensorError, CloverError) and issubclass(TensorError, RuntimeError)


# No function over about 80 lines (def line to last line, decorators excluded; a nested
# function counts in its parent too). The exceptions are tables, named here with why:
MAX_FUNCTION_LINES = 80
LONG_TABLES = {
    # the server's route table: each route a short nested function registered on the app
    "clover_gguf/serve/app.py::create_app",
}


def functions(node: ast.AST, prefix: str = ""):
    """(qualified name, lines) of every function under node, nested ones and methods too."""
    for n in ast.iter_child_nodes(node):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}{n.name}", n.end_lineno - n.lineno + 1
            yield from functions(n, f"{prefix}{n.name}.")
        elif isinstance(n, ast.ClassDef):
            yield from functions(n, f"{prefix}{n.name}.")


def long_functions(root: Path = PKG, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """'path::Class.function' -> its lines, for every function under root longer than limit."""
    out = {}
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root.parent).as_posix()
        for name, n in functions(ast.parse(p.read_text(), str(p))):
            if n > limit:
                out[f"{rel}::{name}"] = n
    return out


def test_the_length_walk_finds_long_functions(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(5))
    (pkg / "a.py").write_text(
        f"def short():\n    pass\n\n@decorator\ndef long():\n{body}\n"
        f"class C:\n    def method(self):\n{body.replace('    ', '        ')}\n"
        f"    async def outer(self):\n        def inner():\n{body.replace('    ', '            ')}"
    )
    assert long_functions(pkg, limit=5) == {
        "pkg/a.py::long": 6,
        "pkg/a.py::C.method": 6,
        "pkg/a.py::C.outer": 7,
        "pkg/a.py::C.outer.inner": 6,
    }


def test_no_long_functions():
    found = long_functions()
    long = {k: n for k, n in found.items() if k not in LONG_TABLES}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them): " + ", ".join(
        f"{k} ({n})" for k, n in sorted(long.items(), key=lambda x: -x[1])
    )
    stale = sorted(LONG_TABLES - set(found))
    assert not stale, f"LONG_TABLES names functions that are gone or short now (remove them): {stale}"
