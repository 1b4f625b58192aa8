"""generation/loader.py without the runtime (the fast lane): the reference's side of the one
interface. Its agreement with the GGUF side: tests/runtime/test_runtime.py::test_loader_backends_agree."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from testdata import TINY, VECTORS

from clover_gguf.generation.loader import TorchGenerator, load
from clover_gguf.reference.generate import NonFiniteError, TorchBackend, generate


@pytest.fixture(scope="module")
def tiny():
    return load(TINY)


def test_a_folder_opens_as_the_reference(tiny):
    c = tiny.model.config
    assert isinstance(tiny, TorchGenerator) and tiny.backend == "pytorch-float32" and tiny.path == TINY
    assert (tiny.n_vocab, tiny.block_size) == (c.vocab_size, c.block_size)
    assert (tiny.mask_token_id, tiny.eos_token_id) == (c.mask_token_id, c.eos_token_id)
    assert tiny.placement is None and tiny.model.model.embed_tokens.weight.dtype == torch.float32


def test_config_fills_in_the_models_facts(tiny):
    cfg = tiny.config(max_new_tokens=5, steps=2)
    assert (cfg.block_size, cfg.mask_token_id, cfg.eos_token_id) == (16, tiny.mask_token_id, tiny.eos_token_id)
    assert (cfg.max_new_tokens, cfg.steps, cfg.threshold) == (5, 2, None)
    assert tiny.config(block_size=None).block_size == tiny.block_size and tiny.config(block_size=8).block_size == 8


def test_generate_is_the_reference_loop(tiny):
    ids = tiny.tokenize("def f(x):\n")
    cfg = tiny.config(max_new_tokens=16, steps=4)
    want = generate(TorchBackend(tiny.model), ids, cfg).tokens
    assert tiny.generate(ids, cfg).tokens == want
    assert tiny.detokenize(want) == tiny.tokenizer.decode(want)


def test_tokenize_adds_bos_eos_as_the_tokenizer_config_says(tmp_path):
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / f, tmp_path / f)
    tc = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**tc, "add_bos_token": True, "add_eos_token": True}))
    g = load(tmp_path)
    plain = g.tokenize("import os")
    bos, eos = g.tokenizer.bos_id, g.tokenizer.eos_id
    assert plain == g.tokenizer.encode("import os") and g.tokenize("import os", add_special=True) == [bos, *plain, eos]


def test_a_folder_without_tokenizer_names_it():
    g = load(VECTORS / "random-clover")
    assert g.tokenizer is None
    with pytest.raises(ValueError, match=r"random-clover: no tokenizer.json; pass token ids"):
        g.tokenize("x")


def test_nonfinite_names_the_folder(tiny, monkeypatch):
    monkeypatch.setattr(tiny.model, "block_logits", lambda *a: torch.full((1, 16, tiny.n_vocab), float("nan")))
    with pytest.raises(NonFiniteError, match=r"^.*clover-tiny: non-finite logits"):
        tiny.generate([1, 2], tiny.config(max_new_tokens=4))
