"""The GGUF file a conversion writes: a locked temporary file in the output folder, published
whole at the end (outputs.output_file), with SIGTERM/SIGHUP unwinding it like Ctrl-C; the
header, metadata and tensor infos (gguf-py's GGUFWriter), then the data. Used by the converter
and by synthetic GGUFs (clover_gguf/synthetic.py)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from gguf import GGUFWriter
from gguf.gguf_writer import WriterState

from ..constants import ARCH
from ..outputs import OutputError, output_file
from . import ConvertError
from .pipeline import Pipeline, TensorError
from .tensor_plan import Plan


class Terminated(KeyboardInterrupt):
    """SIGTERM/SIGHUP during a conversion: unwinds like Ctrl-C so that the output is cleaned up."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_terminated(signum, frame):
    raise Terminated(signum)


@contextmanager
def _signals_for_writing():
    """In the main thread: SIGTERM/SIGHUP raise Terminated, and SIGXFSZ is ignored so that a
    file size limit surfaces as a write error (EFBIG) instead of killing the process."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    wanted = {signal.SIGTERM: _raise_terminated, signal.SIGHUP: _raise_terminated, signal.SIGXFSZ: signal.SIG_IGN}
    old = {sig: signal.signal(sig, h) for sig, h in wanted.items()}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


@contextmanager
def temporary_output(out: Path, force: bool = False, notes: list[str] | None = None) -> Iterator:
    """outputs.output_file (a new temporary file, locked, published when the block completes,
    removed on any error) with SIGTERM/SIGHUP unwinding it, and errors as ConvertError. A
    SIGKILL leaves only the temporary file, which the next conversion to ``out`` removes and
    names in ``notes``."""
    try:
        with _signals_for_writing(), output_file(out, force, notes, tag="convert") as f:
            yield f
    except TensorError as exc:
        exc.output = out
        raise
    except KeyboardInterrupt as exc:
        exc.add_note("no output written")
        raise
    except (ConvertError, OutputError) as exc:
        raise ConvertError(str(exc)) from None
    except OSError as exc:
        raise ConvertError(f"{exc.filename or out}: {exc.strerror or exc}; no output written") from exc
    except Exception as exc:
        raise ConvertError(f"{out}: {type(exc).__name__}: {exc}; no output written") from exc


def write_gguf(f, plan: Plan, kv: list[tuple], pipeline: Pipeline) -> None:
    """Header, metadata and tensor infos (gguf-py's GGUFWriter, into our open file), then the data."""
    writer = GGUFWriter(path=None, arch=ARCH)
    for k, v, t, sub in kv:
        writer.add_key_value(k, v, t, sub_type=sub)
    for e in plan.entries:
        writer.add_tensor_info(e.name, e.shape, np.dtype(np.float32), e.nbytes, raw_dtype=e.qtype)
    writer.fout, writer.state = [f], WriterState.EMPTY
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.write_padding(f, f.tell())
    pipeline.run(f, writer.data_alignment)
