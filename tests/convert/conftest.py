"""Fixtures shared by the converter tests."""

import pytest

from clover_gguf.convert import ggml_lib


@pytest.fixture
def no_ggml(monkeypatch):
    """Pretend libggml is absent."""
    monkeypatch.setattr(ggml_lib, "_lib", None)
    monkeypatch.setattr(ggml_lib, "candidate_paths", lambda: [])
    yield
