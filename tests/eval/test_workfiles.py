"""A converted file in an eval work folder is reused only for the same weights and options."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from clover_gguf.eval.workfiles import converted

TINY = Path(__file__).resolve().parents[2] / "models" / "clover-tiny"


def test_reused_only_for_the_same_weights_and_options(tmp_path):
    ref = tmp_path / "ref"
    shutil.copytree(TINY, ref)
    out = tmp_path / "w" / "m.gguf"
    out.parent.mkdir()
    logged = []

    def convert(**kw):
        logged.clear()
        converted(ref, out, log=logged.append, **kw)
        return bool(logged)

    assert convert(recipe="q8_0") and out.exists()
    first = out.read_bytes()
    assert not convert(recipe="q8_0")  # same weights, same options: reused
    assert convert(recipe="q4_k") and out.read_bytes() != first  # other options

    # retrained weights (same size): a stale quantization must not be scored
    st = ref / "model.safetensors"
    os.utime(st, ns=(st.stat().st_atime_ns, st.stat().st_mtime_ns + 10**9))
    assert convert(recipe="q4_k")

    # another tokenizer goes into the GGUF's vocabulary too
    tj = ref / "tokenizer.json"
    os.utime(tj, ns=(tj.stat().st_atime_ns, tj.stat().st_mtime_ns + 10**9))
    assert convert(recipe="q4_k")

    # a file left by an older version, without a stamp, is converted again
    out.with_name(out.name + ".source.json").unlink()
    assert convert(recipe="q4_k")
    assert not convert(recipe="q4_k")
