import json
from pathlib import Path

import pytest

# The spec's test vectors, computed by an implementation written apart from this project
# (see tests/data/spec-vectors/README.md).
VECTORS = Path(__file__).resolve().parent / "data" / "spec-vectors"
REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "clover-tiny"


@pytest.fixture(scope="session")
def vectors():
    assert (VECTORS / "vectors.json").exists(), f"spec test vectors not found at {VECTORS}"
    return json.loads((VECTORS / "vectors.json").read_text())["cases"]


@pytest.fixture(scope="session")
def vec_dir():
    return VECTORS / "random-clover"


@pytest.fixture(scope="session")
def vec_fused_dir():
    return VECTORS / "random-clover-fused"


def pytest_configure(config):
    # The test models are tiny: one thread is fastest and immune to oversubscription.
    import torch
    torch.set_num_threads(1)
