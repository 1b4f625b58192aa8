"""How the commands turn an error into one line."""

from __future__ import annotations


class CloverError(Exception):
    """An error the user can act on; the CLI prints str(e) as one line and exits 1.

    Every domain error class of clover_gguf subclasses it beside its built-in base
    (``class ConfigError(CloverError, ValueError)``), so ``except ValueError`` still catches it."""


def os_error_line(e: OSError, subject=None) -> str:
    """An OSError as one line: the file it names, else the system's reason alone (an ENOMEM or
    EAGAIN with no file is a limit of the machine: naming the model would blame the file)."""
    why = e.strerror or str(e)
    if e.filename:
        return f"{e.filename}: {why}"
    return (
        f"{why} (a system resource ran out{f' while working on {subject}' if subject else ''}; not a fault of the file)"
    )
