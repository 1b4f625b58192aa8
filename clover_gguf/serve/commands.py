"""`clover-gguf serve`. Registered in cli.py."""

from __future__ import annotations

import click

from ..options import InputPath, option_type

API_KEY_ENV = "CLOVER_GGUF_API_KEY"


@click.command("serve")
@click.argument("model", type=InputPath(dir_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8080, show_default=True, type=option_type("port"))
@click.option(
    "-ngl",
    "--n-gpu-layers",
    default=0,
    show_default=True,
    type=option_type("n_gpu_layers"),
    help="Layers offloaded to the GPU.",
)
@click.option("--experts-on-cpu", is_flag=True, help="Keep routed experts in CPU memory when offloading.")
@click.option(
    "--fit/--no-fit",
    default=None,
    help="Keep as many leading layers' routed experts in CPU memory as the free VRAM needs "
    "[default: on with -ngl unless --experts-on-cpu].",
)
@click.option(
    "--op-offload/--no-op-offload",
    default=True,
    show_default=True,
    help="Let the GPU compute batches of >= 32 rows on host-resident experts, copying the experts the "
    "batch uses (llama.cpp's default); --no-op-offload keeps that work on the CPU.",
)
@click.option(
    "--mmap/--no-mmap",
    default=True,
    show_default=True,
    help="Map the GGUF (llama.cpp's default); --no-mmap loads it, which puts host-resident experts in pinned "
    "memory that copies to the GPU faster.",
)
@click.option("-t", "--threads", type=option_type("threads"), help="CPU threads.")
@click.option(
    "--api-key",
    envvar="CLOVER_GGUF_API_KEY",
    help="Require this key (Bearer or x-api-key) on every route but /health [env: CLOVER_GGUF_API_KEY].",
)
@click.option(
    "-np",
    "--parallel",
    default=1,
    show_default=True,
    type=option_type("parallel"),
    help="Requests decoded together (one sequence each, one graph per denoising step).",
)
@click.option(
    "--ctx-cache",
    default=16,
    show_default=True,
    type=option_type("ctx_cache"),
    help="Memory snapshots kept for state reuse (0: off).",
)
@click.option(
    "-c",
    "--ctx-size",
    type=option_type("ctx_size"),
    help="Context limit in tokens [default (or 0): the GGUF's context_length].",
)
@click.option(
    "--rpc",
    metavar="HOST:PORT[,...]",
    help="llama.cpp rpc-server(s) to offload -ngl layers to (comma-separated).",
)
@click.option(
    "-n",
    "--n-predict",
    type=option_type("n_predict"),
    help="Tokens of one reply at most, and chat's default max_tokens [default: 8192; at most the context].",
)
@click.option(
    "--alias", help="The model id /v1/models lists (any request model name is accepted) [default: the file name]."
)
@click.option(
    "--queue-timeout",
    type=option_type("queue_timeout"),
    help="Seconds a request may wait for a free sequence before a 503 (0: no limit) [default: 300].",
)
def serve_cmd(
    model, host, port, n_gpu_layers, experts_on_cpu, fit, op_offload, mmap, threads, api_key, parallel, ctx_cache,
    ctx_size, rpc, n_predict, alias, queue_timeout,
):  # fmt: skip
    """OpenAI-compatible server for a Clover GGUF: /v1/completions and /v1/chat/completions
    (SSE streaming, one event per committed block), /v1/models, /health, /props, /metrics, and
    llama-server's /infill, /tokenize, /detokenize, /apply-template. A turn that extends an
    earlier conversation prefills only its new tokens. Needs `pip install 'clover-gguf[server]'`.

    \b
    clover-gguf serve out/clover-tiny-q4_k.gguf --port 8080 -t 2
    clover-gguf serve model.gguf -ngl 99 --experts-on-cpu --api-key secret --parallel 4 --ctx-cache 32
    clover-gguf serve model.gguf -ngl 99 --rpc gpu-box-1:50052,gpu-box-2:50052
    \b
    Request extensions: "clover": {"block_size": 32, "steps": 8 | "threshold": 0.9, "cache_prompt": true},
    "chat_template_kwargs": {"enable_thinking": false}, "top_k". See docs/serving.md.
    """
    import os

    from . import serve

    if api_key is None and os.environ.get(API_KEY_ENV) is not None:
        # click reads an empty variable as unset: that would turn authentication off unnoticed
        raise ValueError(f"{API_KEY_ENV} is set but empty; give a key, or unset it to serve without one")
    serve(
        model,
        host=host,
        port=port,
        threads=threads,
        n_gpu_layers=n_gpu_layers,
        experts_on_cpu=experts_on_cpu,
        fit=fit,
        api_key=api_key,
        parallel=parallel,
        ctx_cache=ctx_cache,
        ctx_size=ctx_size,
        rpc=rpc,
        op_offload=op_offload,
        mmap=mmap,
        n_predict=n_predict,
        alias=alias,
        queue_timeout=queue_timeout,
        log=lambda m: click.echo(m, err=True),
    )
