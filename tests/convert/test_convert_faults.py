"""`clover-gguf convert` under faults: values no GGUF type can hold, outputs that are not
regular files, SIGKILL/SIGTERM in the middle of the work, stale temporary files, and two
conversions racing for the same output. Each ends in one clean line and never in a file
under the final name that is not a whole conversion."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from convert_helpers import VECTORS, poke_tensor, write_synth
from gguf import GGUFReader

from clover_gguf.convert import converter
from clover_gguf.convert.converter import ConvertError, convert

VEC = VECTORS / "random-clover"


def _conv(src, out, **kw):
    kw.setdefault("progress", False)
    return convert(src, out, **kw)


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    for p in dst.iterdir():
        p.chmod(0o644)
    return dst


# ---- values the target type cannot hold --------------------------------------------------


def test_a_log_that_overflows_after_the_transform(tmp_path):
    """A finite A_log of 1.7e38 becomes ssm_a = -exp(A_log) = -inf: refused, naming both."""
    m = _copy(VEC, tmp_path / "m")
    poke_tensor(m / "model.safetensors", "model.layers.1.self_attn.memory.A_log", 1.7e38, 1)
    with pytest.raises(ConvertError) as ei:
        _conv(m, tmp_path / "o.gguf")
    msg = str(ei.value)
    assert "tensor model.layers.1.self_attn.memory.A_log becomes -inf in blk.1.ssm_a" in msg
    assert "row 0, column 1" in msg and str(m / "model.safetensors") in msg
    assert not (tmp_path / "o.gguf").exists()


@pytest.mark.parametrize("kw,name", [(dict(outtype="f16"), "f16"), (dict(outtype="q8_0"), "q8_0")])
def test_value_beyond_the_target_type(tmp_path, kw, name):
    m = _copy(VEC, tmp_path / "m")
    poke_tensor(m / "model.safetensors", "model.layers.0.self_attn.q_proj.weight", 1e6, 5)  # BF16: 999424
    with pytest.raises(ConvertError) as ei:
        _conv(m, tmp_path / "o.gguf", **kw)
    msg = str(ei.value)
    assert f"has 999424, more than type {name} of blk.0.attn_q.weight stores (|x| <= 65504)" in msg
    assert "model.layers.0.self_attn.q_proj.weight" in msg and "row 0, column 5" in msg
    _conv(m, tmp_path / "o.gguf", outtype="bf16")  # BF16 holds it


# ---- --force replaces regular files only -----------------------------------------------------


def test_force_never_replaces_a_device(tmp_path):
    st = os.stat("/dev/null")
    with pytest.raises(ConvertError, match="/dev/null: exists and is a device; only regular files are replaced"):
        _conv(VEC, "/dev/null", force=True)
    assert os.stat("/dev/null").st_rdev == st.st_rdev and not os.path.isfile("/dev/null")


def test_force_never_replaces_a_fifo_link_or_folder(tmp_path):
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ConvertError, match="exists and is a FIFO; only regular files are replaced"):
        _conv(VEC, fifo, force=True)
    target = tmp_path / "target.gguf"
    target.write_bytes(b"keep")
    link = tmp_path / "link.gguf"
    link.symlink_to(target)
    with pytest.raises(ConvertError, match="exists and is a symbolic link; only regular files are replaced"):
        _conv(VEC, link, force=True)
    assert link.is_symlink() and target.read_bytes() == b"keep"
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(ConvertError, match="is a directory"):
        _conv(VEC, tmp_path / "dir.gguf", force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.gguf", "fifo.gguf", "link.gguf", "target.gguf"]


# ---- killed in the middle ------------------------------------------------------------------


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory):
    """A synthetic checkpoint that takes a few seconds to convert on one thread."""
    return write_synth(tmp_path_factory.mktemp("slow") / "m", num_hidden_layers=4, num_experts=16)


def _start(model, out, *extra):
    return subprocess.Popen(
        [sys.executable, "-m", "clover_gguf.cli", "convert", str(model), "-o", str(out), "-q", "-t", "1", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_data(tmp, proc, timeout=120):
    """Until the temporary file holds the header and some tensor data."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if tmp.exists() and tmp.stat().st_size > 200_000:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    raise AssertionError("the conversion never started writing")


