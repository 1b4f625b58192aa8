"""The planner's commands: `clover-gguf plan`, and `clover-gguf convert`, whose fit:SIZE
recipe the planner resolves to explicit types before the converter runs (plan sits above
convert, so the command that needs both lives here). Registered in cli.py."""

from __future__ import annotations

import signal

import click

from ..options import InputPath, option_type


@click.command("plan")
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
    predicted tok/s at 4 and 8 tokens per step (ranges from the spread of the GPU model's public
    sources; assumptions and unanchored terms named), a KL prior, and the convert/run lines.
    docs/plan.md.

    \b
    clover-gguf plan --shape clover-35b-a3b --gpu rtx5070ti
    clover-gguf plan models/clover-tiny --vram 16GiB --json
    clover-gguf plan model.gguf --free-vram 14GiB --gpu rtx4080
    clover-gguf plan --calibrate out/tiny.gguf --calibrate out/c35-1l.gguf -t 8
    clover-gguf plan --shape clover-35b-a3b --gpu h200 --calibration out/device-check/summary.json
    """
    import json as _json

    from ..outputs import check_replaceable
    from . import calibrate as C
    from .budget import Curves
    from .gpus import table
    from .planner import format_plan, make_plan
    from .sizes import open_source, parse_size

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


def _recipe_help() -> str:
    from ..convert.recipes import RECIPES

    return (
        "Named recipe: "
        + "; ".join(f"{r.name} ({r.description})" for r in RECIPES.values())
        + "; or fit:SIZE (e.g. fit:16GiB): the types with the least predicted KL whose file fits SIZE (docs/plan.md)."
    )


@click.command("convert")
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
    from ..convert.converter import convert
    from .budget import budget_rules

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
