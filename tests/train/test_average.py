"""scripts/average_weights.py (clover_gguf/train/average.py): the mean of model folders' weights,
and the inputs it refuses with one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file
from testdata import REPO, TINY

SCRIPT = REPO / "scripts" / "average_weights.py"


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def folder(path, tensors: dict):
    path.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, path / name)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def one_line_error(r, *words):
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_mean_of_each_tensor_in_the_inputs_dtype(tmp_path):
    bf = torch.bfloat16
    a = folder(tmp_path / "a", {"w": torch.tensor([1.0, 2.0, -4.0], dtype=bf), "b": torch.tensor([0.5])})
    b = folder(tmp_path / "b", {"w": torch.tensor([3.0, 6.0, 0.0], dtype=bf), "b": torch.tensor([1.5])})
    c = folder(tmp_path / "c", {"w": torch.tensor([2.0, 1.0, 1.0], dtype=bf), "b": torch.tensor([1.0])})
    r = run(tmp_path / "out", a, b, c)
    assert r.returncode == 0, r.stderr
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert out["w"].dtype == bf and out["w"].tolist() == [2.0, 3.0, -1.0]
    assert out["b"].dtype == torch.float32 and out["b"].tolist() == [1.0]
    info = json.loads((tmp_path / "out" / "average.json").read_text())
    assert [s["folder"] for s in info["sources"]] == [str(a), str(b), str(c)]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (TINY / name).read_bytes()


def test_a_model_averaged_with_itself_is_the_same_model(tmp_path):
    b = tmp_path / "copy"
    shutil.copytree(TINY, b)
    r = run(tmp_path / "out", TINY, b)
    assert r.returncode == 0, r.stderr
    x, y = load_file(str(TINY / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_refused_inputs_are_one_line(tmp_path):
    t = torch.ones(2)
    a = folder(tmp_path / "a", {"w": t})
    other_name = folder(tmp_path / "n", {"v": t})
    other_shape = folder(tmp_path / "s", {"w": torch.ones(3)})
    other_config = folder(tmp_path / "c", {"w": t})
    cfg = json.loads((other_config / "config.json").read_text())
    (other_config / "config.json").write_text(json.dumps({**cfg, "hidden_size": cfg["hidden_size"] * 2}))
    not_st = folder(tmp_path / "x", {"w": t})
    (not_st / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    empty = tmp_path / "empty"
    shutil.copytree(a, empty)
    (empty / "model.safetensors").unlink()

    one_line_error(run(tmp_path / "o1", a, other_name), "tensor", str(other_name))
    one_line_error(run(tmp_path / "o2", a, other_shape), "tensor w", "shape")
    one_line_error(run(tmp_path / "o3", a, other_config), str(other_config / "config.json"))
    one_line_error(run(tmp_path / "o4", a, not_st), str(not_st / "model.safetensors"))
    one_line_error(run(tmp_path / "o5", a, empty), str(empty / "model.safetensors"))
    one_line_error(run(a, a, other_shape), "is one of the inputs")
    one_line_error(run(tmp_path / "o6", a), "at least two")
    (tmp_path / "file").write_text("")
    one_line_error(run(tmp_path / "file", a, a), str(tmp_path / "file"))
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 7))
    assert load_file(str(a / "model.safetensors"))["w"].tolist() == [1.0, 1.0]
