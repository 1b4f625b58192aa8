"""`clover-gguf plan`: sizes equal convert --dry-run, fit recipes stay within budget, the JSON
schema, and one-line errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "convert"))
from convert_helpers import TINY, write_synth  # noqa: E402

from clover_gguf.cli import cli  # noqa: E402
from clover_gguf.convert.converter import convert  # noqa: E402
from clover_gguf.plan import cost, make_plan  # noqa: E402
from clover_gguf.plan.budget import Curves, budget_rules, fit_budget  # noqa: E402
from clover_gguf.plan.gpus import GPUS, find_gpu  # noqa: E402
from clover_gguf.plan.sizes import GroupTypes, PlanError, exact_plan, open_source, parse_size  # noqa: E402

RECIPES = [
    dict(experts_gate_up="q4_k", experts_down="q5_k", shared_expert="q8_0", attention="q8_0", embeddings="q8_0", output="q6_k"),
    dict(experts_gate_up="iq3_s", experts_down="q3_k", shared_expert="q6_k", attention="q8_0", embeddings="q4_k", output="bf16"),
    dict(experts_gate_up="iq4_xs", experts_down="iq4_xs", shared_expert="bf16", attention="q5_k", embeddings="q8_0", output="q8_0"),
]  # fmt: skip


def _dry_run(model_dir, gt: GroupTypes):
    o = gt.convert_options()
    tts = [o[i + 1] for i in range(len(o)) if o[i] == "--tensor-type"]
    return convert(model_dir, None, outtype=o[3], experts=o[1], tensor_types=tts, dry_run=True).plan


@pytest.fixture(scope="module")
def odd_synth(tmp_path_factory):
    """A synthetic checkpoint whose rows are not multiples of 256: block fallbacks happen."""
    d = tmp_path_factory.mktemp("odd")
    write_synth(d, hidden_size=160, head_dim=96, moe_intermediate_size=224, shared_expert_intermediate_size=96)
    return d


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("which", ["tiny", "odd"])
def test_sizes_equal_dry_run(recipe, which, odd_synth):
    model = TINY if which == "tiny" else odd_synth
    gt = GroupTypes.make(**recipe)
    mine = exact_plan(open_source(str(model)), gt)
    theirs = _dry_run(model, gt)
    assert [(e.name, e.qtype, e.nbytes) for e in mine.entries] == [(e.name, e.qtype, e.nbytes) for e in theirs.entries]
    assert mine.total_bytes == theirs.total_bytes
    if which == "odd":
        assert theirs.fallbacks(), "the odd shapes should exercise llama.cpp's fallback"


def test_plan_of_shape_equals_plan_of_checkpoint():
    """--shape/GGUF sources go through the same plan as a checkpoint folder."""
    gt = GroupTypes.make(**RECIPES[0])
    a = exact_plan(open_source(str(TINY)), gt)
    b = exact_plan(open_source(None, "clover-tiny"), gt)
    assert a.total_bytes == b.total_bytes


def test_35b_plan_has_vram_and_split_options():
    src = open_source(None, "clover-35b-a3b")
    p = make_plan(src, vram_total=parse_size("16GiB"), gpu="rtx5070ti")
    fits = [o for o in p["options"] if o["fits"]]
    assert any(o["kind"] in ("vram", "fit") for o in fits)
    split = [o for o in fits if o["kind"] == "split" and 0 < len(o["cpu_expert_layers"]) < 40]
    assert split and "-ot" in split[0]["run"] and "=CPU" in split[0]["llama_clover_cli"]
    for o in fits:
        assert o["vram_bytes"] <= 16 * 2**30
    # no routing measurement of the 35B: the uniform formula, ~64 % of 256 experts at top-8
    assert not p["routing"]["measured"]
    assert p["routing"]["block_all_masked"] == pytest.approx(1 - (1 - 8 / 256) ** 32, abs=1e-4)
    # the split moves weights over PCIe every pass: slower than an all-in-VRAM option
    best_vram = max(o["speed"]["4"]["tok_s"] for o in fits if o["kind"] != "split")
    assert split[0]["speed"]["4"]["tok_s"] < best_vram
    # q4_k_m is the converter's named recipe: same bytes
    q4 = next(o for o in p["options"] if o["name"] == "q4_k_m in VRAM")
    from clover_gguf.convert.recipes import TypeRules
    from clover_gguf.convert.tensor_plan import build_plan

    assert q4["tensor_bytes"] == build_plan(src.ck, TypeRules.make(recipe="q4_k_m")).total_bytes


def test_plan_json_schema():
    r = CliRunner().invoke(
        cli, ["plan", "--shape", "clover-35b-a3b", "--vram", "16GiB", "--bandwidth", "896", "--json"]
    )
    assert r.exit_code == 0, r.output
    p = json.loads(r.output)
    assert p["schema"] == "clover-gguf.plan/2"
    assert p["speed_label"] == "predicted" and p["kl_label"] == "prior"
    assert p["recommended"] in {o["name"] for o in p["options"]}
    keys = {"name", "kind", "types", "tensor_bytes", "file_bytes_est", "bpw", "vram_bytes", "ram_bytes", "fits"}
    keys |= {"speed", "kl_pred", "convert", "run", "llama_clover_cli", "cpu_expert_layers"}
    for o in p["options"]:
        assert keys <= set(o), keys - set(o)
        assert set(o["speed"]) == {"4", "8"}
        assert o["speed"]["8"]["tok_s"] > o["speed"]["4"]["tok_s"] > 0
        assert o["file_bytes_est"] > o["tensor_bytes"]
        assert o["convert"].startswith("clover-gguf convert ")


def test_fit_within_budget_35b():
    src = open_source(None, "clover-35b-a3b")
    for gib in (12, 16, 20):
        f = fit_budget(src, gib * 2**30)
        plan = exact_plan(src, f.types)
        assert plan.total_bytes == f.tensor_bytes
        assert f.file_bytes_max <= gib * 2**30
    # more room never predicts more KL
    kls = [fit_budget(src, g * 2**30).kl for g in (12, 16, 20)]
    assert kls[0] >= kls[1] >= kls[2]


def test_fit_dry_run_within_budget(tmp_path):
    budget = "10MiB"
    plan = convert(TINY, None, rules=budget_rules(TINY, f"fit:{budget}", log=lambda *a: None), dry_run=True).plan
    assert plan.total_bytes <= parse_size(budget)
    assert plan.rules.recipe == f"fit:{budget}"
    # a budget below the smallest recipe is one clean error
    with pytest.raises(Exception, match="no recipe fits"):
        budget_rules(TINY, "fit:1MiB", log=lambda *a: None)


def test_curves_monotone_and_extrapolated():
    c = Curves({"experts_down": {"q4_k": 0.01, "q8_0": 0.02}}, "test")
    # a measured wider type caps a narrower one from below
    assert c.predict("experts_down", "q4_k") == 0.02
    # an unmeasured narrower type costs more than the nearest measured one
    assert c.predict("experts_down", "iq2_s") > c.predict("experts_down", "q4_k")
    assert c.predict("experts_down", "bf16") == 0.0


def test_curves_scale_per_layer_groups_with_depth():
    c = Curves({"attention": {"q4_k": 0.001}, "output": {"q4_k": 0.002}}, "test", layers=4).for_layers(40)
    assert c.predict("attention", "q4_k") == pytest.approx(0.01)
    assert c.predict("output", "q4_k") == pytest.approx(0.002)
    # the committed clover-tiny curves know their model's depth
    assert Curves.load().layers == 4


def test_touched_fraction():
    assert cost.touched_fraction(8, 256, 1) == pytest.approx(8 / 256)
    assert cost.touched_fraction(8, 256, 32) == pytest.approx(0.638, abs=1e-3)
    assert cost.touched_fraction(2, 8, 16) == pytest.approx(1 - 0.75**16)


def test_gpu_table():
    assert len(GPUS) >= 12
    assert find_gpu("5070 ti").vram_gib == 16
    assert find_gpu("h200").bandwidth_gbs == 4800
    with pytest.raises(ValueError, match="ambiguous"):
        find_gpu("rtx50")


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--shape", "clover-35b-a3b", "--vram", "lots", "--gpu", "rtx5080"], "--vram 'lots'"),
        (["--shape", "nope", "--gpu", "rtx5080"], "unknown preset"),
        (["--shape", "clover-35b-a3b", "--gpu", "rtx9999"], "unknown GPU"),
        (["--shape", "clover-35b-a3b", "--free-vram", "lots"], "--free-vram 'lots'"),
        (["--shape", "clover-35b-a3b"], "--vram"),
        (["--gpu", "rtx5080"], "MODEL_DIR"),
        (["/nonexistent/x.gguf", "--gpu", "rtx5080"], "no such model"),
    ],
)
def test_bad_options_one_line(args, msg):
    r = CliRunner().invoke(cli, ["plan", *args])
    assert r.exit_code != 0
    out = r.output.strip()
    assert len(out.splitlines()) == 1, out
    assert out.startswith("Error:") and msg in out, out


def test_parse_size():
    assert parse_size("16GiB") == 16 * 2**30
    assert parse_size("16G") == 16 * 2**30
    assert parse_size("16GB") == 16 * 10**9
    assert parse_size("900MiB") == 900 * 2**20
    with pytest.raises(PlanError):
        parse_size("0GiB")


def test_run_override_tensor(tiny_gguf):
    """The split options' -ot lines load, and keeping experts in host memory changes nothing."""
    from clover_gguf.plan import cpu_layers_regex
    from clover_gguf.runtime.runtime import CloverRuntime

    block = [5, 6, 7, 1, 1, 1, 9, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    with CloverRuntime(tiny_gguf, n_threads=1) as rt:
        want = rt.block_logits_np(block)
    pat = cpu_layers_regex([0, 2]).rsplit("=", 1)[0]
    with CloverRuntime(tiny_gguf, n_threads=1, cpu_tensors=[pat]) as rt:
        assert (rt.block_logits_np(block) == want).all()
    args = ["run", str(tiny_gguf), "--prompt-ids", "5,6,7", "-n", "4", "-t", "1"]
    r = CliRunner().invoke(cli, [*args, "-ot", cpu_layers_regex([0, 1])])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, [*args, "-ot", "exps=CUDA0"])
    assert r.exit_code != 0 and len(r.output.strip().splitlines()) == 1 and "REGEX=CPU" in r.output


