"""A damaged Clover GGUF gets one line naming the key or tensor and the allowed range, with
the same words from llama-clover-cli, from CloverRuntime (`clover-gguf run`) and from the
Python GGUF reader; never an abort, never exit 0 with nothing generated. The cases are the
ones a probe of the runtime found (SIGABRTs, silent acceptance, late failures)."""

import copy
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from testdata import VECTORS

from clover_gguf.cli import cli
from clover_gguf.gguf_io import codec as F
from clover_gguf.gguf_io.reader import GGUFReadError, load_gguf_as_hf_tensors

HINT = "(does the runtime include patches/0007 and native/? `clover-gguf runtime build` rebuilds it)"


@pytest.fixture(scope="module")
def base(converted):
    return F.parse(converted(VECTORS / "random-clover").read_bytes())


@pytest.fixture(scope="module")
def cli_bin():
    from clover_gguf.runtime.build import runtime_paths

    return Path(runtime_paths()["bin_dir"]) / "llama-clover-cli"


def _kv(g, key):
    return next(kv for kv in g.kvs if kv.key == key.encode())


def _set(key, value, vtype=None):
    def f(g):
        kv = _kv(g, key)
        kv.value = value
        if vtype is not None:
            kv.type = vtype

    return f


def _dup_token(g):
    sub, toks = _kv(g, "tokenizer.ggml.tokens").value
    toks[40] = toks[30]


def _shape(g):
    ti = next(t for t in g.tis if t.name == b"blk.0.attn_k.weight")  # [64, 32] -> [32, 64]: same bytes
    ti.dims = ti.dims[::-1]


CASES = [
    (
        _set("clover.attention.layer_norm_rms_epsilon", math.nan),
        "clover.attention.layer_norm_rms_epsilon = nan: must be a finite number in (0, 1]",
    ),
    (
        _set("clover.attention.layer_norm_rms_epsilon", -1e-6),
        "clover.attention.layer_norm_rms_epsilon = -1e-06: must be a finite number in (0, 1]",
    ),
    (
        _set("clover.attention.layer_norm_rms_epsilon", math.inf),
        "clover.attention.layer_norm_rms_epsilon = inf: must be a finite number in (0, 1]",
    ),
    (_set("tokenizer.ggml.model", b"none"), "tokenizer.ggml.model = 'none': must be 'gpt2'"),
    (
        _set("clover.diffusion.block_size", 10**9),
        "clover.diffusion.block_size = 1000000000: must be an integer in [1, 1024]",
    ),
    (
        _set("clover.diffusion.block_size", 2**32 - 1),
        "clover.diffusion.block_size = 4294967295: must be an integer in [1, 1024]",
    ),
    (_dup_token, "tokenizer.ggml.tokens: token 40 repeats token 30"),
    (_set("clover.rope.freq_base", math.nan), "clover.rope.freq_base = nan: must be a finite number in [1, 1e+12]"),
    (_set("clover.rope.freq_base", 0.0), "clover.rope.freq_base = 0: must be a finite number in [1, 1e+12]"),
    (_set("clover.rope.freq_base", -1.0), "clover.rope.freq_base = -1: must be a finite number in [1, 1e+12]"),
    (_set("clover.vocab_size", 0), "clover.vocab_size = 0: must be an integer in [1, 16777216]"),
    (
        _set("clover.vocab_size", 7),
        "clover.vocab_size = 7: must equal the number of tokens in tokenizer.ggml.tokens (97)",
    ),
    (
        _set("clover.vocab_size", 9000),
        "clover.vocab_size = 9000: must equal the number of tokens in tokenizer.ggml.tokens (97)",
    ),
    (_set("clover.context_length", 0), "clover.context_length = 0: must be an integer in [1, 1073741824]"),
    (_set("clover.context_length", 1), "clover.context_length = 1: must be at least clover.diffusion.block_size (8)"),
    (_set("clover.context_length", 4), "clover.context_length = 4: must be at least clover.diffusion.block_size (8)"),
    (_set("tokenizer.ggml.mask_token_id", 97), "tokenizer.ggml.mask_token_id = 97: must be a token id in [0, 96]"),
    (_set("clover.block_count", 2.0, F.F32), "clover.block_count has type f32, expected u32"),
    (
        _set("clover.attention.head_count_kv", 3),
        "clover.attention.head_count_kv = 3: must divide clover.attention.head_count (4)",
    ),
    (_set("clover.expert_used_count", 9), "clover.expert_used_count = 9: must be at most clover.expert_count (4)"),
    (
        _set("clover.memory.l2norm_epsilon", math.inf),
        "clover.memory.l2norm_epsilon = inf: must be a finite number in (0, 1]",
    ),
    (_set("tokenizer.ggml.bos_token_id", -1, F.I32), "tokenizer.ggml.bos_token_id has type i32, expected u32"),
]


