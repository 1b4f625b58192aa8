"""llama.cpp's own converter knows Clover (patches/0008: gguf-py constants and
conversion/clover.py): `convert_hf_to_gguf.py` on clover-tiny and on a fused-expert checkpoint
writes the same tensors and `clover.*` / `tokenizer.*` keys as `clover-gguf convert`, llama-quantize
makes the same Q4_K_M file of either, and llama-clover-cli generates the same tokens from both."""

import os
import subprocess
import sys

import pytest
from gguf import GGUFReader
from test_llama_quantize import llama_quantize
from testdata import TINY

from clover_gguf.convert.converter import convert


def _upstream(src, out):
    from clover_gguf.runtime.build import runtime_paths

    script = runtime_paths()["src_dir"] / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
    if not script.is_file():
        pytest.fail(f"{script} not found: run `clover-gguf runtime build`", pytrace=False)
    r = subprocess.run(
        [sys.executable, str(script), str(src), "--outtype", "bf16", "--outfile", str(out)],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"},  # its own gguf-py, which knows clover
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _content(path):
    r = GGUFReader(path)
    kv = {
        k: (tuple(f.types), f.contents())
        for k, f in r.fields.items()
        if k.startswith(("clover.", "tokenizer.")) or k in ("general.architecture", "general.file_type")
    }
    return kv, {t.name: (t.tensor_type.name, tuple(t.shape), t.data.tobytes()) for t in r.tensors}


def _fused(tmp_path):
    """clover-tiny with its experts fused (mlp.experts.gate_up_proj / down_proj, as newer
    transformers save them)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out = tmp_path / "fused"
    out.mkdir()
    for f in TINY.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy2(f, out / f.name)
    sd = load_file(str(TINY / "model.safetensors"))
    n_layer, n_exp = 4, 8
    for b in range(n_layer):

        def per(x, p, b=b):
            return sd.pop(f"model.layers.{b}.mlp.experts.{x}.{p}_proj.weight")

        gate_up = [torch.cat([per(x, "gate"), per(x, "up")], 0) for x in range(n_exp)]
        sd[f"model.layers.{b}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        sd[f"model.layers.{b}.mlp.experts.down_proj"] = torch.stack([per(x, "down") for x in range(n_exp)])
    save_file(sd, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("which", ["per-expert", "fused"])
def test_upstream_converter_writes_our_file(tmp_path, which):
    src = TINY if which == "per-expert" else _fused(tmp_path)
    ours = tmp_path / "ours.gguf"
    convert(src, ours, recipe="bf16", progress=False)
    up = _upstream(src, tmp_path / "upstream.gguf")
    (kv_a, t_a), (kv_b, t_b) = _content(ours), _content(up)
    assert kv_a == kv_b
    assert t_a.keys() == t_b.keys()
    assert [n for n in t_a if t_a[n] != t_b[n]] == []
    q = llama_quantize()
    for f in (ours, up):
        subprocess.run([str(q), str(f), str(f.with_suffix(".q4km.gguf")), "Q4_K_M"], check=True, capture_output=True)
    qa, qb = _content(ours.with_suffix(".q4km.gguf"))[1], _content(up.with_suffix(".q4km.gguf"))[1]
    assert qa.keys() == qb.keys() and [n for n in qa if qa[n] != qb[n]] == []
    cli = llama_quantize().parent / "llama-clover-cli"
    ids = [
        subprocess.run(
            [str(cli), "-m", str(f), "-p", "def fibonacci(n):", "-n", "32", "-t", "1", "--verbose-prompt"],
            check=True, capture_output=True, text=True,
        ).stdout.splitlines()[-1]
        for f in (ours.with_suffix(".q4km.gguf"), up.with_suffix(".q4km.gguf"))
    ]  # fmt: skip
    assert ids[0].startswith("ids: ") and ids[0] == ids[1]
