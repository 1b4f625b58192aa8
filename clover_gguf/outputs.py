"""Every file the project writes goes through here (GGUFs, imatrices, reports, recipes,
calibrations, exported checkpoints, ...):

- the data goes to a temporary name in the output's folder, ``.<name>.tmp``, created new
  (``O_CREAT | O_EXCL | O_NOFOLLOW``): a link, FIFO, device or someone's file planted under that
  name is never opened, written or published;
- the temporary file is flock'ed while it is written (one writer per output; the kernel
  drops the lock when a process dies), and an unlocked one left by a killed run is removed
  (and named in ``notes``) before a new one is created;
- when the block completes the file is fsync'ed and given the final name: a hard link when
  the name is free (so of two writers one wins whole), a rename over an existing regular file
  when ``force``; never over a link, folder, FIFO or device;
- on any error or interruption the temporary file is removed and the output left as it was.

Errors are :class:`OutputError`, one line naming the path.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import CloverError
from .inputs import file_kind


class OutputError(CloverError, ValueError):
    """An output that cannot be written; the message names the path."""


def temporary_name(out: Path, tag: str = "") -> Path:
    return out.with_name(f".{out.name}{'.' + tag if tag else ''}.tmp")


def check_replaceable(out: str | Path, force: bool, tag: str = "") -> None:
    """Nothing at ``out``, or (with force) a regular file: never a link, folder, FIFO, device;
    and nothing but a regular file (a leftover) at its temporary name. Callers check before
    the work; output_file checks again."""
    out = Path(out)
    tmp = temporary_name(out, tag)
    try:
        mode = os.lstat(tmp).st_mode
    except OSError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        raise OutputError(f"{tmp}: exists and is {file_kind(mode)}, not a temporary file of ours; remove it")
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        if not out.parent.is_dir():
            raise OutputError(f"{out.parent}: output folder does not exist") from None
        return
    except OSError as e:
        raise OutputError(f"{out}: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{out}: is a directory")
    if not stat.S_ISREG(st.st_mode):
        raise OutputError(f"{out}: exists and is {file_kind(st.st_mode)}; only regular files are replaced")
    if not force:
        raise OutputError(f"{out}: exists (use --force to overwrite)")


def _clear_leftover(tmp: Path, out: Path, notes: list[str]) -> None:
    """Something is at the temporary name: a locked file is another writer's (refused), an
    unlocked regular file a killed run's (removed), anything else is refused."""
    try:
        st = os.lstat(tmp)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise OutputError(f"{tmp}: exists and is {file_kind(st.st_mode)}, not a temporary file of ours; remove it")
    try:
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        fst = os.fstat(fd)
        if fst.st_ino != st.st_ino or fst.st_dev != st.st_dev:
            return  # replaced meanwhile: look again
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputError(f"{out}: another process is writing it (its temporary file {tmp} is locked)") from None
        if fst.st_nlink == 1 and fst.st_size:
            notes.append(f"removed {tmp}, a temporary file ({fst.st_size} B) left by an interrupted run")
        # (a second link: published by another run, or planted; either way only the name goes)
        cur = os.lstat(tmp)
        if cur.st_ino == fst.st_ino and cur.st_dev == fst.st_dev:
            os.unlink(tmp)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


def _create_temporary(tmp: Path, out: Path, notes: list[str]) -> int:
    """A new, empty, locked regular file at ``tmp`` (its fd)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        try:
            fd = os.open(tmp, flags, 0o644)
        except FileExistsError:
            _clear_leftover(tmp, out, notes)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            st, cur = os.fstat(fd), os.lstat(tmp)
            if (cur.st_ino, cur.st_dev) == (st.st_ino, st.st_dev):
                return fd
        except (BlockingIOError, FileNotFoundError):
            pass  # another writer took our fresh file for a leftover: create it again
        os.close(fd)
    raise OutputError(f"{out}: could not create its temporary file {tmp}")


def _publish(fd: int, tmp: Path, out: Path, force: bool) -> None:
    """Give the finished temporary file the final name: with force, replacing a regular file;
    without, only if the name is still free (a hard link fails when it exists)."""
    st, cur = os.fstat(fd), os.lstat(tmp)
    if (cur.st_ino, cur.st_dev) != (st.st_ino, st.st_dev):
        raise OutputError(f"{out}: its temporary file {tmp} was replaced by another process; not published")
    if force:
        check_replaceable(out, True)
        os.replace(tmp, out)
        return
    try:
        os.link(tmp, out)
    except FileExistsError:
        raise OutputError(
            f"{out}: created by another process while this one was written; not replaced (use --force to overwrite)"
        ) from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        check_replaceable(out, False)  # no hard links on this filesystem: check, then rename
        os.replace(tmp, out)
        return
    os.unlink(tmp)


@contextmanager
def output_file(out: str | Path, force: bool = False, notes: list[str] | None = None, tag: str = "") -> Iterator:
    """A binary file open for writing under a temporary name in ``out``'s folder, published as
    ``out`` when the block completes, removed when it fails or is interrupted (the module
    docstring). ``force``: replace an existing regular file. ``tag`` goes in the temporary name."""
    out = Path(out)
    check_replaceable(out, force, tag)
    tmp = temporary_name(out, tag)
    try:
        fd = _create_temporary(tmp, out, notes if notes is not None else [])
    except OSError as e:
        raise OutputError(f"{out}: cannot create a temporary file in its folder ({e.strerror or e})") from None
    f = os.fdopen(fd, "wb")
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        _publish(fd, tmp, out, force)
        f.close()  # releases the lock, after the publish
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        try:
            f.close()
        except OSError:
            pass
        if isinstance(exc, OSError) and exc.filename in (None, str(tmp), str(out)):
            # a write error (ENOSPC, EFBIG, EIO, ...); one naming another file is about an input
            raise OutputError(f"{out}: {exc.strerror or exc}; nothing written") from exc
        raise


def write_bytes(out: str | Path, data: bytes, force: bool = True) -> Path:
    with output_file(out, force) as f:
        f.write(data)
    return Path(out)


def write_text(out: str | Path, text: str, force: bool = True) -> Path:
    return write_bytes(out, text.encode("utf-8"), force)


def write_json(out: str | Path, obj, force: bool = True, indent: int | None = 1) -> Path:
    return write_text(out, json.dumps(obj, indent=indent) + "\n", force)


def save_figure(fig, out: str | Path, dpi: int = 110) -> Path:
    """A matplotlib figure, the format from the name's suffix."""
    out = Path(out)
    with output_file(out, force=True) as f:
        fig.savefig(f, dpi=dpi, format=out.suffix.lstrip(".") or "png")
    return out


def open_log(path: str | Path):
    """A log file that is written as it goes (not atomically): a new or regular file, never
    a link or device; truncated."""
    path = Path(path)
    check_replaceable(path, True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OutputError(f"{path}: not a regular file")
    return os.fdopen(fd, "wb")
