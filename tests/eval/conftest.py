"""The real quality run that several eval tests read."""

import json

import pytest
from eval_helpers import RC, docs

from clover_gguf.eval.quality.run import Generation, Sampling, run_quality


@pytest.fixture(scope="module")
def quality_run(tmp_path_factory, converted):
    d = tmp_path_factory.mktemp("q")
    (d / "p.jsonl").write_text(json.dumps({"id": "a", "ids": [3, 14, 15, 9, 2, 6]}) + "\n")
    sampling = Sampling(docs=docs(), n_windows=2, n_blocks=6, ratios=(0.5, 1.0), top_k=32)
    gen = Generation(prompts=d / "p.jsonl", max_new_tokens=8)
    ggufs = [converted(RC, "bf16"), converted(RC, "q4_0")]
    run = run_quality(RC, ggufs, sampling, gen, "reference", d / "out").to_dict()
    (d / "first-quality.json").write_text((d / "out" / "quality.json").read_text())
    logs = []
    run2 = run_quality(RC, ggufs[:1], sampling, Generation(enabled=False), "reference", d / "out", log=logs.append)
    return d, run, run2.to_dict(), logs