def _write(tmp_path, base, edit):
    g = copy.deepcopy(base)
    edit(g)
    p = tmp_path / "bad.gguf"
    p.write_bytes(F.serialize(g)[0])
    return p


def _run_cli(cli_bin, path, *extra):
    n = [] if "-n" in extra else ["-n", "8"]  # common's parser warns about an option given twice
    return subprocess.run(
        [str(cli_bin), "-m", str(path), "--prompt-ids", "1,2,3", *n, "-t", "1", *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _python_reason(path):
    from clover_gguf.runtime.runtime import CloverRuntime, RuntimeLoadError

    with pytest.raises(RuntimeLoadError) as e:
        CloverRuntime(path, n_threads=1)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg, msg
    return msg[len(f"{path}: ") :]


@pytest.mark.parametrize("edit,message", CASES, ids=[m.split(":")[0][:40] + f"-{i}" for i, (_, m) in enumerate(CASES)])
def test_bad_metadata_is_one_line_everywhere(tmp_path, base, cli_bin, edit, message):
    path = _write(tmp_path, base, edit)
    r = _run_cli(cli_bin, path)
    assert r.returncode == 1, f"{HINT}\n{r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    assert r.stderr == f"error: {path}: {message}\n", f"{HINT}\n{r.stderr[-3000:]}"
    assert _python_reason(path) == message
    with pytest.raises(GGUFReadError) as e:
        load_gguf_as_hf_tensors(path)
    assert str(e.value) == f"{path}: {message}"


def test_tensor_shape_against_the_metadata(tmp_path, base, cli_bin):
    path = _write(tmp_path, base, _shape)
    msg = "tensor 'blk.0.attn_k.weight' has shape [32, 64, 1, 1], the metadata implies [64, 32, 1, 1]"
    r = _run_cli(cli_bin, path)
    assert r.returncode == 1 and r.stderr == f"error: {path}: {msg}\n", f"{HINT}\n{r.stderr[-3000:]}"
    assert _python_reason(path) == msg
    with pytest.raises(
        GGUFReadError, match=r"tensor blk\.0\.attn_k\.weight has shape \[64, 32\], the metadata implies"
    ):
        load_gguf_as_hf_tensors(path)


def test_nan_weights_fail_the_load(tmp_path, base, cli_bin):
    """A NaN in a weight: refused at load (tensor data check), not generated from."""
    g = copy.deepcopy(base)
    ti = next(t for t in g.tis if t.name == b"blk.1.ssm_dt.bias")  # F32
    data = bytearray(g.data)
    data[ti.offset : ti.offset + 4] = struct.pack("<f", math.nan)
    g.data = bytes(data)
    path = tmp_path / "nan.gguf"
    path.write_bytes(F.serialize(g)[0])
    msg = "tensor 'blk.1.ssm_dt.bias' has invalid data (NaN or Inf)"
    r = _run_cli(cli_bin, path)
    assert r.returncode == 1 and r.stderr == f"error: {path}: {msg}\n", f"{HINT}\n{r.stderr[-3000:]}"
    assert _python_reason(path) == msg
    with pytest.raises(GGUFReadError, match=r"tensor blk\.1\.ssm_dt\.bias has non-finite values"):
        load_gguf_as_hf_tensors(path)


def test_clover_gguf_run_shows_the_reason(tmp_path, base):
    path = _write(tmp_path, base, CASES[0][0])
    res = CliRunner().invoke(cli, ["run", str(path), "--prompt-ids", "1,2"])
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert res.output == f"Error: {path}: {CASES[0][1]}\n", res.output
    # and a subprocess, as users run it: one line on stderr
    r = subprocess.run(
        [sys.executable, "-m", "clover_gguf.cli", "run", str(path), "--prompt-ids", "1"], capture_output=True, text=True
    )
    assert r.returncode == 1 and r.stderr == f"Error: {path}: {CASES[0][1]}\n", r.stderr


def test_debug_shows_llama_cpp_log(tmp_path, base):
    path = _write(tmp_path, base, CASES[0][0])
    r = subprocess.run(
        [sys.executable, "-m", "clover_gguf.cli", "run", str(path), "--prompt-ids", "1", "--debug"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and "llama_model_load: error loading model" in r.stderr
    assert r.stderr.count("\n") > 5 and r.stderr.endswith(f"Error: {path}: {CASES[0][1]}\n")


@pytest.mark.parametrize(
    "args,message",
    [
        (["-n", "0"], "error: -n 0: must be an integer in [1, 16777216]"),
        (["-n", "-1"], "error: -n -1: must be an integer in [1, 16777216]"),
        (["--temp", "nan"], "error: --temp nan: must be a finite number in [0, 100]"),
        (["--top-p", "0"], "error: --top-p 0: must be a finite number in (0, 1]"),
        (["--diffusion-threshold", "1.5"], "error: --diffusion-threshold 1.5: must be a finite number in [0, 1]"),
        (
            ["--diffusion-block-length", "100000"],
            "error: --diffusion-block-length 100000: must be an integer in [0, 1024]",
        ),
        (["--diffusion-steps", "0"], "error: --diffusion-steps 0: must be an integer in [1, 16777216]"),
        (["-ub", "99999"], "error: -ub 99999: must be an integer in [0, 16384]"),
        (["-p", "x"], "error: give a prompt: -p PROMPT (or -f FILE) or --prompt-ids, one of them"),
        (["-n", "300000"], "more than the model's context length (262144)"),
    ],
)
def test_cli_options_are_range_checked(tmp_path, base, cli_bin, args, message):
    """What common's parser reads but does not range-check is one line naming the option."""
    path = tmp_path / "ok.gguf"
    path.write_bytes(F.serialize(base)[0])
    r = _run_cli(cli_bin, path, *args)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and message in r.stderr, f"{HINT}\n{r.stderr[-2000:]}"


@pytest.mark.parametrize(
    "args,option",
    [
        (["-n", "abc"], "-n"),
        (["-ub", "99999999999999999999"], "-ub"),
        (["--diffusion-threshold", "x"], "--diffusion-threshold"),
    ],
)
def test_cli_values_common_cannot_read_name_the_option(tmp_path, base, cli_bin, args, option):
    """A value common's parser cannot read is its error: the option named, then its usage line,
    exit 1 (llama.cpp's tools all answer so)."""
    path = tmp_path / "ok.gguf"
    path.write_bytes(F.serialize(base)[0])
    r = _run_cli(cli_bin, path, *args)
    assert r.returncode == 1 and r.stderr.startswith(f'error while handling argument "{option}"'), r.stderr[-2000:]


def test_cli_bad_override_regex_is_one_line(tmp_path, base, cli_bin):
    path = tmp_path / "ok.gguf"
    path.write_bytes(F.serialize(base)[0])
    r = _run_cli(cli_bin, path, "-ot", "(=CPU")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "(" in r.stderr, r.stderr[-2000:]


def test_unparsable_gguf_names_the_parser_error(tmp_path, base, cli_bin):
    """A tensor that grows past the next one: ggml's GGUF parser refuses it; its reason is the line."""
    g = copy.deepcopy(base)
    ti = next(t for t in g.tis if t.name == b"blk.0.attn_q.weight")
    ti.dims = [ti.dims[0], ti.dims[1] + 1]
    path = tmp_path / "bad.gguf"
    path.write_bytes(F.serialize(g)[0])
    r = _run_cli(cli_bin, path)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    reason = r.stderr[len(f"error: {path}: ") :].strip()
    assert "failed to load model from" not in reason and reason == _python_reason(path), r.stderr


def test_cli_prompt_ids_must_be_in_the_vocabulary(tmp_path, base, cli_bin):
    path = tmp_path / "ok.gguf"
    path.write_bytes(F.serialize(base)[0])
    r = subprocess.run([str(cli_bin), "-m", str(path), "--prompt-ids", "1,99999"], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr == "error: --prompt-ids 1,99999: token 99999 is not an id in [0, 96]\n"
    r = _run_cli(cli_bin, path, "--no-perf")  # the unmutated file runs, and says nothing else
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_a_last_tensor_retyped_to_a_smaller_type_is_refused(tmp_path, base):
    """Issue 47: output.weight, the last tensor, retyped to a type of fewer bytes loaded and
    generated garbage: ggml's parser checks each tensor's offset against the one before, and
    llama.cpp's loader that the data ends within the file, so the bytes a smaller type leaves
    over at the end pass both (llama-clover-cli still loads such a file). CloverRuntime and the
    Python reader refuse it, naming the tensor. Its bytes are zeroed here, finite in any type:
    the NaN check that happens to catch most random reinterpretations does not."""
    g = copy.deepcopy(base)
    ti = g.tis[-1]
    assert ti.name == b"output.weight" and ti.type == 30  # BF16
    off, n = F.tensor_span(ti)
    ti.type = 8  # Q8_0: 34 bytes per 32 weights, where BF16 has 64
    g.data = g.data[:off] + bytes(len(g.data) - off)
    path = tmp_path / "retyped.gguf"
    path.write_bytes(F.serialize(g)[0])
    q8 = F.tensor_span(ti)[1]
    msg = (
        f"tensor 'output.weight' of type q8_0 and shape {ti.dims} takes {q8} bytes, but {len(g.data) - off} "
        "follow its offset to the end of the file: its type does not match its data"
    )
    assert q8 < n <= len(g.data) - off
    assert _python_reason(path) == msg
    with pytest.raises(GGUFReadError) as e:
        load_gguf_as_hf_tensors(path)
    assert str(e.value) == f"{path}: {msg}"
    r = subprocess.run(
        [sys.executable, "-m", "clover_gguf.cli", "run", str(path), "--prompt-ids", "1,2"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and r.stderr == f"Error: {path}: {msg}\n", r.stderr
    ti.type = 30  # the same bytes with their own type load
    ok = tmp_path / "ok.gguf"
    ok.write_bytes(F.serialize(g)[0])
    from clover_gguf.runtime.runtime import CloverRuntime

    CloverRuntime(ok, n_threads=1).close()


def test_a_prompt_that_gives_no_tokens_is_refused_as_llama_clover_cli_does(tmp_path, converted, cli_bin):
    """Issue 47: on a GGUF whose token strings are not UTF-8 the prompt tokenizes to nothing;
    `clover-gguf run` generated from the empty prompt (exit 0) where llama-clover-cli refuses.
    Now both refuse in the same words."""
    from testdata import TINY

    g = F.parse(converted(TINY).read_bytes())
    sub, toks = _kv(g, "tokenizer.ggml.tokens").value
    _kv(g, "tokenizer.ggml.tokens").value = (sub, [t if i < 6 else b"\xff\xfe%d" % i for i, t in enumerate(toks)])
    path = tmp_path / "not-utf8.gguf"
    path.write_bytes(F.serialize(g)[0])
    r = subprocess.run(
        [str(cli_bin), "-m", str(path), "-p", "def f(x):", "-n", "8", "-t", "1"], capture_output=True, text=True
    )
    assert r.returncode == 1 and r.stderr == "error: -p: the prompt gives no tokens\n", r.stderr[-2000:]
    r = subprocess.run(
        [sys.executable, "-m", "clover_gguf.cli", "run", str(path), "-p", "def f(x):", "-n", "8", "--threads", "1"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and r.stderr == "Error: -p: the prompt gives no tokens\n", r.stderr[-2000:]
    assert r.stdout == ""
