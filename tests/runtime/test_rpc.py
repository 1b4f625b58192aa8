"""Offloading to llama.cpp's RPC backend: an rpc-server (ggml-rpc-server from the runtime build)
on 127.0.0.1 holds the offloaded layers; CloverRuntime(rpc_servers=...), `clover-gguf run --rpc`
and `llama-clover-cli --rpc` give the same greedy tokens as a local run and report which layers
and buffers went to the RPC device. The runtime build includes RPC by default, so a build without
it FAILS here (never skips)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest
from testdata import REPO, TINY

PROMPT = "def fibonacci(n):\n    "
N_NEW = 32


def _bin(name):
    from clover_gguf.runtime.build import runtime_paths

    p = runtime_paths()["bin_dir"] / name
    if not p.exists():
        pytest.fail(f"{p} missing: build the runtime with `clover-gguf runtime build` (RPC is on by default)")
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gguf(converted):
    return converted(TINY)


@pytest.fixture(scope="module")
def rpc_server(tmp_path_factory):
    """ggml-rpc-server on a free loopback port; yields 'HOST:PORT'."""
    port = _free_port()
    log = tmp_path_factory.mktemp("rpc-log") / "rpc-server.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [str(_bin("ggml-rpc-server")), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, f"ggml-rpc-server exited: {log.read_text(errors='replace')[-2000:]}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "ggml-rpc-server did not listen within 30 s"
            time.sleep(0.1)
    yield f"127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


# one process per comparison: an RPC device stays registered in a process once added
SCRIPT = r"""
import json, sys
from clover_gguf.runtime.runtime import CloverRuntime
from clover_gguf.reference.generate import GenerationConfig
gguf, ep, ngl, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
out = {}
for name, kw in (("local", {}), ("rpc", {"rpc_servers": ep, "n_gpu_layers": ngl})):
    with CloverRuntime(gguf, n_threads=1, **kw) as rt:
        ids = rt.tokenize(sys.argv[5])
        cfg = GenerationConfig(max_new_tokens=n, block_size=rt.default_block_size)
        out[name] = {"tokens": rt.generate(ids, cfg).tokens, "placement": rt.placement, "n_layer": rt.n_layer}
print(json.dumps(out))
"""


def _py(*args, timeout=300):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)


@pytest.mark.parametrize("ngl", [99, 2])
def test_runtime_over_rpc_gives_the_local_tokens(gguf, rpc_server, ngl):
    r = _py("-c", SCRIPT, str(gguf), rpc_server, str(ngl), str(N_NEW), PROMPT)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    local, rpc = got["local"], got["rpc"]
    assert rpc["tokens"] == local["tokens"] and len(local["tokens"]) > 0
    n_layer = local["n_layer"]
    p = rpc["placement"]
    on_rpc = sorted(i for dev, ids in p["layers"].items() if dev.startswith("RPC") for i in ids)
    # llama.cpp offloads the last ngl - 1 layers and the output layer
    assert on_rpc == list(range(max(n_layer + 1 - ngl, 0), n_layer)), p
    assert p["output"].startswith("RPC"), p
    assert p["offloaded_layers"] == f"{min(ngl, n_layer + 1)}/{n_layer + 1}", p
    rpc_weights = {k: v for k, v in p["buffers"]["model"].items() if k.startswith("RPC")}
    assert rpc_weights and all(v > 0 for v in rpc_weights.values()), p
    assert any(k.startswith("RPC") for k in p["buffers"]["memory"]), p  # the recurrent state too
    # the local run put nothing on an RPC device
    assert not any(k.startswith("RPC") for k in local["placement"]["layers"]), local["placement"]


def test_clover_gguf_run_rpc(gguf, rpc_server):
    base = ["-m", "clover_gguf.cli", "run", str(gguf), "-p", PROMPT, "-n", str(N_NEW), "-t", "1", "--json"]
    local = _py(*base)
    over = _py(*base, "-ngl", "99", "--rpc", rpc_server)
    assert local.returncode == 0 and over.returncode == 0, (local.stderr + over.stderr)[-3000:]
    a, b = json.loads(local.stdout), json.loads(over.stdout)
    assert b["token_ids"] == a["token_ids"] and "placement" not in a
    assert any(k.startswith("RPC") for k in b["placement"]["layers"]), b["placement"]


def test_llama_clover_cli_rpc(gguf, rpc_server):
    cli = str(_bin("llama-clover-cli"))
    base = [cli, "-m", str(gguf), "-p", PROMPT, "-n", str(N_NEW), "-t", "1", "--verbose-prompt"]
    local = subprocess.run(base, capture_output=True, text=True, timeout=300)
    over = subprocess.run(base + ["-ngl", "99", "--rpc", rpc_server], capture_output=True, text=True, timeout=300)
    assert local.returncode == 0 and over.returncode == 0, (local.stderr + over.stderr)[-3000:]
    ids = lambda out: next(ln for ln in out.splitlines() if ln.startswith("ids:"))  # noqa: E731
    assert ids(over.stdout) == ids(local.stdout)
    # the split is printed: the offloaded layers and the RPC device's weights
    assert "offloaded" in over.stderr and f"RPC0[{rpc_server}]" in over.stderr, over.stderr[-2000:]


def test_rpc_errors_name_the_server(gguf):
    closed = f"127.0.0.1:{_free_port()}"  # nothing listens there
    cli = str(_bin("llama-clover-cli"))
    for bad, words in ((closed, "cannot connect"), ("no-port", "HOST:PORT")):
        r = _py("-m", "clover_gguf.cli", "run", str(gguf), "-p", "x", "-n", "4", "-ngl", "99", "--rpc", bad)
        assert r.returncode != 0 and words in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        # llama-clover-cli takes --rpc from common's parser: its error names the option and the
        # server (then the option's usage), and ggml-rpc no longer aborts (the series' rpc patch)
        c = subprocess.run([cli, "-m", str(gguf), "-p", "x", "-n", "4", "--rpc", bad], capture_output=True, text=True)
        assert c.returncode == 1, c.stderr
        # common's log thread may write its timestamp prefix (for ggml-rpc's own "E" line) just
        # before this line: stderr has two writers, so the message is checked, not the whole line
        line = f'error while handling argument "--rpc": cannot connect to an RPC server at {bad}\n'
        assert line in c.stderr, c.stderr
