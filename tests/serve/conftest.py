"""clover-tiny as a GGUF, one `clover-gguf serve` subprocess on a free loopback port for the
session, the real openai client, and an in-process runtime that computes what each answer must be."""

from __future__ import annotations

import signal

import pytest
from testdata import TINY

from clover_gguf.reference.generate import GenerationConfig

API_KEY = "test-key-123"
CTX = 1024  # the server's context limit (-c)
TIMEOUT = 60  # seconds, for every client call
# uvicorn shuts down gracefully, then re-raises the signal: the exit status is SIGTERM's, not SIGKILL's
SIGTERM_EXIT = (0, -signal.SIGTERM)


def _runtime_or_fail():
    from clover_gguf.runtime import bindings

    try:
        bindings.load()
    except bindings.RuntimeNotBuilt as e:
        pytest.fail(f"llama.cpp runtime not built: {e}", pytrace=False)


@pytest.fixture(scope="session")
def tiny_gguf(converted):
    _runtime_or_fail()
    assert (TINY / "config.json").exists(), f"{TINY} has no trained checkpoint"
    return converted(TINY, "bf16")


@pytest.fixture(scope="session")
def server(tiny_gguf, tmp_path_factory):
    from clover_gguf.serve.local import LocalServer

    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    args = ("-t", "1", "--api-key", API_KEY, "--parallel", "2", "--ctx-cache", "32", "-c", str(CTX))
    srv = LocalServer(tiny_gguf, *args, log_path=log, startup_timeout=120).start()
    yield srv
    rc = srv.stop(timeout=30)
    assert rc in SIGTERM_EXIT, f"the server exited with {rc} after SIGTERM: {srv.log_tail()}"


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=TIMEOUT, max_retries=0)


@pytest.fixture(scope="session")
def model_id(tiny_gguf):
    return tiny_gguf.name


@pytest.fixture(scope="session")
def rt(tiny_gguf):
    import torch

    from clover_gguf.runtime.runtime import CloverRuntime

    torch.set_num_threads(1)
    r = CloverRuntime(tiny_gguf, n_threads=1)
    yield r
    r.close()


@pytest.fixture(scope="session")
def eog(rt):
    lc = rt._lib.lc
    return {t for t in range(rt.n_vocab) if lc.llama_vocab_is_eog(rt.vocab, t)}


@pytest.fixture(scope="session")
def expect(rt, eog):
    """What the server must answer, computed here with the runtime alone: a fresh run (reset, the
    whole prompt committed in blocks of B), tokens up to the first end-of-generation token."""

    def run(ids, max_tokens, **kw):
        cfg = GenerationConfig(max_new_tokens=max_tokens, block_size=rt.default_block_size, **kw)
        rt.reset()
        toks = rt.generate(ids, cfg, reset=False).tokens
        cut = next((i for i, t in enumerate(toks) if t in eog), len(toks))
        return toks[:cut], rt.detokenize(toks[:cut])

    return run
