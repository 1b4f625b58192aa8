"""The `clover-gguf` command: the root group (version, the one error path) and each package's
commands (generation/, convert/, gguf_io/, plan/, serve/, runtime/, eval/: each a commands.py). Thin: each
command calls one library function."""

from __future__ import annotations

import sys

import click

from . import __version__
from .convert.commands import imatrix_cmd, synth_cmd
from .errors import error_line
from .eval.commands import eval_group, report_command
from .generation.commands import run_cmd
from .gguf_io.commands import inspect_cmd
from .plan.commands import convert_cmd, plan_cmd
from .runtime.commands import runtime_group
from .serve.commands import serve_cmd


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


# --- each package's commands --------------------------------------------------------------
for _command in (
    run_cmd,
    synth_cmd,
    convert_cmd,
    inspect_cmd,
    imatrix_cmd,
    plan_cmd,
    serve_cmd,
    runtime_group,
    eval_group,
):
    cli.add_command(_command)
cli.add_command(report_command)


def main():
    cli()


if __name__ == "__main__":
    main()
