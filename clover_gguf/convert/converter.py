"""Clover safetensors (HF layout, per-expert or fused, sharded or not) -> GGUF for llama.cpp.

``convert`` reads top-down:

1. validate everything before writing a byte: config, shards and index, tensor names, shapes
   and dtypes (checkpoint.Checkpoint.validate), the type rules, the importance matrix, the
   tokenizer against the config, the output path (never an input, never an existing file
   without ``force``) and the free disk space;
2. plan (plan.py): one entry per GGUF tensor with its type and size; ``dry_run`` stops here;
3. write: the GGUF header, metadata (metadata.py) and tensor infos, then the tensor data
   streamed by the pipeline (pipeline.py), into a temporary file in the output folder that
   is renamed to the output at the end and removed on any error or interruption.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import signal
import stat
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGUFWriter
from gguf.gguf_writer import WriterState

from ..checkpoint import Checkpoint, CheckpointError
from ..config import ConfigError
from ..constants import ARCH, Keys
from ..util import default_threads
from . import ConvertError
from .metadata import load_vocab, metadata
from .pipeline import Pipeline, ShardReader, TensorError
from .plan import Plan, build_plan, check_imatrix, fmt_bytes
from .recipes import TypeRules

__all__ = ["ConvertError", "ConvertResult", "TensorError", "convert"]


@dataclass
class ConvertResult:
    plan: Plan
    out_path: Path | None
    seconds: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def gbps_in(self) -> float:
        return self.bytes_in / max(self.seconds, 1e-9) / 1e9


def convert(
    model_dir,
    out_path=None,
    outtype: str | None = None,
    experts: str | None = None,
    tensor_types=None,
    recipe: str | None = None,
    imatrix=None,
    force: bool = False,
    dry_run: bool = False,
    threads: int | None = None,
    backend: str = "auto",
    progress: bool = True,
    name: str | None = None,
    log=print,
) -> ConvertResult:
    """Convert a Clover model dir to GGUF. See the module docstring and docs/gguf-format.md.

    outtype: f32|f16|bf16|q8_0 for non-expert 2-D weights (default bf16, or the recipe's);
    experts: q4_k|q4_0|q4_1|iq4_nl|iq4_xs|mxfp4|q5_k|q6_k|q8_0|bf16 (default q4_k);
    tensor_types: ["REGEX=TYPE", ...] or [(regex, type)], first match wins;
    recipe: a name in recipes.RECIPES; imatrix: path to a llama.cpp GGUF imatrix.
    """
    if threads is not None and threads < 1:
        raise ConvertError(f"--threads {threads}: must be at least 1")
    model_dir = Path(model_dir)
    ck = _open_checkpoint(model_dir)
    im = _load_imatrix(imatrix) if imatrix is not None else None
    rules = _type_rules(outtype, experts, tensor_types, recipe, ck, im is not None, log)

    plan = build_plan(ck, rules, im, backend)
    if im is not None:
        check_imatrix(plan, im, imatrix)
    vocab, placeholder = load_vocab(model_dir, ck.config)
    result = ConvertResult(plan, Path(out_path) if out_path else None)
    if placeholder:
        result.notes.append(
            f"no tokenizer.json: wrote a byte-level placeholder vocabulary ({Keys.TOKENIZER_PLACEHOLDER} = true)"
        )
    if dry_run:
        return result
    if out_path is None:
        raise ConvertError("no output path given")
    out = Path(out_path)
    inputs = _input_files(model_dir, ck) | ({Path(imatrix).resolve()} if imatrix is not None else set())
    _check_output(out, inputs, force, plan.total_bytes)

    kv = metadata(plan, vocab, placeholder, im, name)
    t0 = time.perf_counter()
    with temporary_output(out, force, result.notes) as f, ShardReader(ck) as reader:
        write_gguf(f, plan, kv, Pipeline(plan, reader, im, threads or default_threads(), progress))
    result.seconds = time.perf_counter() - t0
    result.bytes_in = plan.src_bytes
    result.bytes_out = out.stat().st_size
    return result


# ---- validate ---------------------------------------------------------------------------


def _open_checkpoint(model_dir: Path) -> Checkpoint:
    try:
        ck = Checkpoint(model_dir)
        ck.validate()
    except (ConfigError, CheckpointError) as e:
        raise ConvertError(str(e)) from None
    return ck


def _type_rules(outtype, experts, tensor_types, recipe, ck=None, with_imatrix=False, log=print) -> TypeRules:
    from ..plan.fit import parse_fit_recipe

    try:
        budget = parse_fit_recipe(recipe)
        if budget is None:
            return TypeRules.make(outtype, experts, tensor_types, recipe)
        if outtype or experts or tensor_types:
            raise ValueError(f"--recipe {recipe} chooses every group's type: drop --outtype/--experts/--tensor-type")
        return _fit_rules(ck, recipe, budget, with_imatrix, log)
    except ValueError as e:  # PlanError is one
        raise ConvertError(str(e)) from None


def _fit_rules(ck, recipe: str, budget: int, with_imatrix: bool, log) -> TypeRules:
    """The budget recipe (plan.fit) for this checkpoint; without an imatrix, no type that needs one."""
    from ..plan import fit as F
    from ..plan.sizes import Source

    cands = F.EXPERT_CANDIDATES if with_imatrix else tuple(t for t in F.EXPERT_CANDIDATES if t != "iq2_s")
    res = F.fit_budget(Source(ck.config, str(ck.dir), str(ck.dir), ck), budget, expert_candidates=cands)
    for line in res.format().splitlines():
        log(f"fit: {line}")
    rules = res.types.rules()
    rules.recipe = recipe
    return rules


def _load_imatrix(path):
    from .imatrix import load_imatrix

    try:
        return load_imatrix(path)
    except Exception as e:  # gguf-py raises whatever a damaged file leads to
        raise ConvertError(f"{path}: cannot read the imatrix ({e})") from None


def _input_files(model_dir: Path, ck: Checkpoint) -> set[Path]:
    files = {p.resolve() for p in model_dir.iterdir() if p.is_file()}
    files |= {ck.shard_of(n).resolve() for n in ck.names()}
    return files


def _check_output(out: Path, inputs: set[Path], force: bool, need: int) -> None:
    if out.resolve() in inputs:
        raise ConvertError(f"{out}: refusing to overwrite an input file")
    if not out.parent.is_dir():
        raise ConvertError(f"{out.parent}: output folder does not exist")
    _check_replaceable(out, force)
    free = shutil.disk_usage(out.parent).free
    if free < need + (16 << 20):
        raise ConvertError(f"{out.parent}: not enough disk space ({fmt_bytes(free)} free, {fmt_bytes(need)} needed)")


def _check_replaceable(out: Path, force: bool) -> None:
    """Nothing at ``out``, or (with force) a regular file: never a device, folder, link, ..."""
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        raise ConvertError(f"{out}: is a directory")
    if not stat.S_ISREG(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        raise ConvertError(f"{out}: exists and is {kind}; --force replaces regular files only")
    if not force:
        raise ConvertError(f"{out}: exists (use --force to overwrite)")


# ---- write ------------------------------------------------------------------------------


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


def _lock_temporary(tmp: Path, out: Path, notes: list[str]) -> int:
    """Open ``tmp`` exclusively locked (flock; the kernel releases it when a process dies, so a
    killed conversion never blocks the next one) and empty; names a stale one it clears."""
    for _ in range(100):
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConvertError(
                f"{out}: another conversion is writing it (its temporary file {tmp} is locked)"
            ) from None
        st = os.fstat(fd)
        try:
            same = os.stat(tmp).st_ino == st.st_ino
        except FileNotFoundError:
            same = False
        if not same or st.st_nlink > 1:
            # published (or being published) by another run after we opened it: start over
            if same:
                tmp.unlink(missing_ok=True)
            os.close(fd)
            continue
        if st.st_size:
            notes.append(f"removed {tmp}, a temporary file ({fmt_bytes(st.st_size)}) left by an interrupted conversion")
            os.ftruncate(fd, 0)
        return fd
    raise ConvertError(f"{out}: could not lock {tmp}")


def _publish(tmp: Path, out: Path, force: bool) -> None:
    """Give the finished temporary file the final name: with force, replacing a regular file;
    without, only if the name is still free (a hard link fails when it exists, so of two
    conversions to the same path one wins whole and the other fails cleanly)."""
    if force:
        _check_replaceable(out, True)
        os.replace(tmp, out)
        return
    try:
        os.link(tmp, out)
    except FileExistsError:
        raise ConvertError(
            f"{out}: created by another process during this conversion; not replaced (use --force to overwrite)"
        ) from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        _check_replaceable(out, False)  # no hard links on this filesystem: check, then rename
        os.replace(tmp, out)
        return
    os.unlink(tmp)


@contextmanager
def temporary_output(out: Path, force: bool = False, notes: list[str] | None = None) -> Iterator:
    """A file open for writing under a temporary name in ``out``'s folder (locked: one
    conversion per output at a time), published as ``out`` when the block completes and
    removed when it fails or is interrupted (SIGTERM included). A SIGKILL leaves only the
    temporary file, which the next conversion to ``out`` removes and names in ``notes``."""
    tmp = out.with_name(f".{out.name}.convert.tmp")
    try:
        fd = _lock_temporary(tmp, out, notes if notes is not None else [])
    except OSError as e:
        raise ConvertError(f"{out}: cannot create a temporary file in its folder ({e.strerror or e})") from None
    f = os.fdopen(fd, "wb")
    try:
        with _signals_for_writing():
            yield f
            f.flush()
            os.fsync(f.fileno())
            _publish(tmp, out, force)
        f.close()  # releases the lock, after the publish
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        try:
            f.close()
        except OSError:
            pass
        if isinstance(exc, TensorError):
            exc.output = out
            raise
        if isinstance(exc, KeyboardInterrupt):
            exc.add_note("no output written")
            raise
        if isinstance(exc, ConvertError):
            raise
        if isinstance(exc, OSError):
            raise ConvertError(f"{out}: {exc.strerror or exc}; no output written") from exc
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
