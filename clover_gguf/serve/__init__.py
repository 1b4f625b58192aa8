"""`clover-gguf serve`: an OpenAI-compatible HTTP server for a Clover GGUF (FastAPI + uvicorn,
SSE streaming one event per committed block, memory snapshots reused across turns).

Modules: app.py (routes, validation, SSE), fields.py (every request field: implemented or
refused, numeric ranges), engine.py (the worker that owns the runtime), cache.py (the snapshot
LRU), text.py (stop strings, the thinking split), tools.py (tool calls, constraints),
logprobs.py, metrics.py (/metrics), local.py (a server in a subprocess, for tests), commands.py
(the click command).
"""

from __future__ import annotations

import math
from pathlib import Path

from ..errors import CloverError

SERVER_EXTRA_HINT = "clover-gguf serve needs the server extra: pip install 'clover-gguf[server]'"


class ServeError(CloverError, RuntimeError):
    """The server cannot start: the server extra is missing, or a server started for a
    benchmark or test (local.py) exited or never answered."""


def check_listen(host: str, port: int) -> None:
    """Bind (host, port) once before the model loads, so that a port in use or an unknown host
    is one line, not uvicorn's several after a long load (uvicorn binds with SO_REUSEADDR too)."""
    import socket

    try:
        fam, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {host}: {getattr(e, 'strerror', None) or e}") from None
    with socket.socket(fam, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise ValueError(f"--host {host} --port {port}: {e.strerror or e}") from None


def serve(
    model: str | Path,
    host: str = "127.0.0.1",
    port: int = 8080,
    threads: int | None = None,
    n_gpu_layers: int = 0,
    experts_on_cpu: bool = False,
    fit: bool | None = None,
    api_key: str | None = None,
    parallel: int = 1,
    ctx_cache: int = 16,
    ctx_size: int | None = None,
    rpc: str | None = None,
    n_predict: int | None = None,
    alias: str | None = None,
    queue_timeout: float | None = None,
    log=print,
    op_offload: bool = True,
    mmap: bool = True,
) -> None:
    """Load MODEL and serve it until SIGTERM/SIGINT (requests whose clients are still connected
    finish first; abandoned ones are cancelled at their next denoising step). n_predict: the
    tokens of one reply at most (default DEFAULT_N_PREDICT); alias: the model id /v1/models lists
    (default: the file name); queue_timeout: seconds a request may wait for a sequence before a
    503 (default DEFAULT_QUEUE_TIMEOUT; 0: no limit). op_offload/mmap: llama.cpp's
    --no-op-offload / --no-mmap (host-resident experts; docs/plan.md)."""
    uvicorn, app = _server_modules()
    from .engine import Engine

    model = Path(model)
    n_predict = app.DEFAULT_N_PREDICT if n_predict is None else n_predict
    queue_timeout = app.DEFAULT_QUEUE_TIMEOUT if queue_timeout is None else queue_timeout
    _check_options(
        model,
        port=port,
        threads=threads,
        n_gpu_layers=n_gpu_layers,
        parallel=parallel,
        ctx_cache=ctx_cache,
        ctx_size=ctx_size,
        n_predict=n_predict,
        queue_timeout=queue_timeout,
        alias=alias,
        api_key=api_key,
    )
    check_listen(host, port)
    rt = _load_runtime(model, threads, n_gpu_layers, experts_on_cpu, fit, parallel, rpc, op_offload, mmap, log)
    n_ctx = _context_size(rt, ctx_size)
    cfg = app.ServerConfig(
        model_path=str(model),
        model_id=alias or model.name,
        ctx_size=n_ctx,
        api_key=api_key,
        parallel=parallel,
        ctx_cache=ctx_cache,
        threads=rt.n_threads,
        n_gpu_layers=n_gpu_layers,
        experts_on_cpu=experts_on_cpu,
        host=host,
        port=port,
        rpc=rt.rpc_servers,
        placement=rt.placement,
        n_predict=min(n_predict, n_ctx),
        queue_timeout=queue_timeout or None,
    )
    application = app.create_app(Engine(rt, parallel=parallel, ctx_cache=ctx_cache), cfg, log=log)
    _announce(cfg, rt.default_block_size, log)
    try:
        uvicorn.run(application, host=host, port=port, log_level="info", timeout_graceful_shutdown=None)
    finally:
        rt.close()


def _server_modules():
    """uvicorn and serve.app, or a ServeError naming the extra to install (before any work)."""
    try:
        import uvicorn

        from . import app
    except ImportError as e:
        raise ServeError(f"{SERVER_EXTRA_HINT} ({e})") from None
    return uvicorn, app


def _check_options(
    model: Path, *, port, threads, n_gpu_layers, parallel, ctx_cache, ctx_size, n_predict, queue_timeout, alias, api_key
) -> None:
    """A ValueError naming the option, for callers of serve() (the CLI's click types check the
    same table, options.py, before this)."""
    from ..options import RANGES

    if model.suffix != ".gguf" or not model.is_file():
        raise ValueError(f"{model}: not a .gguf file")
    for opt, name, v in (
        ("--port", "port", port),
        ("-t", "threads", threads),
        ("-ngl", "n_gpu_layers", n_gpu_layers),
        ("--parallel", "parallel", parallel),
        ("--ctx-cache", "ctx_cache", ctx_cache),
        ("-c", "ctx_size", ctx_size),
    ):
        if v is not None:
            RANGES[name].check(v, opt)
    if n_predict < 1:
        raise ValueError(f"--n-predict {n_predict}: must be >= 1")
    if not (math.isfinite(queue_timeout) and queue_timeout >= 0):
        raise ValueError(f"--queue-timeout {queue_timeout:g}: must be a number of seconds >= 0 (0: no limit)")
    if alias is not None and not alias.strip():
        raise ValueError("--alias: must not be empty")
    if api_key is not None and not api_key.strip():  # an empty key would turn authentication off
        raise ValueError("--api-key: empty; give a key, or leave the option out to serve without one")


def _load_runtime(model: Path, threads, n_gpu_layers, experts_on_cpu, fit, parallel, rpc, op_offload, mmap, log):
    """The CloverRuntime with one sequence per request of a group, and one to commit finished
    conversations (Engine); --fit sizes the state for all of them."""
    import torch

    from ..generation.loader import load

    # the generation loop's tensors are one block of logits: extra torch threads only contend
    # with llama.cpp's
    torch.set_num_threads(1)
    return load(
        model,
        threads=threads,
        n_gpu_layers=n_gpu_layers,
        experts_on_cpu=experts_on_cpu,
        fit=fit,
        rpc=rpc,
        log=log,
        n_seq_max=parallel + 1,
        op_offload=op_offload,
        mmap=mmap,
    ).rt  # the engine batches sequences on the runtime itself (generate_batch)


def _context_size(rt, ctx_size: int | None) -> int:
    """-c, else the GGUF's context_length, else 262144; at least the block size (else the
    runtime is closed and a ValueError names -c)."""
    from ..constants import ARCH, Keys

    ctx_meta = rt.meta(Keys.CONTEXT_LENGTH.format(arch=ARCH))
    n_ctx = int(ctx_size or (int(ctx_meta) if ctx_meta else 0) or 262144)
    if n_ctx < rt.default_block_size:
        rt.close()
        raise ValueError(f"-c {n_ctx}: must be at least the model's block size ({rt.default_block_size})")
    return n_ctx


def _announce(cfg, block_size: int, log) -> None:
    """The startup lines: what is served where, and a warning for a public port without a key."""
    from ..runtime.runtime import placement_line

    qt = cfg.queue_timeout
    log(
        f"clover-gguf serve: {Path(cfg.model_path).name} on http://{cfg.host}:{cfg.port}/v1 (block size {block_size}, "
        f"context {cfg.ctx_size}, n-predict {cfg.n_predict}, {cfg.threads} threads, parallel {cfg.parallel}, "
        f"ctx-cache {cfg.ctx_cache}, queue timeout {f'{qt:g} s' if qt else 'none'}"
        f"{', API key required' if cfg.api_key else ''})",
    )
    if not cfg.api_key and cfg.host not in ("127.0.0.1", "localhost", "::1"):
        log(
            f"clover-gguf serve: warning: listening on {cfg.host} without --api-key: anyone who reaches the port "
            "can use it"
        )
    if cfg.rpc:
        log(f"clover-gguf serve: RPC {', '.join(cfg.rpc)}: {placement_line(cfg.placement)}")
