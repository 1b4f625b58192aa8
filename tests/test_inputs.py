"""Only regular files are opened as inputs (issue 26, defect 9): a FIFO or device given as a
model's weights, an index shard, a tokenizer file, an imatrix, a corpus, a calibration text or
a GGUF is refused in one line naming it, instead of blocking for ever; and `eval quality
--windows/--blocks` are checked against what the corpus holds before the reference loads."""

import os
import shutil
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from testdata import TINY, VECTORS

from clover_gguf.cli import cli

VEC = VECTORS / "random-clover"


class Fifo:
    """A FIFO at ``path``; if a command is still blocked on it after ``after`` seconds (the old
    behaviour), it is fed junk and closed, so the test fails instead of hanging."""

    def __init__(self, path: Path, after: float = 20.0):
        self.path = Path(path)
        os.mkfifo(self.path)
        self.done = threading.Event()
        self.fed = False
        threading.Thread(target=self._unblock, args=(after,), daemon=True).start()

    def _unblock(self, after):
        if self.done.wait(after):
            return
        self.fed = True
        fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK)
        try:
            os.write(fd, b"junk")
        finally:
            os.close(fd)

    def close(self):
        self.done.set()


@pytest.fixture
def fifo():
    made = []

    def make(path):
        f = Fifo(path)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def _cli(*args):
    t0 = time.time()
    res = CliRunner().invoke(cli, [str(a) for a in args])
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    res.seconds = time.time() - t0
    return res


def _refused(res, needle, fifo=None):
    assert fifo is None or not fifo.fed, "the command blocked on the FIFO"
    assert res.exit_code != 0, res.output
    assert "Traceback" not in res.stderr and res.stderr.count("Error: ") == 1, res.stderr
    last = res.stderr.rstrip("\n").split("\n")[-1]
    assert last.startswith("Error: ") and needle in last, res.stderr


def _model_copy(tmp_path, src=VEC):
    m = tmp_path / "m"
    shutil.copytree(src, m)
    return m


@pytest.mark.parametrize("command", ["convert", "inspect", "run"])
def test_fifo_as_model_safetensors(tmp_path, fifo, command):
    m = _model_copy(tmp_path)
    (m / "model.safetensors").unlink()
    f = fifo(m / "model.safetensors")
    args = {
        "convert": ["convert", m, "-o", tmp_path / "o.gguf"],
        "inspect": ["inspect", m],
        "run": ["run", m, "--prompt-ids", "1"],
    }[command]
    _refused(_cli(*args), "model.safetensors: is a FIFO, not a regular file", f)


def test_fifo_as_an_index_shard(tmp_path, fifo):
    from clover_gguf.config import CloverConfig
    from clover_gguf.synthetic import write_synthetic

    m = tmp_path / "sharded"
    write_synthetic(m, CloverConfig.load(VEC), shard_size_mb=0.05, progress=False)
    shards = sorted(m.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()
    f = fifo(shards[1])
    _refused(_cli("convert", m, "-o", tmp_path / "o.gguf"), f"{shards[1].name}: is a FIFO, not a regular file", f)


def test_fifo_as_tokenizer_json(tmp_path, fifo):
    m = _model_copy(tmp_path, TINY)
    (m / "tokenizer.json").unlink()
    f = fifo(m / "tokenizer.json")
    _refused(_cli("convert", m, "-o", tmp_path / "o.gguf"), "tokenizer.json: is a FIFO, not a regular file", f)


def test_fifo_as_imatrix_and_calibration_text(tmp_path, fifo):
    f = fifo(tmp_path / "im.gguf")
    _refused(_cli("convert", VEC, "-o", tmp_path / "o.gguf", "--imatrix", f.path), "is a FIFO, not a regular file", f)
    _refused(_cli("imatrix", VEC, "-f", f.path, "-o", tmp_path / "i.gguf"), "is a FIFO, not a regular file", f)
    from clover_gguf.convert.imatrix import load_imatrix
    from clover_gguf.inputs import InputError

    with pytest.raises(InputError, match="is a FIFO, not a regular file"):
        load_imatrix(f.path)
    assert not f.fed


def test_fifo_and_devices_as_a_gguf_or_corpus(tmp_path, fifo):
    f = fifo(tmp_path / "x.gguf")
    _refused(_cli("run", f.path, "--prompt-ids", "1"), "is a FIFO, not a regular file", f)
    _refused(_cli("inspect", f.path), "is a FIFO, not a regular file", f)
    _refused(_cli("serve", f.path), "is a FIFO, not a regular file", f)
    from clover_gguf.gguf_io.reader import GGUFReadError, open_gguf

    with pytest.raises(GGUFReadError, match="is a FIFO"):
        open_gguf(f.path)
    # issue 26 defect 10: `--corpus /dev/null` said "corpus file not found"
    res = _cli("eval", "quality", "--reference", TINY, f.path, "--corpus", "/dev/null")
    _refused(res, "/dev/null: is a device, not a regular file")
    assert not f.fed


def test_runtime_refuses_a_fifo(tmp_path, fifo):
    from clover_gguf.runtime.runtime import CloverRuntime, RuntimeLoadError

    f = fifo(tmp_path / "x.gguf")
    with pytest.raises(RuntimeLoadError, match="x.gguf: is a FIFO, not a regular file"):
        CloverRuntime(f.path)
    assert not f.fed


def test_llama_clover_cli_refuses_a_fifo(tmp_path, fifo):
    """native/clover-cli.cpp: llama-clover-cli stats -m first instead of blocking on open()."""
    import subprocess

    from clover_gguf.runtime.build import runtime_paths

    f = fifo(tmp_path / "x.gguf")
    cli_bin = runtime_paths()["bin_dir"] / "llama-clover-cli"
    r = subprocess.run(
        [str(cli_bin), "-m", str(f.path), "-p", "hi", "-n", "4"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode != 0 and not f.fed
    assert r.stderr.strip().endswith("x.gguf: not a regular file") and r.stderr.count("\n") == 1, r.stderr[-2000:]


@pytest.fixture(scope="module")
def tiny_gguf(converted):
    return converted(TINY)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--windows", "1000000"], "--windows 1000000: the corpus holds "),
        (["--blocks", "1000000"], "--blocks 1000000: the corpus's longest document holds "),
    ],
)
def test_windows_and_blocks_checked_against_the_corpus(tmp_path, tiny_gguf, args, needle):
    """Issue 26 defect 9: `--windows 1e9` / `--blocks 1e9` grew memory at 22 MB/s with no output."""
    corpus = tmp_path / "c.txt"
    corpus.write_text((TINY / "README.md").read_text())
    res = _cli("eval", "quality", "--reference", TINY, tiny_gguf, "--corpus", corpus, "--out", tmp_path / "q", *args)
    _refused(res, needle)
    assert "loading reference" not in res.output and res.seconds < 60
