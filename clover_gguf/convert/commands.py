"""The converter's commands: `clover-gguf synth` (a synthetic checkpoint to convert: real
shapes, random weights) and `clover-gguf imatrix`. `convert` itself is in plan/commands.py: its
fit:SIZE recipes are the planner's, and plan sits above convert. Registered in cli.py."""

from __future__ import annotations

import click

from ..options import InputPath, option_type


@click.command("synth")
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
    from ..config import CloverConfig, preset
    from ..synthetic import write_synthetic, write_synthetic_gguf

    if (preset_name is None) == (config_path is None):
        raise click.UsageError("give exactly one of --preset or --config")
    cfg = preset(preset_name) if preset_name else CloverConfig.load(config_path)
    if as_gguf:
        path = write_synthetic_gguf(out, cfg, layers=layers, recipe=recipe, seed=seed)
    else:
        path = write_synthetic(out, cfg, layers=layers, shard_size_mb=shard_size_mb, fused=fused, seed=seed)
    click.echo(f"wrote {path}")


@click.command("imatrix")
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
    from .imatrix import compute_imatrix

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
