"""Clover safetensors (HF layout, per-expert or fused, sharded or not) -> GGUF for llama.cpp.

``convert`` reads top-down:

1. validate everything before writing a byte: config, shards and index, tensor names, shapes
   and dtypes (checkpoint.Checkpoint.validate), the type rules, the importance matrix, the
   tokenizer against the config, the output path (never an input, never an existing file
   without ``force``) and the free disk space;
2. plan (tensor_plan.py): one entry per GGUF tensor with its type and size; ``dry_run`` stops here;
3. write: the GGUF header, metadata (metadata.py) and tensor infos, then the tensor data
   streamed by the pipeline (pipeline.py), into a temporary file in the output folder that
   is renamed to the output at the end and removed on any error or interruption.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint import Checkpoint, CheckpointError
from ..config import ConfigError
from ..constants import Keys
from ..outputs import OutputError, check_replaceable
from ..util import default_threads
from . import ConvertError, fingerprint
from .metadata import load_vocab, metadata
from .pipeline import Pipeline, ShardReader, TensorError
from .recipes import TypeRules
from .tensor_plan import Plan, build_plan, check_imatrix, fmt_bytes
from .writer import temporary_output, write_gguf

__all__ = ["ConvertError", "ConvertResult", "TensorError", "convert"]

# room asked for beside the tensor data: the header, key/values and tensor infos (about 6 MiB
# with a Qwen-size vocabulary of 152k tokens and their merges)
HEADER_MARGIN = 16 << 20


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
    rules: TypeRules | None = None,
    force: bool = False,
    dry_run: bool = False,
    threads: int | None = None,
    backend: str = "auto",
    progress: bool = True,
    name: str | None = None,
) -> ConvertResult:
    """Convert a Clover model dir to GGUF. See the module docstring and docs/gguf-format.md.

    outtype: f32|f16|bf16|q8_0 for non-expert 2-D weights (default bf16, or the recipe's);
    experts: q4_k|q4_0|q4_1|iq4_nl|iq4_xs|mxfp4|q5_k|q6_k|q8_0|bf16 (default q4_k);
    tensor_types: ["REGEX=TYPE", ...] or [(regex, type)], first match wins;
    recipe: a name in recipes.RECIPES; imatrix: path to a llama.cpp GGUF imatrix;
    rules: explicit type rules instead of outtype/experts/tensor_types/recipe (a budget recipe,
    ``--recipe fit:SIZE``, resolved by plan.budget.budget_rules).
    """
    if threads is not None and threads < 1:
        raise ConvertError(f"--threads {threads}: must be at least 1")
    model_dir = Path(model_dir)
    ck = open_checkpoint(model_dir)
    im = _load_imatrix(imatrix) if imatrix is not None else None
    if rules is None:
        rules = _type_rules(outtype, experts, tensor_types, recipe)

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


def open_checkpoint(model_dir: Path) -> Checkpoint:
    try:
        ck = Checkpoint(model_dir)
        ck.validate()
    except (ConfigError, CheckpointError) as e:
        raise ConvertError(str(e)) from None
    return ck


def _type_rules(outtype, experts, tensor_types, recipe) -> TypeRules:
    if recipe and recipe.lower().startswith("fit:"):
        # plan sits above convert: the CLI resolves a budget recipe (plan.budget.budget_rules)
        raise ConvertError(f"--recipe {recipe}: a budget recipe; pass rules=plan.budget.budget_rules(...)")
    try:
        return TypeRules.make(outtype, experts, tensor_types, recipe)
    except ValueError as e:
        raise ConvertError(str(e)) from None


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
    if free < need + HEADER_MARGIN:
        raise ConvertError(
            f"{out.parent}: not enough disk space: {fmt_bytes(need + HEADER_MARGIN)} needed ({fmt_bytes(need)} of "
            f"tensor data and {fmt_bytes(HEADER_MARGIN)} for the header and metadata), {fmt_bytes(free)} free"
        )
