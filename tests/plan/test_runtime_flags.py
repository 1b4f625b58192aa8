"""The runtime options the plan's split rows print (--no-op-offload, --no-mmap) reach llama.cpp,
and the VRAM account's compute buffer and state match what llama.cpp itself reserves."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from clover_gguf.cli import cli
from clover_gguf.gguf_io.reader import config_from_reader, open_gguf
from clover_gguf.plan import vram as V
from clover_gguf.runtime import bindings as B
from clover_gguf.runtime.runtime import CloverRuntime

BLOCK = [5, 6, 7, 1, 1, 1, 9, 1, 1, 1, 1, 1, 1, 1, 1, 1]


def test_params_carry_the_flags():
    lib = B.load()
    assert B.context_params(lib, 256, 256, 256, 1).op_offload is True
    assert B.context_params(lib, 256, 256, 256, 1, op_offload=False).op_offload is False
    assert B.model_params(lib).load_mode == lib.lc.llama_model_default_params().load_mode != B.LLAMA_LOAD_MODE_NONE
    assert B.model_params(lib, mmap=False).load_mode == B.LLAMA_LOAD_MODE_NONE


def test_runtime_with_the_flags_gives_the_same_logits(tiny_gguf):
    """On a CPU build neither changes the arithmetic: the same logits, bit for bit."""
    with CloverRuntime(tiny_gguf, n_threads=1) as rt:
        want = rt.block_logits_np(BLOCK)
    with CloverRuntime(tiny_gguf, n_threads=1, op_offload=False, mmap=False, cpu_tensors=["ffn_.*_exps"]) as rt:
        assert (rt.block_logits_np(BLOCK) == want).all()


def test_run_cli_flags(tiny_gguf):
    args = ["run", str(tiny_gguf), "--prompt-ids", "5,6,7", "-n", "8", "-t", "1", "--json"]
    base = CliRunner().invoke(cli, args)
    assert base.exit_code == 0, base.output
    r = CliRunner().invoke(cli, [*args, "--no-op-offload", "--no-mmap", "-ngl", "99", "--experts-on-cpu"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["token_ids"] == json.loads(base.stdout)["token_ids"]


def test_serve_takes_the_flags(tiny_gguf):
    """serve parses them (and still refuses --fit next to its own placement, in one line)."""
    r = CliRunner().invoke(
        cli, ["serve", str(tiny_gguf), "-ngl", "99", "--no-op-offload", "--no-mmap", "--fit", "--experts-on-cpu"]
    )
    assert r.exit_code != 0 and len(r.output.strip().splitlines()) == 1 and "not both" in r.output


@pytest.mark.parametrize("n_seq", [1, 3])
def test_account_matches_llama_cpp_reservation(tiny_gguf, n_seq):
    """The compute buffer formula against llama.cpp's own (the CPU backend reserves the same
    graph); the state is an upper bound within 10 %."""
    cfg = config_from_reader(open_gguf(tiny_gguf), tiny_gguf)
    with CloverRuntime(tiny_gguf, n_threads=1, n_seq_max=n_seq) as rt:
        bufs = rt.placement["buffers"]
        assert rt.n_ubatch == V.runtime_n_ubatch(n_seq, cfg.block_size)
    got = V.compute_buffer_bytes(cfg, V.runtime_n_ubatch(n_seq, cfg.block_size)) / 2**20
    assert got == pytest.approx(bufs["compute"]["CPU"], rel=0.01)
    state = V.state_bytes(cfg, n_seq) / 2**20
    assert bufs["memory"]["CPU"] <= state + 0.005 and state <= 1.1 * bufs["memory"]["CPU"] + 0.01
