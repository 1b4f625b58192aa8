"""`clover-gguf serve`: an OpenAI-compatible HTTP server for a Clover GGUF (FastAPI + uvicorn,
SSE streaming one event per committed block, memory snapshots reused across turns).

Modules: app.py (routes, validation, SSE), engine.py (the worker that owns the runtime),
cache.py (the snapshot LRU), text.py (stop strings, the thinking split).
"""

from __future__ import annotations

from pathlib import Path

SERVER_EXTRA_HINT = "clover-gguf serve needs the server extra: pip install 'clover-gguf[server]'"


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
    log=print,
    op_offload: bool = True,
    mmap: bool = True,
) -> None:
    """Load MODEL and serve it until SIGTERM/SIGINT (in-flight requests finish first).
    op_offload/mmap: llama.cpp's --no-op-offload / --no-mmap (host-resident experts; docs/plan.md)."""
    try:
        import uvicorn

        from .app import ServerConfig, create_app
    except ImportError as e:
        raise RuntimeError(f"{SERVER_EXTRA_HINT} ({e})") from None
    from ..constants import ARCH, Keys
    from ..runtime.runtime import CloverRuntime, placement_line
    from .engine import Engine

    model = Path(model)
    if model.suffix != ".gguf" or not model.is_file():
        raise ValueError(f"{model}: not a .gguf file")
    if parallel < 1 or ctx_cache < 0:
        raise ValueError("--parallel must be >= 1 and --ctx-cache >= 0")
    import torch

    # the generation loop's tensors are one block of logits: extra torch threads only contend
    # with llama.cpp's
    torch.set_num_threads(1)
    from ..plan.placement import fit_overrides
    from ..runtime.bindings import parse_override

    # one sequence per request of a group, and one to commit finished conversations (Engine);
    # --fit sizes the state for all of them
    ot = fit_overrides(
        model, n_gpu_layers, fit, experts_on_cpu, n_seq=parallel + 1, log=log, rpc=bool(rpc), op_offload=op_offload
    )
    rt = CloverRuntime(
        model,
        n_threads=threads,
        n_gpu_layers=n_gpu_layers,
        experts_on_cpu=experts_on_cpu,
        n_seq_max=parallel + 1,
        rpc_servers=rpc,
        cpu_tensors=[parse_override(s) for s in ot],
        op_offload=op_offload,
        mmap=mmap,
    )
    ctx_meta = rt.meta(Keys.CONTEXT_LENGTH.format(arch=ARCH))
    n_ctx = int(ctx_size or (int(ctx_meta) if ctx_meta else 0) or 262144)
    cfg = ServerConfig(
        model_path=str(model),
        model_id=model.name,
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
    )
    engine = Engine(rt, parallel=parallel, ctx_cache=ctx_cache)
    app = create_app(engine, cfg)
    log(
        f"clover-gguf serve: {model.name} on http://{host}:{port}/v1 (block size {rt.default_block_size}, "
        f"context {n_ctx}, {rt.n_threads} threads, parallel {parallel}, ctx-cache {ctx_cache}"
        f"{', API key required' if api_key else ''})",
    )
    if rt.rpc_servers:
        log(f"clover-gguf serve: RPC {', '.join(rt.rpc_servers)}: {placement_line(rt.placement)}")
    try:
        uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=None)
    finally:
        rt.close()
