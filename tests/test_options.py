"""Every numeric option of every command is range-checked against one table (options.py) by
click, before any work (issue 26, item 2): one line naming the option, a non-zero exit."""

import click
import pytest
from click.testing import CliRunner
from testdata import TINY, VECTORS

from clover_gguf.cli import cli
from clover_gguf.options import GGML_MAX_N_THREADS, RANGES, Finite
from clover_gguf.reference.generate import GenerationConfig

VEC = VECTORS / "random-clover"


def _commands(group: click.Group, prefix=()):
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*prefix, name))
        else:
            yield (*prefix, name), cmd


def _bounded(p: click.Parameter) -> bool:
    t = p.type
    if isinstance(t, Finite):
        return True
    if isinstance(t, click.IntRange | click.FloatRange):
        return t.min is not None and t.max is not None
    return False


def test_every_numeric_option_has_a_range():
    """No bare int/float option is left (serve's -t, -c, --port and -ngl were bare ints), and
    every bounded one is bounded on both sides (--top-k had no upper bound and wrapped at 2^32)."""
    loose = []
    for path, cmd in _commands(cli):
        for p in cmd.params:
            numeric = isinstance(p.type, click.types.IntParamType | click.types.FloatParamType | Finite)
            if numeric and not _bounded(p):
                loose.append(f"{' '.join(path)} {p.opts[-1]}")
    assert loose == []


def _run(*args):
    res = CliRunner().invoke(cli, [str(a) for a in args])
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res


def _one_line(res, needle):
    assert res.exit_code == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("Error: "), res.stderr
    assert needle in res.stderr, res.stderr


@pytest.fixture(scope="module")
def tiny_gguf(converted):
    return converted(VEC)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["-t", "99999"], "'-t' / '--threads': 99999 is not in the range 1<=x<=512"),
        (["-t", "-1"], "'-t' / '--threads': -1 is not in the range 1<=x<=512"),
        (["-ngl", "-5"], "'-ngl' / '--n-gpu-layers': -5 is not in the range -1<=x<=1024"),
        (["-c", "-5"], "'-c' / '--ctx-size': -5 is not in the range 0<=x<=1073741824"),
        (["-c", "1e12"], "'-c' / '--ctx-size': '1e12' is not a valid integer"),
        (["-c", "1000000000000"], "'-c' / '--ctx-size': 1000000000000 is not in the range"),
        (["--port", "-1"], "'--port': -1 is not in the range 1<=x<=65535"),
        (["--port", "65536"], "'--port': 65536 is not in the range 1<=x<=65535"),
        (["--ctx-cache", "-1"], "'--ctx-cache': -1 is not in the range 0<=x<=4096"),
        (["--queue-timeout", "nan"], "'--queue-timeout': nan is not a finite number in [0, 86400]"),
        (["-n", "0"], "'-n' / '--n-predict': 0 is not in the range"),
    ],
)
def test_serve_options(tiny_gguf, args, needle):
    """Issue 26 defect 2: `serve -t 99999` segfaulted on its first request; --port -1/65536 were an
    OverflowError traceback; -t -1, -ngl -5, -c -5 were taken."""
    _one_line(_run("serve", tiny_gguf, *args), needle)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--top-k", "4294967301"], "'--top-k': 4294967301 is not in the range 0<=x<=2147483647"),
        (["--seed", "4294967296"], "'--seed': 4294967296 is not in the range 0<=x<=4294967295"),
        (["-t", "513"], "'-t' / '--threads': 513 is not in the range 1<=x<=512"),
        (["-ngl", "-2"], "'-ngl' / '--n-gpu-layers': -2 is not in the range"),
        (["--block-size", "1025"], "'--block-size': 1025 is not in the range 1<=x<=1024"),
    ],
)
def test_run_options(tiny_gguf, args, needle):
    _one_line(_run("run", tiny_gguf, "--prompt-ids", "1", *args), needle)


@pytest.mark.parametrize(
    "cmd,args,needle",
    [
        (["convert", VEC, "-o", "x.gguf"], ["-t", "0"], "'-t' / '--threads': 0 is not in the range 1<=x<=512"),
        (["imatrix", VEC, "-f", TINY / "README.md", "-o", "x"], ["--seed", "-1"], "'--seed': -1 is not in the range"),
        (["synth", "x", "--preset", "clover-tiny"], ["--seed", "4294967296"], "'--seed': 4294967296"),
        (["plan", "--shape", "clover-tiny"], ["--context", "0"], "'--context': 0 is not in the range"),
        (["eval", "agent", "--url", "http://127.0.0.1:1"], ["--repeats", "0"], "'--repeats': 0 is not in the range"),
        (["eval", "agent", "--url", "http://127.0.0.1:1"], ["-t", "-1"], "'-t' / '--threads': -1 is not in the range"),
        (["eval", "passes"], ["--threads", "1,9999"], "'1,9999': each must be an integer in [1, 512]"),
        (["eval", "passes"], ["--layers", "0"], "'0': each must be an integer in [1, 512]"),
        (["runtime", "build"], ["-j", "0"], "'--jobs' / '-j': 0 is not in the range"),
    ],
)
def test_other_commands_options(cmd, args, needle):
    _one_line(_run(*cmd, *args), needle)


