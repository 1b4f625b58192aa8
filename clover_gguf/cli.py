"""The `clover-gguf` command. Thin: each command calls one library function."""

from __future__ import annotations

import click

from . import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="clover-gguf")
def cli():
    """Clover block-diffusion MoE: reference model, GGUF converter, llama.cpp runtime, eval."""


# --- reference / checkpoint commands (run, synth) ---------------------------------------

# --- converter commands (convert, inspect, imatrix) -------------------------------------

# --- runtime commands (runtime build) ---------------------------------------------------

# --- eval commands (eval quality, eval speed, report) -----------------------------------


def main():
    cli()


if __name__ == "__main__":
    main()
