"""The real quality run that several eval tests read."""

import json

import pytest
from eval_helpers import RC, docs

from clover_gguf.eval.quality import run_quality


@pytest.fixture(scope="module")
def quality_run(tmp_path_factory):
    from clover_gguf.convert.converter import convert

    d = tmp_path_factory.mktemp("q")
    for r in ("bf16", "q4_0"):
        convert(RC, d / f"rc-{r}.gguf", recipe=r, progress=False, log=lambda *a, **k: None)
    (d / "p.jsonl").write_text(json.dumps({"id": "a", "ids": [3, 14, 15, 9, 2, 6]}) + "\n")
    kw = dict(
        docs=docs(),
        out_dir=d / "out",
        n_windows=2,
        n_blocks=6,
        ratios=(0.5, 1.0),
        top_k=32,
        prompts=d / "p.jsonl",
        max_new_tokens=8,
        backend="reference",
        log=lambda *a: None,
    )
    run = run_quality(RC, [d / "rc-bf16.gguf", d / "rc-q4_0.gguf"], **kw)
    (d / "first-quality.json").write_text((d / "out" / "quality.json").read_text())
    logs = []
    run2 = run_quality(RC, [d / "rc-bf16.gguf"], **{**kw, "log": logs.append, "generation": False})
    return d, run, run2, logs
