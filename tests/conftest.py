import json

import pytest
from testdata import VECTORS


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
