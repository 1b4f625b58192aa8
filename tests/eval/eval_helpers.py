"""Shared by the eval tests: the vectors model and a small synthetic corpus."""

import numpy as np
from testdata import VECTORS

from clover_gguf.eval.quality import corpus as C

RC = VECTORS / "random-clover"


def docs(n=3, seed=0, V=90):
    rng = np.random.default_rng(seed)
    return [C.Document(f"d{i}", rng.integers(0, V, size=120 + 40 * i)) for i in range(n)]
