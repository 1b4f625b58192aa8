"""docs/CONTRACTS.md against the code: the Python signatures it lists, and its C API table
against the functions that the patch series declares in clover.h (libclover's header)."""

from __future__ import annotations

import importlib
import inspect
import re

from testdata import REPO

CONTRACTS = REPO / "docs" / "CONTRACTS.md"


class _Named:
    """A default shown by name (print, torch.float32) instead of its repr."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _resolve(dotted: str):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def _plain_signature(obj) -> str:
    """The signature without annotations, callables and dtypes by name."""
    sig = inspect.signature(obj)
    params = []
    for p in sig.parameters.values():
        d = p.default
        if d is not p.empty and (callable(d) or type(d).__module__ == "torch"):
            d = _Named(str(d) if type(d).__module__ == "torch" else d.__name__)
        params.append(p.replace(annotation=p.empty, default=d))
    return str(sig.replace(parameters=params, return_annotation=sig.empty))


def test_python_signatures_match_the_code():
    text = CONTRACTS.read_text()
    block = re.search(r"```signatures\n(.*?)```", text, re.S)
    assert block, "docs/CONTRACTS.md has no ```signatures block"
    lines = [ln for ln in block.group(1).splitlines() if ln.strip()]
    assert len(lines) >= 15
    wrong = []
    for ln in lines:
        name, sig = ln[: ln.index("(")], ln[ln.index("(") :]
        got = _plain_signature(_resolve(name))
        if got != sig:
            wrong.append(f"{name}: docs {sig}, code {got}")
    assert not wrong, "\n".join(wrong)


def _header_functions() -> set[str]:
    """clover_* functions declared (CLOVER_API) in native/clover.h."""
    decl = re.compile(r"CLOVER_API\b[^(]*?\b(clover_\w+)\s*\(")
    return set(decl.findall((REPO / "native" / "clover.h").read_text()))


def test_c_api_table_matches_the_header():
    text = CONTRACTS.read_text()
    section = text[text.index("## C API") :]
    documented = set(re.findall(r"`(clover_\w+)\(", section))
    declared = _header_functions()
    assert len(declared) >= 15
    assert documented == declared, (
        f"in clover.h, not documented: {sorted(declared - documented)}; "
        f"documented, not in clover.h: {sorted(documented - declared)}"
    )