def test_fit_real_file_within_budget(tmp_path):
    """The written file, header included, is within the budget (the header estimate is an
    upper bound), and the types are what the fit chose."""
    out = tmp_path / "fit.gguf"
    notes = []
    res = convert(TINY, out, rules=budget_rules(TINY, "fit:9MiB", log=notes.append), progress=False)
    assert out.stat().st_size <= 9 * 2**20
    assert any(n.startswith("fit: total") for n in notes)
    dry = convert(TINY, None, rules=budget_rules(TINY, "fit:9MiB", log=lambda *a: None), dry_run=True).plan
    assert [e.qtype for e in dry.entries] == [e.qtype for e in res.plan.entries]


def _sparse_checkpoint(folder: Path, shape: str) -> Path:
    """A BF16 checkpoint of a preset's full shapes whose data is a hole: the converter's dry run
    reads headers only, so the 35B model's 67 GB cost no disk."""
    import struct

    from clover_gguf.config import preset

    cfg = preset(shape)
    header, off = {}, 0
    for name, shp in cfg.expected_tensors(fused=True).items():
        n = 2
        for s in shp:
            n *= s
        header[name] = {"dtype": "BF16", "shape": list(shp), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + off)
    return folder


def test_35b_plan_sizes_equal_convert_dry_run(tmp_path):
    """The acceptance check: every option of the 16 GiB plan for the 40-layer 35B shapes has
    the tensor bytes `convert --dry-run` reports for its convert line's options."""
    import shlex

    ck = _sparse_checkpoint(tmp_path / "c35", "clover-35b-a3b")
    p = make_plan(open_source(None, "clover-35b-a3b"), vram_total=16 * 2**30, gpu="rtx5070ti")
    seen = set()
    for o in p["options"]:
        args = shlex.split(o["convert"])
        if tuple(args[5:]) in seen:
            continue
        seen.add(tuple(args[5:]))
        tts = [args[i + 1] for i in range(len(args)) if args[i] == "--tensor-type"]
        ex, out = args[args.index("--experts") + 1], args[args.index("--outtype") + 1]
        # sizes do not depend on the imatrix; a stand-in lets the IQ2 types plan without one
        if "--imatrix" in args and "iq2_s" in args:
            continue
        plan = convert(ck, None, outtype=out, experts=ex, tensor_types=tts, dry_run=True).plan
        assert plan.total_bytes == o["tensor_bytes"], o["name"]
    assert len(seen) >= 4


def test_write_recipe_and_bad_calibration(tmp_path):
    out = tmp_path / "fit.json"
    args = ["plan", "--shape", "clover-35b-a3b", "--gpu", "rtx5070ti", "--write-recipe", str(out)]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    rec = json.loads(out.read_text())
    assert rec["convert"].startswith("clover-gguf convert ") and set(rec["types"]) >= {"experts_gate_up", "output"}
    bad = tmp_path / "cal.json"
    bad.write_text("{not json")
    r = CliRunner().invoke(cli, ["plan", "--shape", "clover-35b-a3b", "--gpu", "rtx5070ti", "--calibration", str(bad)])
    assert r.exit_code != 0 and len(r.output.strip().splitlines()) == 1 and "not a calibration file" in r.output


@pytest.mark.parametrize(
    "extra,msg",
    [(["--recipe", "fit:abc"], "expected a size"), (["--recipe", "fit:8MiB", "--experts", "q4_k"], "chooses every")],
)
def test_convert_fit_bad_options_one_line(extra, msg):
    r = CliRunner().invoke(cli, ["convert", str(TINY), "--dry-run", *extra])
    assert r.exit_code != 0
    assert len(r.output.strip().splitlines()) == 1 and msg in r.output, r.output
