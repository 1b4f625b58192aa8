"""Fixtures shared by the plan tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "convert"))
from convert_helpers import TINY  # noqa: E402


@pytest.fixture(scope="session")
def tiny_gguf(converted):
    """clover-tiny at Q8_0, converted once per session."""
    return converted(TINY, "q8_0")
