"""Every output is written through clover_gguf/outputs.py (issue 26, defect 1): a link, FIFO or
someone's file planted at an output's temporary name or at the output itself is never written
through, truncated or published; --force replaces regular files only."""

import fcntl
import json
import os
import threading
import time

import pytest
from click.testing import CliRunner
from testdata import REPO, VECTORS

from clover_gguf.cli import cli
from clover_gguf.outputs import OutputError, output_file, temporary_name, write_json, write_text

VEC = VECTORS / "random-clover"
PRECIOUS = b"precious\n"


def _precious(tmp_path):
    p = tmp_path / "precious.txt"
    p.write_bytes(PRECIOUS)
    return p


def _plant_link(at, target):
    at.parent.mkdir(parents=True, exist_ok=True)
    at.symlink_to(target)
    return at


def _cli(*args):
    res = CliRunner().invoke(cli, [str(a) for a in args])
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res


def _one_line_error(res, needle):
    """A non-zero exit whose error is one line (progress lines may precede it)."""
    assert res.exit_code != 0, res.output
    assert "Traceback" not in res.stderr and res.stderr.count("Error: ") == 1, res.stderr
    last = res.stderr.rstrip("\n").split("\n")[-1]
    assert last.startswith("Error: ") and needle in last, res.stderr


# ---- the module ------------------------------------------------------------------------------


def test_planted_symlink_at_the_temporary_name_is_refused(tmp_path):
    p = _precious(tmp_path)
    out = tmp_path / "o.json"
    _plant_link(temporary_name(out), p)
    with pytest.raises(OutputError, match="is a symbolic link, not a temporary file of ours"):
        write_json(out, {"a": 1})
    assert p.read_bytes() == PRECIOUS and not out.exists() and temporary_name(out).is_symlink()


def test_planted_hard_link_at_the_temporary_name_is_never_written(tmp_path):
    p = _precious(tmp_path)
    out = tmp_path / "o.json"
    os.link(p, temporary_name(out))
    write_json(out, {"a": 1})
    assert p.read_bytes() == PRECIOUS and json.loads(out.read_text()) == {"a": 1}
    assert not out.is_symlink() and os.stat(out).st_ino != os.stat(p).st_ino
    assert not temporary_name(out).exists()


def test_fifo_at_the_temporary_name_is_refused_without_blocking(tmp_path):
    out = tmp_path / "o.json"
    os.mkfifo(temporary_name(out))
    done = []
    t = threading.Thread(target=lambda: done.append(pytest.raises(OutputError, write_json, out, {})), daemon=True)
    t.start()
    t.join(10)
    assert done and "is a FIFO" in str(done[0].value)


@pytest.mark.parametrize("kind", ["symlink", "fifo", "dir", "device"])
def test_only_a_regular_output_is_replaced(tmp_path, kind):
    p = _precious(tmp_path)
    out = tmp_path / "o.json"
    if kind == "symlink":
        out.symlink_to(p)
    elif kind == "fifo":
        os.mkfifo(out)
    elif kind == "dir":
        out.mkdir()
    else:
        out = "/dev/null"
    with pytest.raises(OutputError):
        write_json(out, {"a": 1}, force=True)
    assert p.read_bytes() == PRECIOUS
    assert sorted(x.name for x in tmp_path.iterdir()) == sorted(
        ["precious.txt"] + (["o.json"] if kind != "device" else [])
    )


def test_force_replaces_a_regular_file_and_without_force_refuses(tmp_path):
    out = tmp_path / "o.txt"
    out.write_text("old")
    with pytest.raises(OutputError, match="exists \\(use --force to overwrite\\)"):
        write_text(out, "new", force=False)
    assert out.read_text() == "old"
    write_text(out, "new", force=True)
    assert out.read_text() == "new" and [x.name for x in tmp_path.iterdir()] == ["o.txt"]


