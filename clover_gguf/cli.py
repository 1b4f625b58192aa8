"""The `clover-gguf` command. Thin: each command calls one library function."""

from __future__ import annotations

import os
import signal
import sys

import click

from . import __version__
from .constants import DEFAULT_THRESHOLD
from .errors import error_line, os_error_line
from .options import InputPath, option_type


class OneLineErrors(click.Group):
    """The one place an error becomes one line, for every command (each package's commands.py
    lets errors through): a bad option value prints "Error: ..." without the usage block, and an
    error the user can act on (errors.error_line: a CloverError, ValueError, OSError or
    MemoryError) prints "Error: <line>" and exits 1. Anything else is a bug: a traceback."""

    def main(self, *args, **kwargs):
        standalone = kwargs.pop("standalone_mode", True)
        try:
            return super().main(*args, standalone_mode=False, **kwargs)
        except click.ClickException as e:
            if not standalone:
                raise
            click.echo(f"Error: {e.format_message()}", err=True)
            sys.exit(e.exit_code)
        except click.exceptions.Abort:
            if not standalone:
                raise
            click.echo("Aborted!", err=True)
            sys.exit(1)
        except Exception as e:
            line = error_line(e)
            if not standalone or line is None:
                raise
            click.echo(f"Error: {line}", err=True)
            sys.exit(1)


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="clover-gguf")
def cli():
    """Clover block-diffusion MoE: reference model, GGUF converter, llama.cpp runtime, eval."""


# --- reference / checkpoint commands (run, synth) ---------------------------------------


