"""The cost model's runtime terms: GPU kernel rates by type and rows (seeded, or a device check's
summary.json), measured routing, the host-expert copy (used experts only, pinned vs pageable,
op offload off), the recommendation rule and the labels the plan prints."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "convert"))
from convert_helpers import TINY  # noqa: E402

from clover_gguf.cli import cli  # noqa: E402
from clover_gguf.plan import cost, make_plan  # noqa: E402
from clover_gguf.plan import kernels as K  # noqa: E402
from clover_gguf.plan.gpus import GPUS  # noqa: E402
from clover_gguf.plan.routing import Routing, fingerprint_checkpoint, measure, uniform  # noqa: E402
from clover_gguf.plan.sizes import PlanError, open_source  # noqa: E402

C35 = open_source(None, "clover-35b-a3b")


# ------------------------------------------------------------------------------- kernels


def test_seeded_mmq_rates_follow_the_anchors():
    t = K.KernelTable()
    # each seed is its anchor's arithmetic: 6.98 G weights x t/s / rows / (SMs x GHz)
    for a in K.MMQ_ANCHORS:
        j = min(K.TILES, key=lambda x: abs(x - a.rows))
        assert t.mmq[a.qtype][j][0] == pytest.approx(a.rate)
    assert K.MMQ_ANCHORS[1].rate == pytest.approx(6.98e9 * 3358.03 / 32 / (128 * 2.52) / 1e9)
    # at 32 rows the anchored types are within 10 % of each other: bits hardly matter to MMQ
    r32 = [t.mmq_rate(q, 32) for q in ("q4_k", "iq4_xs", "iq2_s", "q3_k")]
    assert max(r32) / min(r32) < 1.1
    # more rows per tile, fewer weights per second; interpolated between seeds
    assert t.mmq_rate("q4_k", 16) > t.mmq_rate("q4_k", 24) > t.mmq_rate("q4_k", 32) > t.mmq_rate("q4_k", 64)
    # the one public check of the SMs x clock scaling (RTX 5090) is within 10 %
    assert K.SCALING_CHECK.rate / t.mmq_rate("iq2_s", 32) == pytest.approx(1.0, abs=0.1)


def _summary(tmp_path, gpu="NVIDIA H200", q4_gws=600.0, moe_gws=None):
    s = {
        "mode": "gpu",
        "kernels": {
            "gpu": gpu,
            "sms": 132,
            "ghz": 1.98,
            "mmq": {"q4_k": {"32": q4_gws}},
            "float_bw": 0.7,
        },
    }
    if moe_gws:  # MUL_MAT_ID, G weights/s by rows per touched expert (device_check.py's "moe")
        s["kernels"]["moe"] = {"q4_k": {"2.29": moe_gws}, "q5_k": {"2.29": moe_gws}}
    p = tmp_path / "summary.json"
    p.write_text(json.dumps(s))
    return p


def test_device_check_summary_replaces_the_seeds(tmp_path):
    t = K.KernelTable.load(_summary(tmp_path))
    assert t.mmq_rate("q4_k", 32) == pytest.approx(600.0 / (132 * 1.98))
    assert t.mmq["q4_k"][32][1] == "measured on NVIDIA H200"
    assert t.bw_fraction("bf16") == 0.7
    assert t.label("H200 SXM") == "calibrated" or t.label("NVIDIA H200") == "calibrated"
    assert t.label("GeForce RTX 5070 Ti") == "predicted"
    assert K.KernelTable().label("H200 SXM") == "predicted"
    # through the CLI: the plan for that GPU says so; the speed changes with the measured MoE
    # rate (routed experts are MUL_MAT_ID's own term), and the measured terms' ranges collapse
    args = ["plan", "--shape", "clover-35b-a3b", "--gpu", "h200", "--json"]
    base = json.loads(CliRunner().invoke(cli, args).output)
    summ = _summary(tmp_path, "H200", 300.0, moe_gws=200.0)
    slow = json.loads(CliRunner().invoke(cli, [*args, "--calibration", str(summ)]).output)
    assert base["speed_label"] == "predicted" and slow["speed_label"] == "calibrated"
    q = {o["name"]: o["speed"]["4"]["tok_s"] for o in slow["options"]}
    b = {o["name"]: o["speed"]["4"]["tok_s"] for o in base["options"]}
    assert q["q4_k_m in VRAM"] < b["q4_k_m in VRAM"]
    for k in ("mmq", "moe", "float_bw"):
        assert base["speed_terms"][k]["kind"] in ("measured", "fit")
        assert slow["speed_terms"][k]["kind"] == "calibrated" and slow["speed_terms"][k]["time_range"] == [1.0, 1.0]
    assert "moe" in base["unanchored"] and "moe" not in slow["unanchored"]  # Hopper: no public MoE figure


def test_bad_device_summary_is_one_line(tmp_path):
    bad = tmp_path / "summary.json"
    bad.write_text(json.dumps({"mode": "gpu", "stages": []}))
    with pytest.raises(PlanError, match='no "kernels" section'):
        K.KernelTable.load(bad)
    r = CliRunner().invoke(cli, ["plan", "--shape", "clover-35b-a3b", "--gpu", "h200", "--calibration", str(bad)])
    assert r.exit_code != 0 and len(r.output.strip().splitlines()) == 1 and "kernels" in r.output
    # --calibrate never writes its CPU figures over a device summary
    good = _summary(tmp_path)
    before = good.read_text()
    r = CliRunner().invoke(cli, ["plan", "--calibrate", str(good), "--calibration", str(good)])
    assert r.exit_code != 0 and "its own --calibration" in r.output and good.read_text() == before


def test_gpu_terms_by_type_and_rows():
    dev = cost.Device("x", 1000.0, 100.0, 63.0, 300.0)
    t = K.KernelTable()
    n = 1e9
    # quantized, 32 rows: MMQ, set by the weights walked, not their bytes
    q4 = cost.mat_ms(cost.Mat(n, n * 4.5 / 8, "q4_k", 32), dev, t)
    iq2 = cost.mat_ms(cost.Mat(n, n * 2.5 / 8, "iq2_s", 32), dev, t)
    assert q4 == pytest.approx(n / (t.mmq_rate("q4_k", 32) * 300 * 1e6))
    assert iq2 / q4 > 0.85  # 44 % of the bytes, about the same time
    # float weights and <= 8 rows: bandwidth bound
    bf = cost.mat_ms(cost.Mat(n, 2 * n, "bf16", 32), dev, t)
    assert bf == pytest.approx(2 * n / (K.FLOAT_BW[0] * 1000 * 1e6))
    one = cost.mat_ms(cost.Mat(n, n * 4.5 / 8, "q4_k", 1), dev, t)
    assert one == pytest.approx(n * 4.5 / 8 / (t.bw_fraction("q4_k") * 1000 * 1e6))
    assert cost.tile_rows(32) == 32 and cost.tile_rows(33) == 40 and cost.tile_rows(500) == 128


# ------------------------------------------------------------------------------- routing


def test_routing_measured_for_clover_tiny_only():
    from clover_gguf.checkpoint import Checkpoint

    with Checkpoint(TINY) as ck:
        fp = fingerprint_checkpoint(ck, 4)
    r = Routing.load_for(2, 8, fp)
    # the committed measurement is of the router in the tree (re-measure when it changes:
    # scripts/measure_routing.py)
    assert r.measured and "routing-clover-tiny.json" in r.source
    assert not Routing.load_for(2, 8, "0" * 64).measured
    for B in (8, 16, 32, 64):
        masked, commit = r.fraction(B, 1.0), r.fraction(B, 0.0)
        assert 2 / 8 <= masked <= uniform(2, 8, B) + 1e-9 and 2 / 8 <= commit <= uniform(2, 8, B) + 1e-9
        # half masked lies between (linear in the mask fraction between the measured levels)
        mid = r.fraction(B, 0.5)
        assert r.fraction(B, 0.25) == pytest.approx((commit + mid) / 2)
    # a block size that was not measured: the formula
    assert r.fraction(24, 1.0) == pytest.approx(uniform(2, 8, 24))
    # the plan of clover-tiny uses it; the 35B shapes fall back to the formula
    p = make_plan(open_source(str(TINY)), gpu="rtx4080")
    assert p["routing"]["measured"] and p["routing"]["block_all_masked"] == pytest.approx(r.fraction(16, 1.0), abs=1e-4)
    assert not make_plan(C35, gpu="rtx4080")["routing"]["measured"]


def test_routing_measurement_runs(tmp_path):
    """scripts/measure_routing.py's measurement, small: fractions between k/E and the formula's."""
    d = measure(TINY, block_sizes=(8,), n_windows=2, n_blocks=2, log=lambda *a: None)
    assert d["fingerprint"]["num_experts"] == 8
    row = d["blocks"]["8"]
    for lv in ("0.0", "0.5", "1.0"):
        per = [x for x in row[lv]["per_layer"] if x is not None]
        assert per and all(2 / 8 <= x <= 1.0 for x in per)
    assert row["0.0"]["per_layer"][-1] is None  # a commit prunes the last layer's FFN
    assert row["uniform"] == pytest.approx(uniform(2, 8, 8), abs=1e-5)


def test_routing_changes_the_cost():
    """Fewer touched experts, less GPU time: the cost model reads the routing it is given."""
    cfg, plan = C35.config, None
    from clover_gguf.plan.planner import _q4_k_m
    from clover_gguf.plan.sizes import exact_plan

    plan = exact_plan(C35, _q4_k_m())
    dev = cost.Device("x", 896.0, 88.0, 63.0, GPUS["rtx5070ti"].sm_ghz)
    link, cpu, t = cost.HostLink(), cost.CpuCalibration(), K.KernelTable()

    def fn(w):
        return cost.gpu_ms(w, dev, t, link, cpu)

    few = Routing(8, 256, {32: {0.0: [0.3] * 40, 1.0: [0.3] * 40}}, "test")
    a = cost.block_times(cfg, plan, 4, fn, routing=Routing(8, 256))[2]
    b = cost.block_times(cfg, plan, 4, fn, routing=few)[2]
    # less than in proportion: fewer experts touched get more rows each, and MUL_MAT_ID's rate
    # per weight falls with rows per expert (plan.public's fit)
    assert b > 1.3 * a


# ------------------------------------------------------------------------------- host experts


def _host(frac=0.5, qtype="q4_k", n_experts=256, nbytes=150e6):
    return cost.HostTensor(nbytes * 8 / 4.5, nbytes, qtype, n_experts, frac)


def test_host_experts_copy_only_what_is_used():
    dev = cost.Device("x", 896.0, 88.0, 63.0, 170.0)
    t, cpu = K.KernelTable(), cost.CpuCalibration()
    w = cost.Work(rows=32, hidden=2048, host_layer_macs=32 * 8 * 3 * 512 * 2048)
    pinned, pageable = cost.HostLink(True, True), cost.HostLink(True, False)
    half = cost.host_layer_ms([_host(0.5)], w, dev, t, pinned, cpu)
    full = cost.host_layer_ms([_host(1.0)], w, dev, t, pinned, cpu)
    # the copy is of the used experts: about half the bytes, half the copy time
    copy_half = 0.5 * 150e6 / (K.PCIE_PINNED_FRACTION * 63.0 * 1e6)
    assert half < full and half > copy_half
    assert cost.host_layer_ms([_host(0.5)], w, dev, t, pageable, cpu) > half  # pageable is slower
    assert pageable.copy(63.0, t)[0] == K.PAGEABLE_GBS and pinned.copy(31.5, t)[0] == pytest.approx(23.9)
    # the ranges' ends: a PCIe 5.0 link between PCIe 4.0's rate and the same fraction of 5.0;
    # pageable from PR #976's 64 MiB rate to its 16 MiB fraction of the link
    assert pinned.copy(63.0, t.variant("slow"))[0] == K.PINNED_GBS
    assert pageable.copy(63.0, t.variant("slow"))[0] == K.PAGEABLE_64MIB_GBS
    assert pageable.copy(63.0, t.variant("fast"))[0] == pytest.approx(K.PCIE_PAGEABLE_FRACTION * 63.0)
    # runs of used experts: one call each (none when no expert or every expert is used)
    assert cost.expected_runs(256, 0.0) == 0 and cost.expected_runs(256, 1.0) == 1
    assert cost.expected_runs(256, 0.5) == pytest.approx(0.5 + 255 * 0.25)
    # below 32 rows, or with --no-op-offload, the CPU computes them: no copy of experts
    off = cost.HostLink(False, False)
    slow_cpu = cost.CpuCalibration(gmacs_experts=1.0)
    assert cost.host_layer_ms([_host(0.5)], w, dev, t, off, slow_cpu) > cost.host_layer_ms(
        [_host(0.5)], w, dev, t, off, cost.CpuCalibration(gmacs_experts=100.0)
    )
    w16 = cost.Work(rows=16, hidden=2048, host_layer_macs=w.host_layer_macs / 2)
    assert cost.host_layer_ms([_host(1.0)], w16, dev, t, pageable, slow_cpu) == pytest.approx(
        cost.host_layer_ms([_host(1.0)], w16, dev, t, off, slow_cpu)
    )


def test_plan_offers_the_three_split_variants():
    p = make_plan(C35, gpu="rtx5070ti")
    rows = {o["name"]: o for o in p["options"]}
    pg, pin, cpu = (
        rows[f"q4_k_m, split ({v})"] for v in ("op offload, pageable", "op offload, pinned", "CPU computes")
    )
    assert pg["host_memory"] == "pageable" and pin["host_memory"] == "pinned" and cpu["op_offload"] is False
    assert "--no-mmap" in pin["run"] and "--no-op-offload" in cpu["run"] and "-ot" in pg["run"]
    assert pin["speed"]["4"]["tok_s"] > pg["speed"]["4"]["tok_s"]
    # without op offload no GPU copy of a host expert tensor: no more layers on the host
    assert len(cpu["cpu_expert_layers"]) <= len(pg["cpu_expert_layers"])
    # llama-clover-cli takes common's spelling of the same options, and the plan's placement
    assert "-lm none" in pin["llama_clover_cli"] and "--no-op-offload" in cpu["llama_clover_cli"]
    assert pg["llama_clover_cli"].startswith("llama-clover-cli") and "-ot" in pg["llama_clover_cli"]
    assert "-ngl all -fit off" in pg["llama_clover_cli"]


# ------------------------------------------------------------------------------- the rule, labels


def test_recommendation_never_gets_lossier_with_more_vram():
    cards = ("rtx4060ti-16gb", "rtx5070ti", "rtx3090", "rtx5090", "rtx6000ada", "h100-sxm", "rtxpro6000", "h200")
    kls = []
    for key in sorted(cards, key=lambda k: GPUS[k].vram_gib):
        p = make_plan(C35, gpu=key)
        best = next(o for o in p["options"] if o["name"] == p["recommended"])
        assert best["fits"] and best["kind"] != "split"
        kls.append(best["kl_pred"])
        # BF16 where it fits
        if any(o["name"] == "bf16 in VRAM" and o["fits"] for o in p["options"]):
            assert p["recommended"] == "bf16 in VRAM"
    assert all(a >= b for a, b in zip(kls, kls[1:])), kls
    assert kls[-1] == 0.0  # the largest cards hold BF16


def test_vram_alone_states_the_card_assumed():
    r = CliRunner().invoke(cli, ["plan", "--shape", "clover-35b-a3b", "--vram", "16GiB"])
    assert r.exit_code == 0, r.output
    assert "an unknown 16.00 GiB card" in r.output and "GeForce RTX 4080" in r.output and "assumed" in r.output
    assert "speed: predicted" in r.output and "KL prior" in r.output
    r = CliRunner().invoke(cli, ["plan", "--shape", "clover-35b-a3b", "--vram", "16GiB", "--bandwidth", "500"])
    assert r.exit_code == 0 and "500 GB/s" in r.output


def test_kl_is_a_prior_unless_the_curves_are_of_this_model(tmp_path):
    from clover_gguf.eval.quality.backends import model_dir_hash

    p = make_plan(open_source(str(TINY)), gpu="rtx4080")
    assert p["kl_label"] == "prior"  # the committed curves were measured on clover-tiny v1
    src = Path("evaldata/sensitivity/clover-tiny/q4_k/sensitivity.json")
    run = json.loads(src.read_text())
    run["config"]["reference"] = str(TINY)
    run["config"]["reference_sha256"] = model_dir_hash(TINY)
    (tmp_path / "q4_k").mkdir()
    (tmp_path / "q4_k" / "sensitivity.json").write_text(json.dumps(run))
    r = CliRunner().invoke(cli, ["plan", str(TINY), "--gpu", "rtx4080", "--curves", str(tmp_path)])
    assert r.exit_code == 0 and "pred. KL" in r.output and "sensitivity runs of this model" in r.output
    r = CliRunner().invoke(cli, ["plan", "--shape", "clover-35b-a3b", "--gpu", "rtx4080", "--curves", str(tmp_path)])
    assert "KL prior" in r.output and "it is not this model's KL" in r.output