def test_a_leftover_is_removed_and_named_a_locked_one_refused(tmp_path):
    out = tmp_path / "o.bin"
    temporary_name(out).write_bytes(b"x" * 100)
    notes = []
    with output_file(out, notes=notes) as f:
        f.write(b"data")
    assert out.read_bytes() == b"data" and "a temporary file (100 B) left by an interrupted run" in notes[0]
    with open(temporary_name(out), "wb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        with pytest.raises(OutputError, match="another process is writing it"):
            write_text(out, "other")
    assert out.read_bytes() == b"data"


def test_an_error_while_writing_leaves_nothing(tmp_path):
    out = tmp_path / "o.bin"
    with pytest.raises(ZeroDivisionError), output_file(out) as f:
        f.write(b"half")
        1 / 0  # noqa: B018
    assert list(tmp_path.iterdir()) == []


def test_dev_full_is_one_line_before_any_work():
    """Issue 26 defect 10: `plan --write-recipe /dev/full` printed 'Error: None: No space left on device'."""
    t0 = time.time()
    res = _cli("plan", "--shape", "clover-35b-a3b", "--gpu", "rtx5070ti", "--write-recipe", "/dev/full")
    _one_line_error(res, "/dev/full: exists and is a device; only regular files are replaced")
    assert time.time() - t0 < 30


# ---- every writer: a link planted at its temporary name and at the output --------------------


def test_convert_planted_link(tmp_path):
    """The issue's reproduction: `ln -s P .out1.gguf.convert.tmp; convert -o out1.gguf` wrote the
    GGUF into P and published out1.gguf as a link to it; the same with --force."""
    p = _precious(tmp_path)
    out = tmp_path / "out1.gguf"
    _plant_link(tmp_path / ".out1.gguf.convert.tmp", p)
    res = _cli("convert", VEC, "-o", out, "-q")
    _one_line_error(res, "is a symbolic link, not a temporary file of ours")
    assert p.read_bytes() == PRECIOUS and not out.exists()
    out.write_bytes(b"old output")
    res = _cli("convert", VEC, "-o", out, "-q", "--force")
    _one_line_error(res, "is a symbolic link, not a temporary file of ours")
    assert p.read_bytes() == PRECIOUS and out.read_bytes() == b"old output"
    (tmp_path / ".out1.gguf.convert.tmp").unlink()
    out.unlink()
    out.symlink_to(p)
    _one_line_error(_cli("convert", VEC, "-o", out, "-q", "--force"), "exists and is a symbolic link")
    assert p.read_bytes() == PRECIOUS


@pytest.mark.parametrize("where", ["temporary", "output"])
def test_imatrix_planted_link(tmp_path, where):
    p = _precious(tmp_path)
    text = tmp_path / "calib.txt"
    text.write_text("def f(x):\n    return x\n" * 40)
    out = tmp_path / "im.gguf"
    _plant_link(temporary_name(out) if where == "temporary" else out, p)
    res = _cli("imatrix", VEC, "-f", text, "-o", out, "-c", "64")
    _one_line_error(res, "symbolic link")
    assert p.read_bytes() == PRECIOUS


@pytest.mark.parametrize("name", ["report.md", "pareto.png"])
def test_report_planted_link(tmp_path, name):
    p = _precious(tmp_path)
    out = tmp_path / "r"
    _plant_link(temporary_name(out / name), p)
    res = _cli("report", REPO / "evaldata/baseline/clover-tiny/run.json", "-o", out)
    _one_line_error(res, "symbolic link")
    assert p.read_bytes() == PRECIOUS


@pytest.mark.parametrize("where", ["temporary", "output"])
def test_plan_recipe_planted_link(tmp_path, where):
    p = _precious(tmp_path)
    out = tmp_path / "recipe.json"
    _plant_link(temporary_name(out) if where == "temporary" else out, p)
    res = _cli("plan", "--shape", "clover-35b-a3b", "--gpu", "rtx5070ti", "--write-recipe", out)
    _one_line_error(res, "symbolic link")
    assert p.read_bytes() == PRECIOUS


def test_quality_outputs_planted_link(tmp_path):
    from clover_gguf.eval.quality.run import QualityRun

    p = _precious(tmp_path)
    _plant_link(temporary_name(tmp_path / "quality.json"), p)
    run = QualityRun.__new__(QualityRun)
    run.to_dict = lambda: {"models": []}
    with pytest.raises(OutputError, match="symbolic link"):
        run.save(tmp_path / "quality.json")
    assert p.read_bytes() == PRECIOUS


def test_training_export_planted_link(tmp_path):
    from clover_gguf.reference.model import CloverModel
    from clover_gguf.train.trainer import save_hf

    p = _precious(tmp_path)
    out = tmp_path / "hf"
    _plant_link(temporary_name(out / "model.safetensors"), p)
    model = CloverModel.from_pretrained(VEC)
    with pytest.raises(OutputError, match="symbolic link"):
        save_hf(model, out)
    assert p.read_bytes() == PRECIOUS
    temporary_name(out / "model.safetensors").unlink()
    _plant_link(temporary_name(out / "config.json"), p)
    with pytest.raises(OutputError, match="symbolic link"):
        save_hf(model, out)
    assert p.read_bytes() == PRECIOUS


def test_synth_planted_link(tmp_path):
    p = _precious(tmp_path)
    out = tmp_path / "s"
    _plant_link(temporary_name(out / "model.safetensors"), p)
    res = _cli("synth", out, "--config", VEC / "config.json")
    _one_line_error(res, "symbolic link")
    assert p.read_bytes() == PRECIOUS
    g = tmp_path / "s.gguf"
    _plant_link(temporary_name(g, "convert"), p)
    _one_line_error(_cli("synth", g, "--config", VEC / "config.json", "--gguf"), "symbolic link")
    assert p.read_bytes() == PRECIOUS


def test_calibration_planted_link(tmp_path):
    from clover_gguf.plan.cost import CpuCalibration

    p = _precious(tmp_path)
    cal = CpuCalibration.load()
    _plant_link(temporary_name(tmp_path / "cal.json"), p)
    with pytest.raises(OutputError, match="symbolic link"):
        cal.save(tmp_path / "cal.json")
    assert p.read_bytes() == PRECIOUS