def test_sigkill_leaves_no_output_and_the_next_run_removes_the_leftover(slow_model, tmp_path):
    out = tmp_path / "o.gguf"
    tmp = tmp_path / ".o.gguf.convert.tmp"
    p = _start(slow_model, out)
    _wait_for_data(tmp, p)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL
    assert not out.exists() and tmp.exists()  # only the temporary name
    res = _conv(slow_model, out, threads=1)
    assert any(f"removed {tmp}, a temporary file" in n and "interrupted run" in n for n in res.notes)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["o.gguf"]
    assert len(GGUFReader(out).tensors) == len(res.plan.entries)


def test_sigterm_removes_the_temporary_file(slow_model, tmp_path):
    out = tmp_path / "o.gguf"
    p = _start(slow_model, out)
    _wait_for_data(tmp_path / ".o.gguf.convert.tmp", p)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and err.strip().count("\n") == 0, err
    assert "Interrupted (SIGTERM): interrupted while writing tensor" in err and "no output written" in err
    assert list(tmp_path.iterdir()) == [], err


# ---- two conversions to one output ----------------------------------------------------------


def test_concurrent_conversions_one_wins_whole(slow_model, tmp_path):
    ref = tmp_path / "ref.gguf"
    _conv(slow_model, ref, threads=1)
    out = tmp_path / "o.gguf"
    procs = [_start(slow_model, out) for _ in range(2)]
    results = [(p.wait(timeout=300), p.communicate()[1]) for p in procs]
    codes = sorted(rc for rc, _ in results)
    assert codes == [0, 1], results
    err = next(e for rc, e in results if rc == 1)
    assert "Traceback" not in err and err.strip().count("\n") == 0
    assert any(s in err for s in ("another process is writing it", "exists (use --force", "created by another"))
    assert out.read_bytes() == ref.read_bytes()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["o.gguf", "ref.gguf"]


def test_output_created_by_someone_else_meanwhile_is_kept(tmp_path, monkeypatch):
    """The name is taken after the checks, before the publish: the hard-link publish fails
    cleanly and the other file stays as it was."""
    out = tmp_path / "o.gguf"
    real = converter.write_gguf

    def write_then_someone_else_publishes(*a, **k):
        real(*a, **k)
        out.write_bytes(b"the other conversion")

    monkeypatch.setattr(converter, "write_gguf", write_then_someone_else_publishes)
    with pytest.raises(ConvertError, match="created by another process while this one was written; not replaced"):
        _conv(VEC, out)
    assert out.read_bytes() == b"the other conversion"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["o.gguf"]


def test_locked_temporary_file_means_a_conversion_is_running(tmp_path):
    import fcntl

    out = tmp_path / "o.gguf"
    with open(tmp_path / ".o.gguf.convert.tmp", "wb") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        with pytest.raises(ConvertError, match="another process is writing it"):
            _conv(VEC, out)
    assert not out.exists()


def test_huge_config_values_fail_fast_through_the_cli(tmp_path):
    m = _copy(VEC, tmp_path / "m")
    cfg = json.loads((m / "config.json").read_text())
    cfg["num_experts"] = 10**9
    (m / "config.json").write_text(json.dumps(cfg))
    t0 = time.time()
    r = subprocess.run(
        [sys.executable, "-m", "clover_gguf.cli", "convert", str(m), "-o", str(tmp_path / "o.gguf")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "key 'num_experts' = 1000000000: must be an integer in [1, 1024]" in r.stderr
    assert time.time() - t0 < 60
