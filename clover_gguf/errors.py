"""How the commands turn an error into one line."""

from __future__ import annotations


class CloverError(Exception):
    """An error the user can act on; the CLI prints str(e) as one line and exits 1 (error_line).

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


def error_line(e: BaseException) -> str | None:
    """The one line `clover-gguf` prints for an error a command lets through (cli.py's root group
    turns it into "Error: <line>" and exit 1), or None for a bug, which keeps its traceback.

    What the library refuses is a CloverError, or a ValueError naming the option or file; an
    OSError names its file (os_error_line); MemoryError names the limit, not the input."""
    if isinstance(e, MemoryError):
        return "not enough memory (MemoryError): free memory or raise the limit (ulimit -v)"
    if isinstance(e, CloverError | ValueError):
        return str(e)
    if isinstance(e, OSError):
        return os_error_line(e)
    return None
