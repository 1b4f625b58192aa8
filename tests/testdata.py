"""Paths of the checkout's test data (importable from every test module)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "clover-tiny"
# The spec's test vectors, computed by an implementation written apart from this project
# (see tests/data/spec-vectors/README.md).
VECTORS = Path(__file__).resolve().parent / "data" / "spec-vectors"


def editable_tiny(tmp_path: Path) -> Path:
    """clover-tiny's folder under tmp_path: its JSON files copied (to be edited), its weights linked."""
    import shutil

    m = tmp_path / "m"
    m.mkdir()
    for f in TINY.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, m / f.name)
    (m / "model.safetensors").symlink_to(TINY / "model.safetensors")
    return m
