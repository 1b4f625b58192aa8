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

import os
import shutil
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
    model_dir = Path(model_dir)
    ck = _open_checkpoint(model_dir)
    rules = _type_rules(outtype, experts, tensor_types, recipe)
    im = _load_imatrix(imatrix) if imatrix is not None else None

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
    with temporary_output(out) as f, ShardReader(ck) as reader:
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


def _type_rules(outtype, experts, tensor_types, recipe) -> TypeRules:
    try:
        return TypeRules.make(outtype, experts, tensor_types, recipe)
    except ValueError as e:
        raise ConvertError(str(e)) from None


def _load_imatrix(path):
    from .imatrix import load_imatrix

    try:
        return load_imatrix(path)
    except (OSError, ValueError) as e:
        raise ConvertError(f"{path}: cannot read the imatrix ({e})") from None


def _input_files(model_dir: Path, ck: Checkpoint) -> set[Path]:
    files = {p.resolve() for p in model_dir.iterdir() if p.is_file()}
    files |= {ck.shard_of(n).resolve() for n in ck.names()}
    return files


def _check_output(out: Path, inputs: set[Path], force: bool, need: int) -> None:
    if out.resolve() in inputs:
        raise ConvertError(f"{out}: refusing to overwrite an input file")
    if out.is_dir():
        raise ConvertError(f"{out}: is a directory")
    if not out.parent.exists():
        raise ConvertError(f"{out.parent}: output folder does not exist")
    if out.exists() and not force:
        raise ConvertError(f"{out}: exists (use --force to overwrite)")
    free = shutil.disk_usage(out.parent).free
    if free < need + (16 << 20):
        raise ConvertError(f"{out.parent}: not enough disk space ({fmt_bytes(free)} free, {fmt_bytes(need)} needed)")


# ---- write ------------------------------------------------------------------------------


@contextmanager
def temporary_output(out: Path) -> Iterator:
    """A file open for writing under a temporary name in ``out``'s folder, renamed to
    ``out`` when the block completes and removed when it fails or is interrupted."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    f = open(tmp, "wb")
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, out)
    except BaseException as exc:
        f.close()
        tmp.unlink(missing_ok=True)
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