def test_generation_config_bounds_top_k_and_seed():
    """top_k and seed go to int32/uint32 fields of clover_gen_params: a larger value wrapped."""
    for bad, msg in [
        (dict(top_k=2**32 + 5), "top_k 4294967301: must be an integer in [0, 2147483647]"),
        (dict(seed=2**32), "seed 4294967296: must be an integer in [0, 4294967295]"),
        (dict(seed=-1), "seed -1"),
        (dict(max_new_tokens=2**31), "max_new_tokens 2147483648"),
    ]:
        with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            GenerationConfig(**bad).validate()
    GenerationConfig(top_k=2**31 - 1, seed=2**32 - 1).validate()


def test_runtime_refuses_more_threads_than_ggml_holds(tiny_gguf):
    from clover_gguf.runtime.runtime import CloverRuntime

    with pytest.raises(ValueError, match=f"n_threads 99999: must be an integer in \\[1, {GGML_MAX_N_THREADS}\\]"):
        CloverRuntime(tiny_gguf, n_threads=99999)
    assert RANGES["threads"].hi == GGML_MAX_N_THREADS


def test_serve_function_checks_the_table(tiny_gguf):
    pytest.importorskip("uvicorn")
    from clover_gguf.serve import serve

    with pytest.raises(ValueError, match="--port 65536: must be an integer in \\[1, 65535\\]"):
        serve(tiny_gguf, port=65536)


def test_block_size_1024_runs_on_a_gguf(tmp_path, converted):
    """Issue 26 defect 10: `--block-size 1024` was taken by the CLI and refused later by run and
    eval ("block_size 1024 > n_ubatch 256"; eval after scoring the reference): the runtime's
    batch now holds the block asked for."""
    import json

    g = converted(TINY)
    res = _run("run", g, "-p", "import os", "--block-size", "1024", "-n", "8", "-t", "1", "--json")
    assert res.exit_code == 0, res.stderr
    assert len(json.loads(res.stdout)["token_ids"]) == 8
    corpus = tmp_path / "c.txt"
    corpus.write_text((TINY / "README.md").read_text() * 4)
    res = _run(
        "eval", "quality", "--reference", TINY, g, "--corpus", corpus, "--block-size", "1024", "--windows", "1",
        "--blocks", "1", "--no-generation", "--out", tmp_path / "q", "--threads", "1", "--backend", "runtime",
    )  # fmt: skip
    assert res.exit_code == 0, res.stderr
    q = json.loads((tmp_path / "q" / "quality.json").read_text())
    assert q["config"]["block_size"] == 1024 and q["models"][0]["providers"]["runtime"]


def test_prompt_and_prompt_ids_together_are_refused(tiny_gguf):
    """Issue 26 judgement call: `-p` with `--prompt-ids` used the ids silently."""
    _one_line(_run("run", tiny_gguf, "-p", "hi", "--prompt-ids", "1"), "give -p/--prompt or --prompt-ids, not both")


def test_serve_port_in_use_is_one_line_before_the_model_loads(tiny_gguf):
    """uvicorn's own failure (port in use) printed several lines after the load."""
    import socket
    import time

    pytest.importorskip("uvicorn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.time()
        res = CliRunner().invoke(cli, ["serve", str(tiny_gguf), "--port", str(port)])
    assert res.exit_code == 1 and res.stderr.count("\n") == 1, res.stderr
    assert f"--host 127.0.0.1 --port {port}: Address already in use" in res.stderr and time.time() - t0 < 10
    res = CliRunner().invoke(cli, ["serve", str(tiny_gguf), "--host", "no-such-host.invalid"])
    assert res.exit_code == 1 and res.stderr.startswith("Error: --host no-such-host.invalid: "), res.stderr


def test_run_adds_bos_as_the_gguf_says_like_llama_clover_cli(tmp_path, converted):
    """Issue 26 judgement call: a GGUF with add_bos_token = 2 (a bool byte llama.cpp reads as
    true) made llama-clover-cli prepend BOS and `run` not. `run` now tokenizes as the CLI does
    (llama_tokenize with add_special), so both give the same tokens."""
    import json
    import subprocess
    from pathlib import Path

    from clover_gguf.gguf_io import codec
    from clover_gguf.runtime.build import runtime_paths

    g = tmp_path / "tiny.gguf"
    gg = codec.parse(converted(TINY).read_bytes())
    kv = next(kv for kv in gg.kvs if kv.key == b"tokenizer.ggml.add_bos_token")
    kv.value = 2
    g.write_bytes(codec.serialize(gg)[0])
    res = _run("run", g, "-p", "import os", "-n", "16", "-t", "1", "--json")
    assert res.exit_code == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["prompt_ids"][0] == 0  # clover-tiny's BOS (<|endoftext|>, id 0)
    cli_bin = Path(runtime_paths()["bin_dir"]) / "llama-clover-cli"
    r = subprocess.run(
        [str(cli_bin), "-m", str(g), "-p", "import os", "-n", "16", "-t", "1", "--verbose-prompt"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "\nprompt ids: " + " ".join(map(str, out["prompt_ids"])) + "\n" in r.stdout, (r.stdout, out["prompt_ids"])
    assert "\nids: " + " ".join(map(str, out["token_ids"])) + "\n" in r.stdout, (r.stdout, out["token_ids"])
