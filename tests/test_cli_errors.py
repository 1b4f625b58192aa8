"""Every bad option or input of `clover-gguf run` and `clover-gguf inspect` is one line and a
non-zero exit, on a model folder (PyTorch reference) and on a GGUF (llama.cpp): no traceback,
no MemoryError, never exit 0 with nothing generated."""

import subprocess
import sys

import pytest
from click.testing import CliRunner
from testdata import TINY, VECTORS

from clover_gguf.cli import cli

VEC = VECTORS / "random-clover"


class _Result:
    def __init__(self, returncode, stderr):
        self.returncode, self.stderr = returncode, stderr


def _run(*args):
    """In-process (fast): the CLI's exit code and stderr, as a subprocess would see them."""
    res = CliRunner().invoke(cli, list(args))
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception  # a traceback: the test fails with it
    return _Result(res.exit_code, res.stderr.encode())


def _one_line(r, needle):
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode != 0 and "Traceback" not in err, err[-3000:]
    assert err.count("\n") == 1 and err.startswith("Error: "), err[-3000:]
    assert needle in err, err
    return err


@pytest.fixture(scope="module")
def vec_gguf(converted):
    return converted(VEC)


OPTION_CASES = [
    (["--prompt-ids", "1", "--temp", "nan"], "Invalid value for '--temp': nan is not a finite number in [0, 100]"),
    (["--prompt-ids", "1", "--top-p", "0"], "'--top-p': 0 is not a finite number in (0, 1]"),
    (["--prompt-ids", "1", "--threshold", "inf"], "'--threshold': inf is not a finite number in [0, 1]"),
    (["--prompt-ids", "1", "-n", "99999999999"], "99999999999 is not in the range 1<=x<=16777216"),
    (["--prompt-ids", "1", "-n", "abc"], "'abc' is not a valid integer"),
    (["--prompt-ids", "1", "--block-size", "-3"], "'--block-size': -3 is not in the range 1<=x<=1024"),
    (["--prompt-ids", "1", "--threads", "-3"], "-3 is not in the range 1<=x<=512"),
    (["--prompt-ids", "1", "--seed", "-1"], "-1 is not in the range 0<=x<=4294967295"),
    (["--prompt-ids", "1,x"], "token ids must be integers"),
]


@pytest.mark.parametrize("args,needle", OPTION_CASES)
def test_run_options_on_a_gguf(vec_gguf, args, needle):
    _one_line(_run("run", str(vec_gguf), *args), needle)


@pytest.mark.parametrize(
    "model,args,needle",
    [
        ("gguf", ["--prompt-ids", "99999"], "--prompt-ids: token 99999 is not an id in [0, 96]"),
        ("gguf", ["--prompt-ids", "-5"], "--prompt-ids: token -5 is not an id in [0, 96]"),
        ("gguf", ["--prompt-ids", "1", "-n", "300000"], "more than the model's context length (262144)"),
        ("folder", ["--prompt-ids", "99999"], "--prompt-ids: token 99999 is not an id in [0, 96]"),
        ("folder", ["--prompt-ids", "-5"], "--prompt-ids: token -5 is not an id in [0, 96]"),
        ("folder", ["--prompt-ids", "1", "-n", "300000"], "more than the model's context length (262144)"),
        ("folder", ["--prompt-ids", "1", "--temp", "nan"], "nan is not a finite number"),
        ("folder", ["--prompt-ids", "1", "--steps", "9"], "steps 9: must be an integer in [1, 8] (the block size)"),
        ("folder", ["-p", "hi"], "no tokenizer.json; pass token ids instead of a text prompt"),
    ],
)
def test_run_inputs(vec_gguf, model, args, needle):
    _one_line(_run("run", str(vec_gguf if model == "gguf" else VEC), *args), needle)


def test_run_non_utf8_prompt_on_the_tokenizer_model():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "clover_gguf.cli",
            "run",
            str(TINY),
            "-p",
            b"caf\xe9".decode("utf-8", "surrogateescape"),
        ],
        capture_output=True,
        timeout=300,
    )
    _one_line(r, "-p: the prompt is not valid UTF-8 (byte 3)")


def test_run_refuses_a_prompt_that_gives_no_tokens():
    """llama-clover-cli's rule and words, on a model folder as on a GGUF (issue 47; the GGUF case,
    token strings that match nothing, is in tests/runtime/test_load_errors.py)."""
    _one_line(_run("run", str(TINY), "-p", "", "-n", "4"), "-p: the prompt gives no tokens")


def test_run_missing_gguf_and_folder(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")  # truncated
    _one_line(_run("run", str(tmp_path / "x.gguf"), "--prompt-ids", "1"), str(tmp_path / "x.gguf"))
    _one_line(_run("run", str(tmp_path), "--prompt-ids", "1"), "config file not found")


@pytest.mark.parametrize(
    "content,needle",
    [
        (b"GGUF\x03\x00\x00\x00", "not a valid GGUF file"),
        (b"not a gguf at all", "not a valid GGUF file"),
        (b"", "not a valid GGUF file"),
    ],
)
def test_inspect_broken_files(tmp_path, content, needle):
    p = tmp_path / "x.gguf"
    p.write_bytes(content)
    _one_line(_run("inspect", str(p)), needle)


def test_inspect_truncated_gguf(tmp_path, vec_gguf):
    raw = vec_gguf.read_bytes()
    for n in (24, 200, 5000, len(raw) // 2):
        p = tmp_path / f"t{n}.gguf"
        p.write_bytes(raw[:n])
        _one_line(_run("inspect", str(p)), str(p))
