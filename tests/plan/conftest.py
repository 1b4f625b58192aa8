"""Fixtures shared by the plan tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "convert"))
from convert_helpers import TINY  # noqa: E402

from clover_gguf.convert.converter import convert  # noqa: E402


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """clover-tiny at Q8_0, converted once."""
    out = tmp_path_factory.mktemp("tiny") / "tiny-q8_0.gguf"
    convert(TINY, out, recipe="q8_0", progress=False)
    return out