def _ids(ctx, param, value):
    if value is None:
        return None
    try:
        return [int(x) for x in value.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter("token ids must be integers separated by commas or spaces") from None


@cli.command("run")
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


@cli.command("synth")
@click.argument("out", type=click.Path())
@click.option("--preset", "preset_name", help="Shapes of a named model (clover-35b-a3b, clover-tiny).")
@click.option("--config", "config_path", type=InputPath(), help="Shapes from a config.json instead.")
@click.option("--layers", type=option_type("layers"), help="Override the number of layers.")
@click.option(
    "--shard-size-mb", default=2000.0, show_default=True, type=option_type("shard_size_mb"), help="Maximum shard size."
)
@click.option("--fused", is_flag=True, help="Write experts fused (gate_up_proj/down_proj) instead of per expert.")
@click.option(
    "--gguf",
    "as_gguf",
    is_flag=True,
    help="Write OUT as a GGUF of random quantized blocks in the --recipe's types, directly (no BF16 checkpoint).",
)
@click.option("--recipe", default="q4_k_m", show_default=True, help="Types of the --gguf file (a convert recipe).")
@click.option("--seed", default=0, show_default=True, type=option_type("seed"))
def synth_cmd(out, preset_name, config_path, layers, shard_size_mb, fused, as_gguf, recipe, seed):
    """Write a seeded synthetic model with real shapes and random weights: a BF16 safetensors
    checkpoint folder OUT (sharded), or with --gguf a GGUF file OUT.

    \b
    clover-gguf synth /tmp/c35 --preset clover-35b-a3b --layers 2 --shard-size-mb 1000
    clover-gguf synth /tmp/c35-40l.gguf --preset clover-35b-a3b --gguf --recipe q4_k_m
    """
    from .config import CloverConfig, preset
    from .synthetic import write_synthetic, write_synthetic_gguf

    if (preset_name is None) == (config_path is None):
        raise click.UsageError("give exactly one of --preset or --config")
    cfg = preset(preset_name) if preset_name else CloverConfig.load(config_path)
    if as_gguf:
        path = write_synthetic_gguf(out, cfg, layers=layers, recipe=recipe, seed=seed)
    else:
        path = write_synthetic(out, cfg, layers=layers, shard_size_mb=shard_size_mb, fused=fused, seed=seed)
    click.echo(f"wrote {path}")


# --- converter commands (convert, inspect, imatrix) -------------------------------------


def _recipe_help() -> str:
    from .convert.recipes import RECIPES

    return (
        "Named recipe: "
        + "; ".join(f"{r.name} ({r.description})" for r in RECIPES.values())
        + "; or fit:SIZE (e.g. fit:16GiB): the types with the least predicted KL whose file fits SIZE (docs/plan.md)."
    )


@cli.command("convert")
@click.argument("model_dir", type=InputPath(file_okay=False))
@click.option("-o", "--outfile", "out", type=click.Path(dir_okay=False), help="Output .gguf file.")
@click.option(
    "--outtype",
    type=click.Choice(["f32", "f16", "bf16", "q8_0"], case_sensitive=False),
    help="Type of the non-expert 2-D weights (attention, shared expert, embeddings, output) [default: bf16].",
)
@click.option(
    "--experts",
    type=click.Choice(
        ["q4_k", "q4_0", "q4_1", "iq4_nl", "iq4_xs", "mxfp4", "q5_k", "q6_k", "q8_0", "bf16", "f16", "f32"]
        + ["q3_k", "q2_k", "iq3_s", "iq2_s", "iq2_m"],
        case_sensitive=False,
    ),
    help="Type of the routed experts [default: q4_k].",
)
@click.option(
    "--tensor-type",
    "tensor_types",
    multiple=True,
    metavar="REGEX=TYPE",
    help="Override the type of tensors whose GGUF name matches REGEX (repeatable; first match wins).",
)
@click.option("--recipe", help=_recipe_help())
@click.option(
    "--imatrix",
    type=InputPath(dir_okay=False),
    help="llama.cpp GGUF imatrix (e.g. from `clover-gguf imatrix`) weighting the quantization.",
)
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
@click.option("--dry-run", is_flag=True, help="Print the plan (tensors, types, sizes, bits per weight) and exit.")
@click.option("-t", "--threads", type=option_type("threads"), help="Quantization threads [default: all cores].")
@click.option(
    "--backend",
    type=click.Choice(["auto", "ggml", "numpy"]),
    default="auto",
    show_default=True,
    help="Quantizer: ggml (libggml via ctypes), numpy (gguf-py, exact types only), auto.",
)
@click.option("--name", help="general.name [default: the model folder's name].")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@click.option("-v", "--verbose", is_flag=True, help="Plan: list every layer's tensors.")
def convert_cmd(
    model_dir,
    out,
    outtype,
    experts,
    tensor_types,
    recipe,
    imatrix,
    force,
    dry_run,
    threads,
    backend,
    name,
    quiet,
    verbose,
):
    """Convert a Clover safetensors MODEL_DIR (per-expert or fused experts, sharded or
    not) to a GGUF file llama.cpp loads.

    \b
    clover-gguf convert models/clover-tiny -o out/clover-tiny-q4_k.gguf
    clover-gguf convert /tmp/c35 -o c35.gguf --recipe q4_k_m --imatrix c35.imatrix.gguf
    clover-gguf convert /tmp/c35 --experts mxfp4 --tensor-type 'ffn_down_exps=q8_0' --dry-run
    """
    from .convert.converter import convert
    from .plan.budget import budget_rules

    if out is None and not dry_run:
        raise click.UsageError("give -o/--outfile (or --dry-run)")
    try:
        # a budget recipe (fit:SIZE) is the planner's: resolved to explicit types first
        rules = budget_rules(model_dir, recipe, outtype, experts, tensor_types, imatrix is not None, log=click.echo)
        res = convert(
            model_dir,
            out,
            outtype=outtype,
            experts=experts,
            tensor_types=list(tensor_types),
            recipe=None if rules else recipe,
            imatrix=imatrix,
            rules=rules,
            force=force,
            dry_run=dry_run,
            threads=threads,
            backend=backend,
            progress=not quiet and not dry_run,
            name=name,
        )
    except KeyboardInterrupt as e:
        notes = "; ".join(getattr(e, "__notes__", []))
        click.echo(f"\nInterrupted ({e}){': ' + notes if notes else ''}", err=True)
        raise SystemExit(128 + getattr(e, "signum", signal.SIGINT)) from None
    plan = res.plan
    if dry_run:
        click.echo(plan.table(verbose=verbose))
    else:
        for tname, why in plan.fallbacks():
            click.echo(f"fallback: {tname}: {why}", err=True)
        click.echo(
            f"wrote {res.out_path}: {len(plan.entries)} tensors, {res.bytes_out / 2**20:.2f} MiB, "
            f"{plan.bpw:.3f} bits per weight, in {res.seconds:.1f}s "
            f"({res.gbps_in:.3f} GB/s of input)"
        )
    for note in res.notes:
        click.echo(f"note: {note}", err=True)
    for w in res.warnings:
        click.echo(f"warning: {w}", err=True)


@cli.command("inspect")
@click.argument("path", type=InputPath())
@click.option("--tensors", "show_tensors", is_flag=True, help="List every tensor.")
@click.option("--no-metadata", is_flag=True, help="Only the tables.")
def inspect_cmd(path, show_tensors, no_metadata):
    """Metadata and a per-group table (experts, attention, embeddings, ...) of types, sizes
    and bits per weight, for a .gguf file or a safetensors model folder."""
    from .gguf_io.inspection import format_inspection, inspect_path

    ins = inspect_path(path)
    click.echo(format_inspection(ins, show_tensors=show_tensors, show_metadata=not no_metadata))


@cli.command("imatrix")
@click.argument("model_dir", type=InputPath(file_okay=False))
@click.option("-f", "--file", "text_file", required=True, type=InputPath(dir_okay=False), help="Calibration text.")
@click.option(
    "-o",
    "--outfile",
    "out",
    required=True,
    type=click.Path(dir_okay=False),
    help="Output imatrix (llama.cpp GGUF imatrix format).",
)
@click.option(
    "-c", "--ctx", "n_ctx", default=512, show_default=True, type=option_type("n_ctx_chunk"), help="Tokens per chunk."
)
@click.option("--chunks", type=option_type("count"), help="Use at most this many chunks.")
@click.option("--block-size", type=option_type("block_size"), help="Block size [default: the model's].")
@click.option(
    "--seed",
    default=0,
    show_default=True,
    type=option_type("seed"),
    help="Seed of the mask draws of the denoising stream.",
)
def imatrix_cmd(model_dir, text_file, out, n_ctx, chunks, block_size, seed):
    """Compute an importance matrix with the PyTorch reference on a text file, counting
    each routed expert's activations separately (llama.cpp's GGUF imatrix format)."""
    from .convert.imatrix import compute_imatrix

    im = compute_imatrix(
        model_dir,
        text_file,
        out,
        n_ctx=n_ctx,
        chunks=chunks,
        block_size=block_size,
        seed=seed,
        log=lambda m: click.echo(m, err=True),
    )
    click.echo(f"wrote {out}: {len(im.entries)} entries, {im.chunk_count} chunks of {im.chunk_size} tokens")


# --- plan ---------------------------------------------------------------------------------


@cli.command("plan")
@click.argument("model", required=False, type=click.Path())
@click.option("--shape", help="Plan for a preset's shapes instead of a model (clover-35b-a3b, clover-tiny).")
@click.option("--vram", help="The card's memory, e.g. 16GiB [default: the --gpu's]; without --gpu, the GPU table's "
              "figures of a card that size are assumed (and said).")  # fmt: skip
@click.option("--free-vram", help="Free VRAM as `run --fit` sees it (after the CUDA context), instead of --vram.")
@click.option("--ram", help="Host memory for CPU-resident experts, e.g. 64GiB.")
@click.option("--gpu", help="A GPU of the table (`--gpus` lists them), e.g. rtx5070ti.")
@click.option(
    "--bandwidth", type=option_type("bandwidth"), help="GPU memory bandwidth in GB/s (overrides the table's)."
)
@click.option("--parallel", type=option_type("parallel"), help="Size the state and buffers for `serve --parallel N`.")
@click.option("--context", type=option_type("context"), help="Context length (Clover's state does not grow with it).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option(
    "--write-recipe", type=click.Path(dir_okay=False), help="Write the fit recipe (types, convert options) as JSON."
)
@click.option("--curves", type=InputPath(file_okay=False), help="Sensitivity curves folder.")
@click.option(
    "--calibration",
    "calibrations",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="A CPU calibration (from --calibrate) [default: the cache's], or a GPU one: scripts/device_check.sh's "
    "summary.json. Repeatable.",
)
@click.option(
    "--calibrate",
    "calibrate_files",
    multiple=True,
    type=click.Path(),
    help="Measure this machine's CPU on these GGUFs and write --calibration.",
)
@click.option(
    "--validate",
    "validate_files",
    multiple=True,
    type=click.Path(),
    help="Print the cost model's error on these GGUFs (CPU).",
)
@click.option("-t", "--threads", type=option_type("threads"), help="CPU threads for --calibrate/--validate.")
@click.option("--gpus", "list_gpus", is_flag=True, help="List the GPU table and exit.")
def plan_cmd(
    model, shape, vram, free_vram, ram, gpu, bandwidth, parallel, context, as_json, write_recipe, curves, calibrations,
    calibrate_files, validate_files, threads, list_gpus,
):  # fmt: skip
    """Options that fit a GPU: recipe, exact sizes, the VRAM/RAM placement `run --fit` makes,
    predicted tok/s at 4 and 8 tokens per step, a KL prior, and the convert/run lines. docs/plan.md.

    \b
    clover-gguf plan --shape clover-35b-a3b --gpu rtx5070ti
    clover-gguf plan models/clover-tiny --vram 16GiB --json
    clover-gguf plan model.gguf --free-vram 14GiB --gpu rtx4080
    clover-gguf plan --calibrate out/tiny.gguf --calibrate out/c35-1l.gguf -t 8
    clover-gguf plan --shape clover-35b-a3b --gpu h200 --calibration out/device-check/summary.json
    """
    import json as _json

    from .outputs import check_replaceable
    from .plan import calibrate as C
    from .plan import format_plan, make_plan
    from .plan.budget import Curves
    from .plan.gpus import table
    from .plan.sizes import open_source, parse_size

    if list_gpus:
        click.echo(table())
        return
    if calibrate_files or validate_files:
        click.echo(C.command(calibrate_files, validate_files, calibrations, threads, as_json))
        return
    if write_recipe:
        check_replaceable(write_recipe, force=True)  # before the work
    cpu, kern = C.load_calibrations(calibrations)
    p = make_plan(
        open_source(model, shape),
        vram_total=parse_size(vram, "--vram") if vram else None,
        ram=parse_size(ram, "--ram") if ram else None,
        gpu=gpu,
        bandwidth=bandwidth,
        context=context,
        curves=Curves.load(curves) if curves else None,
        calibration=cpu,
        kernels=kern,
        free=parse_size(free_vram, "--free-vram") if free_vram else None,
        parallel=parallel,
    )
    if write_recipe:
        C.write_recipe(p, write_recipe)
    click.echo(_json.dumps(p, indent=1) if as_json else format_plan(p))


# --- serve --------------------------------------------------------------------------------


@cli.command("serve")
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
@click.option("--api-key", envvar="CLOVER_GGUF_API_KEY", help="Require this key (Bearer) on every route but /health.")
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
    from .serve import serve

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


# --- runtime commands (runtime build) ---------------------------------------------------


@cli.group("runtime")
def runtime_group():
    """The patched llama.cpp runtime (llama-cpp-python 0.3.36 + patches/)."""


@runtime_group.command("build")
@click.option("--cuda", is_flag=True, help="Build the CUDA backend too (GGML_CUDA=ON, FA off).")
@click.option(
    "--portable",
    is_flag=True,
    help="CPU kernels for any x86-64/ARM CPU (GGML_NATIVE=OFF) instead of this machine's instruction set.",
)
@click.option(
    "--cuda-arch",
    "cuda_arch",
    default=None,
    help="CMAKE_CUDA_ARCHITECTURES, ';' or ',' separated (default 86;89;120;80;90;100).",
)
@click.option("--jobs", "-j", type=option_type("jobs"), default=None, help="Parallel compile jobs (ninja default).")
@click.option("--force", is_flag=True, help="Rebuild even if the stamp matches.")
@click.option(
    "--targets", default=None, help="Comma-separated ninja targets instead of the default set (e.g. ggml-cuda)."
)
@click.option("--no-install", is_flag=True, help="Build only; do not pip-install llama-cpp-python.")
@click.option(
    "--rpc/--no-rpc",
    default=True,
    show_default=True,
    help="llama.cpp's RPC backend (GGML_RPC) and ggml-rpc-server, for --rpc offloading.",
)
@click.option(
    "--root",
    type=click.Path(file_okay=False),
    default=None,
    help="Runtime dir (default $CLOVER_GGUF_RUNTIME_DIR or <cache>/runtime).",
)
@click.option(
    "--cmake-arg",
    "cmake_arg",
    multiple=True,
    help="Extra cmake argument (repeatable), e.g. -DCUDA_cublas_LIBRARY=/path/libcublas.so.13.",
)
def runtime_build_cmd(cuda, portable, cuda_arch, jobs, force, targets, no_install, rpc, root, cmake_arg):
    """Fetch the sdist, apply patches/*.patch, build once with cmake+ninja, install."""
    from .runtime.build import build_runtime

    build_runtime(
        cuda=cuda,
        cuda_archs=cuda_arch.replace(",", ";") if cuda_arch else None,
        jobs=jobs,
        force=force,
        targets=targets.split(",") if targets else None,
        install=not no_install,
        root=root,
        extra_cmake_args=cmake_arg,
        portable=portable,
        rpc=rpc,
    )


@runtime_group.command("paths")
def runtime_paths_cmd():
    """Print where the built runtime lives (lib_dir, bin_dir, stamp, ...)."""
    from .runtime.build import runtime_paths

    for k, v in runtime_paths().items():
        click.echo(f"{k:18s} {v}")


# --- eval commands (eval quality, eval speed, report) -----------------------------------
from .eval.commands import eval_group as _eval_group  # noqa: E402
from .eval.commands import report_command as _report_command  # noqa: E402

cli.add_command(_eval_group)
cli.add_command(_report_command)


def main():
    cli()


if __name__ == "__main__":
    main()
