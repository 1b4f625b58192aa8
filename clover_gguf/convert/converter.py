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

import shutil
import signal
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
from ..outputs import OutputError, check_replaceable, output_file
from ..util import default_threads
from . import ConvertError, fingerprint
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
    warnings: list[str] = field(default_factory=list)  # one per tensor with weights past the bound

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

    stand_in = fingerprint.placeholder()  # the header comes first, the weights' hash at the end
    kv = metadata(plan, vocab, placeholder, im, name, weights_sha256=stand_in)
    t0 = time.perf_counter()
    with temporary_output(out, force, result.notes) as f, ShardReader(ck) as reader:
        pipeline = Pipeline(plan, reader, im, threads or default_threads(), progress)
        write_gguf(f, plan, kv, pipeline)
        fingerprint.patch(f, stand_in, pipeline.scan.sha.hexdigest())
    result.warnings = [b.describe() for b in pipeline.scan.big.values()]
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
    try:
        check_replaceable(out, force, tag="convert")
    except OutputError as e:
        raise ConvertError(str(e)) from None
    free = shutil.disk_usage(out.parent).free
    if free < need + (16 << 20):
        raise ConvertError(f"{out.parent}: not enough disk space ({fmt_bytes(free)} free, {fmt_bytes(need)} needed)")


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
