"""`eval baseline --add`: rows are added only to a baseline with the same sample, and the
committed baseline has the low-bit expert rows (imatrix) next to the standard set."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from click.testing import CliRunner

from clover_gguf.cli import cli
from clover_gguf.eval.baseline import LOWBIT_FILES

REPO = Path(__file__).resolve().parents[2]
BASELINE = REPO / "evaldata" / "baseline" / "clover-tiny"
TINY = REPO / "models" / "clover-tiny"


def _baseline(tmp_path, *extra):
    out = tmp_path / "out"
    shutil.copytree(BASELINE, out)
    args = ["eval", "baseline", "--reference", str(TINY), "--out", str(out), "--work", str(tmp_path / "w")]
    return out, CliRunner().invoke(cli, [*args, *extra])


def test_add_refuses_another_sample(tmp_path):
    # the committed baseline is 4 windows: 6 (the default) would not compare
    out, r = _baseline(tmp_path, "--add", "Q3_K-experts")
    assert r.exit_code != 0 and len(r.output.strip().splitlines()) == 1, r.output
    assert "n_windows 6 (the baseline's: 4)" in r.output
    assert (out / "run.json").read_bytes() == (BASELINE / "run.json").read_bytes()
    assert not (tmp_path / "w").exists()  # refused before converting anything


def test_add_unknown_name_and_missing_baseline(tmp_path):
    _, r = _baseline(tmp_path, "--add", "Q1-experts", "--windows", "4")
    assert r.exit_code != 0 and len(r.output.strip().splitlines()) == 1 and "IQ2_M-experts" in r.output
    args = ["eval", "baseline", "--reference", str(TINY), "--out", str(tmp_path / "none"), "--add", "Q3_K-experts"]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code != 0 and "no baseline to add rows to" in r.output
    r = CliRunner().invoke(cli, [*args[:-2], "--imatrix", str(BASELINE / "run.json")])
    assert r.exit_code != 0 and "--imatrix goes with --add" in r.output


def test_committed_baseline_has_lowbit_rows():
    run = json.loads((BASELINE / "run.json").read_text())
    q = run["sections"]["quality"]
    rows = {m["name"]: m for m in q["models"]}
    for name, kw in LOWBIT_FILES:
        m = rows[name]
        assert m["convert_options"]["experts"] == kw["experts"] and m["convert_options"]["imatrix"]
        assert set(m["providers"]) == {"runtime", "reference-dequant"}
    # sizes fall with the bits: 4.5 (Q4_K) > 3.44 (Q3_K, IQ3_S) > 2.5 (IQ2_S) bits per expert weight
    b = {n: rows[n]["bytes"] for n in ("Q4_K-experts", "Q3_K-experts", "IQ3_S-experts", "IQ2_M-experts")}
    assert b["Q4_K-experts"] > max(b["Q3_K-experts"], b["IQ3_S-experts"])
    assert min(b["Q3_K-experts"], b["IQ3_S-experts"]) > b["IQ2_M-experts"]
    report = (BASELINE / "report.md").read_text()
    assert all(n in report for n, _ in LOWBIT_FILES)
