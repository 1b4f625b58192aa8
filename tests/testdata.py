"""Paths of the checkout's test data (importable from every test module)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "clover-tiny"
# The spec's test vectors, computed by an implementation written apart from this project
# (see tests/data/spec-vectors/README.md).
VECTORS = Path(__file__).resolve().parent / "data" / "spec-vectors"
