"""`clover-gguf inspect`: a GGUF file's or a safetensors folder's metadata and tensor table.
Registered in cli.py."""

from __future__ import annotations

import click

from ..options import InputPath


@click.command("inspect")
@click.argument("path", type=InputPath())
@click.option("--tensors", "show_tensors", is_flag=True, help="List every tensor.")
@click.option("--no-metadata", is_flag=True, help="Only the tables.")
def inspect_cmd(path, show_tensors, no_metadata):
    """Metadata and a per-group table (experts, attention, embeddings, ...) of types, sizes
    and bits per weight, for a .gguf file or a safetensors model folder."""
    from .inspection import format_inspection, inspect_path

    ins = inspect_path(path)
    click.echo(format_inspection(ins, show_tensors=show_tensors, show_metadata=not no_metadata))
