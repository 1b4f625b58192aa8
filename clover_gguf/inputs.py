"""Only regular files are opened as inputs: a FIFO, device, socket or folder given where a file
is read (a model's shards, index, tokenizer, an imatrix, a corpus, a GGUF, ...) is refused in
one line naming it, instead of blocking forever in open() or read() (a FIFO) or reading an
endless stream (/dev/zero). Links to regular files are followed as usual.

The checks open with O_NONBLOCK and look at the open file (fstat), so a name swapped between
check and open cannot slip a FIFO through.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from .errors import CloverError


class InputError(CloverError, ValueError):
    """An input path that is not a readable regular file; the message names it."""


def file_kind(mode: int) -> str:
    """'a FIFO', 'a directory', ... for an st_mode that is not a regular file."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _refusal(path, mode: int, what: str) -> InputError:
    return InputError(f"{path}: {what}is {file_kind(mode)}, not a regular file")


def regular_file(path: str | Path, what: str = "") -> Path:
    """``path`` if it names a regular file (after links); InputError otherwise. ``what``
    ("--imatrix ", "shard ") prefixes the reason."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise InputError(f"{path}: {what}no such file") from None
    except OSError as e:
        raise InputError(f"{path}: {what}{e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise _refusal(path, st.st_mode, what)
    return path


def open_input(path: str | Path, what: str = ""):
    """A binary file object of a regular file: opened without blocking (a FIFO would block
    open() until a writer appears) and checked on the open descriptor."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InputError(f"{path}: {what}no such file") from None
    except OSError as e:
        raise InputError(f"{path}: {what}{e.strerror or e}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _refusal(path, mode, what)
    os.set_blocking(fd, True)
    return open(fd, "rb")  # noqa: SIM115 (the caller closes it)


def _size(n: int) -> str:
    return f"{n:,} bytes" + (f" ({n / 2**20:.1f} MiB)" if n >= 2**20 else "")


def read_bytes(path: str | Path, what: str = "", max_bytes: int | None = None) -> bytes:
    """The file's bytes; with ``max_bytes``, a larger file is refused (InputError naming it and
    both sizes) before anything is read, and so is one that grows past it while being read."""
    with open_input(path, what) as f:
        if max_bytes is None:
            return f.read()
        size = os.fstat(f.fileno()).st_size
        data = f.read(max_bytes + 1) if size <= max_bytes else b""
        if size > max_bytes or len(data) > max_bytes:
            raise InputError(
                f"{path}: {what}{_size(max(size, len(data)))}, more than the {_size(max_bytes)} such a file may "
                "have; not read"
            )
        return data


def read_text(path: str | Path, what: str = "", errors: str = "strict", max_bytes: int | None = None) -> str:
    return read_bytes(path, what, max_bytes).decode("utf-8", errors)


class DuplicateKeyError(CloverError, ValueError):
    """A JSON object that names a key twice (``json.loads`` keeps the last value silently)."""

    def __init__(self, key: str):
        super().__init__(f"duplicate key {key!r}")
        self.key = key


def no_duplicate_keys(pairs) -> dict:
    """``object_pairs_hook`` for json.loads: a key given twice in one object is refused."""
    d = {}
    for k, v in pairs:
        if k in d:
            raise DuplicateKeyError(k)
        d[k] = v
    return d


def loads_json(text: str | bytes):
    """json.loads refusing duplicate keys (DuplicateKeyError) at any depth."""
    return json.loads(text, object_pairs_hook=no_duplicate_keys)
