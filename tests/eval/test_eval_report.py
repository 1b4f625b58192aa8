"""Reports render from saved JSON (quality from a real run, speed/sensitivity from fixtures)."""

import json

from click.testing import CliRunner

from clover_gguf.cli import cli
from clover_gguf.eval.quality.metrics import spread


def _sp(v):
    return spread([v * 0.9, v, v * 1.1, v, v])


def _speed_run():
    pt = {
        k: _sp(v)
        for k, v in dict(
            prompt_tps=900, gen_tps=40, ms_per_step=20, steps_per_block=3, tokens_per_step=5, ttfb_ms=90, total_ms=1500
        ).items()
    }
    env = {
        "created_utc": "2026-12-02T00:00:00+00:00",
        "command": "x",
        "cpu": {"model": "cpu", "usable_cores": 2},
        "gpu": [],
        "software": {"python": "3.11"},
        "threads": 2,
        "llama_cpp": {"built": False},
    }
    t = lambda name, b: {
        "name": name,
        "backend": b,
        "path": "p",
        "sha256": "ab" * 32,
        "load_cold_s": _sp(1.0),
        "load_warm_s": _sp(0.2),
        "peak_rss_mib": _sp(300),
        "base": pt,
        "sweeps": {"block_size": [{"value": v, **pt} for v in (8, 16, 32, 64)]},
    }
    return {
        "schema": "clover-gguf-eval/1",
        "kind": "speed",
        "config": {"runs": 5, "warmup": 1, "threads": 2, "decoding": {"block_size": 16}, "environment": env},
        "targets": [t("PyTorch BF16", "reference-bf16"), t("Q4_K", "runtime")],
        "notes": [],
    }


def test_report_renders_saved_quality_json(quality_run, tmp_path):
    d, run, _, _ = quality_run
    res = CliRunner().invoke(cli, ["report", str(d / "first-quality.json"), "-o", str(tmp_path)])
    assert res.exit_code == 0, res.output
    md = (tmp_path / "report.md").read_text()
    assert "| random-clover-q4_0 |" in md and "KL mean" in md and "Long-history drift" in md
    assert (tmp_path / "pareto.png").stat().st_size > 1000 and (tmp_path / "drift.png").stat().st_size > 1000


def test_report_renders_speed_and_bundle(tmp_path, quality_run):
    d, run, _, _ = quality_run
    sp = _speed_run()
    (tmp_path / "speed.json").write_text(json.dumps(sp))
    res = CliRunner().invoke(cli, ["report", str(tmp_path / "speed.json")])
    assert res.exit_code == 0, res.output
    md = (tmp_path / "report.md").read_text()
    assert "40.00 [" not in md and "40.0 [37.6–42.4]" in md  # median [p10–p90]
    assert "1.00×" in md and (tmp_path / "speed-block-size.png").is_file()
    sens = {
        "kind": "sensitivity",
        "config": {**run["config"], "qtype": "q4_k", "base": "bf16"},
        "groups": [
            {
                "group": "experts_down",
                "n_tensors": 2,
                "types": {"Q4_K": 2},
                "group_bytes_base": 2 << 20,
                "group_bytes_q": 1 << 19,
                "overall": run["models"][1]["providers"]["reference-dequant"]["overall"],
                "kl_per_mib_saved": 0.01,
            }
        ],
    }
    bundle = {"kind": "bundle", "sections": {"quality": run, "speed": sp, "sensitivity": sens}}
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "run.json").write_text(json.dumps(bundle))
    res = CliRunner().invoke(cli, ["report", str(tmp_path / "b" / "run.json")])
    assert res.exit_code == 0, res.output
    md = (tmp_path / "b" / "report.md").read_text()
    for h in ("## Quality", "## Sensitivity", "## Speed", "## Configuration"):
        assert h in md


def test_report_renders_a_throughput_run_and_refuses_an_unknown_kind(tmp_path):
    """Each run kind has its renderer: a throughput run's report is throughput.md, as the run
    itself writes it; a kind with none is one clear line."""
    res = [
        {"parallel": n, "tok_per_s": _sp(10.0 * n), "latency_s": _sp(1.5), "denoise_graphs": 10,
         "sequence_steps": 10 * n, "largest_group": n, "same_replies_as_first": n != 4, "loadavg_after": [1.5, 1.0]}
        for n in (1, 2, 4)
    ]  # fmt: skip
    cfg = {"model": "/x/m.gguf", "requests_per_client": 2, "max_tokens": 32, "runs": 5, "server_args": [],
           "clover": {}, "environment": {"cpu": {"model": "cpu", "usable_cores": 2}}}  # fmt: skip
    (tmp_path / "throughput.json").write_text(json.dumps({"kind": "throughput", "config": cfg, "results": res}))
    out = CliRunner().invoke(cli, ["report", str(tmp_path / "throughput.json")])
    assert out.exit_code == 0, out.output
    md = (tmp_path / "throughput.md").read_text()
    row4 = next(line for line in md.splitlines() if line.startswith("| 4 | "))
    assert row4.startswith("| 4 | 40.0 [") and "| 4.00 |" in row4 and "| **no** |" in row4
    assert not (tmp_path / "report.md").exists()
    (tmp_path / "x.json").write_text(json.dumps({"kind": "nonsense"}))
    out = CliRunner().invoke(cli, ["report", str(tmp_path / "x.json")])
    assert out.exit_code != 0 and "not an eval run: kind='nonsense'" in out.output and "Traceback" not in out.output
