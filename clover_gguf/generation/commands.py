"""`clover-gguf run` (thin: parse options, call generation/run.py's run). Registered in
clover_gguf/cli.py."""

from __future__ import annotations

import os

import click

from ..constants import DEFAULT_THRESHOLD
from ..errors import os_error_line
from ..options import InputPath, option_type


def _ids(ctx, param, value):
    if value is None:
        return None
    try:
        return [int(x) for x in value.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter("token ids must be integers separated by commas or spaces") from None


@click.command("run")
@click.argument("model", required=False, type=InputPath())
@click.option("-p", "--prompt", help="Prompt text.")
@click.option("--prompt-ids", callback=_ids, help="Prompt as token ids (e.g. '1,2,3'), for models without a tokenizer.")
@click.option("-n", "--max-new-tokens", default=64, show_default=True, type=option_type("max_new_tokens"))
@click.option("--block-size", type=option_type("block_size"), help="Decoding block size [default: the model's].")
@click.option("--steps", type=option_type("steps"), help="`steps` schedule: denoising steps per block.")
@click.option(
    "--threshold",
    type=option_type("threshold"),
    help=f"`threshold` schedule: unmask every token this confident [default: {DEFAULT_THRESHOLD}].",
)
@click.option(
    "--temp", default=0.0, show_default=True, type=option_type("temperature"), help="Temperature; 0 is greedy."
)
@click.option(
    "--top-k", default=0, show_default=True, type=option_type("top_k"), help="Keep the k most probable tokens (0: off)."
)
@click.option("--top-p", default=1.0, show_default=True, type=option_type("top_p"))
@click.option("--seed", default=0, show_default=True, type=option_type("seed"))
@click.option("--chat", is_flag=True, help="Apply the model's chat template to the prompt.")
@click.option("--think/--no-think", default=True, show_default=True, help="Thinking mode of the chat template.")
@click.option("--system", help="System message for --chat.")
@click.option("-t", "--threads", type=option_type("threads"), help="CPU threads.")
@click.option(
    "-ngl",
    "--n-gpu-layers",
    default=0,
    show_default=True,
    type=option_type("n_gpu_layers"),
    help="Layers offloaded to the GPU (.gguf only).",
)
@click.option("--experts-on-cpu", is_flag=True, help="Keep routed experts in CPU memory when offloading (.gguf only).")
@click.option(
    "-ot",
    "--override-tensor",
    "override_tensor",
    multiple=True,
    metavar="REGEX=CPU",
    help="Keep tensors whose name matches REGEX in CPU memory, as llama.cpp's -ot (repeatable; .gguf only).",
)
@click.option(
    "--fit/--no-fit",
    default=None,
    help="Keep as many leading layers' routed experts in CPU memory as the free VRAM needs, and say so "
    "[default: on with -ngl unless -ot/--experts-on-cpu is given].",
)
@click.option(
    "--op-offload/--no-op-offload",
    default=True,
    show_default=True,
    help="Let the GPU compute batches of >= 32 rows on host-resident experts, copying the experts the "
    "batch uses (llama.cpp's default); --no-op-offload keeps that work on the CPU (.gguf only; docs/plan.md).",
)
@click.option(
    "--mmap/--no-mmap",
    default=True,
    show_default=True,
    help="Map the GGUF (llama.cpp's default); --no-mmap loads it, which puts host-resident experts in pinned "
    "memory that copies to the GPU faster (.gguf only).",
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16"]),
    default="float32",
    show_default=True,
    help="Reference precision (safetensors models only).",
)
@click.option(
    "--rpc",
    metavar="HOST:PORT[,...]",
    help="llama.cpp rpc-server(s) to offload -ngl layers to (comma-separated; .gguf only).",
)
@click.option("--json", "as_json", is_flag=True, help="Print completion, token ids and per-block statistics as JSON.")
@click.option("--debug", is_flag=True, help="Show llama.cpp's whole log (also CLOVER_GGUF_VERBOSE=1).")
def run_cmd(
    model,
    prompt,
    prompt_ids,
    max_new_tokens,
    block_size,
    steps,
    threshold,
    temp,
    top_k,
    top_p,
    seed,
    chat,
    think,
    system,
    threads,
    n_gpu_layers,
    experts_on_cpu,
    override_tensor,
    fit,
    op_offload,
    mmap,
    dtype,
    rpc,
    as_json,
    debug,
):
    """Generate with block diffusion from MODEL: a safetensors model folder (PyTorch
    reference) or a .gguf file (patched llama.cpp). Default MODEL: the bundled clover-tiny.

    \b
    clover-gguf run -p 'def fibonacci(n):' -n 48 --steps 8
    clover-gguf run out/clover-tiny-q4_k.gguf -p 'import os' --threshold 0.8 --json
    clover-gguf run model.gguf -p 'import os' -ngl 99 --rpc gpu-box:50052
    """
    from .run import DEFAULT_MODEL, print_output, run

    if prompt is None and prompt_ids is None:
        raise click.UsageError("give -p/--prompt or --prompt-ids")
    if prompt is not None and prompt_ids is not None:  # the ids used to win silently
        raise click.UsageError("give -p/--prompt or --prompt-ids, not both")
    if debug:
        os.environ["CLOVER_GGUF_VERBOSE"] = "1"
    try:
        out = run(
            model or DEFAULT_MODEL,
            prompt=prompt,
            prompt_ids=prompt_ids,
            block_size=block_size,
            steps=steps,
            threshold=threshold,
            temp=temp,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            max_new_tokens=max_new_tokens,
            chat=chat,
            think=think,
            system=system,
            threads=threads,
            n_gpu_layers=n_gpu_layers,
            experts_on_cpu=experts_on_cpu,
            override_tensor=override_tensor,
            dtype=dtype,
            rpc=rpc,
            fit=fit,
            op_offload=op_offload,
            mmap=mmap,
            log=lambda m: click.echo(m, err=True),
        )
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:
        raise click.ClickException(os_error_line(e, model)) from None
    print_output(out, as_json)
