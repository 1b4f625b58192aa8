"""How the commands turn an error into one line."""

from __future__ import annotations


def os_error_line(e: OSError, subject=None) -> str:
    """An OSError as one line: the file it names, else the system's reason alone (an ENOMEM or
    EAGAIN with no file is a limit of the machine: naming the model would blame the file)."""
    why = e.strerror or str(e)
    if e.filename:
        return f"{e.filename}: {why}"
    return (
        f"{why} (a system resource ran out{f' while working on {subject}' if subject else ''}; not a fault of the file)"
    )
