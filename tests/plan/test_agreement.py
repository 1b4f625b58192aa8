"""`clover-gguf plan MODEL.gguf` and `run --fit` name the same layers for the same free VRAM:
one rule (placement.place) and one account (plan.vram), fed by the plan from the converter's
view of the file and by --fit from the GGUF's tensor table."""

from __future__ import annotations

import pytest

from clover_gguf.plan import make_plan
from clover_gguf.plan import vram as V
from clover_gguf.plan.placement import FitError, GpuDevice, fit_gguf, gguf_bytes
from clover_gguf.plan.sizes import open_source

MiB = 1 << 20


def _cases(gguf, op_offload: bool) -> list[tuple[str, int]]:
    """Free-memory values around every boundary: everything fits, 1..L-1 layers' experts out,
    all of them out, and not even the non-expert part."""
    experts, other, cfg = gguf_bytes(gguf, 99)
    acct = V.account(cfg, 1, host_tensor_max=max(max(ts) for ts in experts.values()), op_offload=op_offload)
    per_layer = [sum(experts[i]) for i in sorted(experts)]
    whole = sum(per_layer) + other + acct.overhead
    split = acct.offload_copy
    out = [("everything fits", whole), ("one byte short", whole - 1)]
    for j in range(1, len(per_layer)):
        out.append((f"{j} layers out", whole - sum(per_layer[:j]) + split))
        out.append((f"{j} layers out, 1 MiB short", whole - sum(per_layer[:j]) + split - MiB))
    out.append(("all out", other + acct.overhead + split))
    out.append(("not even the rest", other + acct.overhead + split - 1))
    return out


def _plan_layers(gguf, free: int, op_offload: bool):
    """The layers the plan's rows for the file itself put in host memory (None: does not fit)."""
    p = make_plan(open_source(str(gguf)), free=free, gpu="rtx4080")
    rows = {r["name"]: r for r in p["options"]}
    if rows["this file in VRAM"]["fits"]:
        return []
    name = "this file, split (op offload, pageable)" if op_offload else "this file, split (CPU computes)"
    r = rows.get(name)
    return r["cpu_expert_layers"] if r and r["fits"] else None


def _fit_layers(gguf, free: int, op_offload: bool):
    try:
        p = fit_gguf(gguf, 99, devices=[GpuDevice("CUDA0", free, free)], op_offload=op_offload)
    except FitError:
        return None
    return p.cpu_layers


@pytest.mark.parametrize("op_offload", [True, False])
def test_plan_and_fit_name_the_same_layers(tiny_gguf, op_offload):
    cases = _cases(tiny_gguf, op_offload)
    assert len(cases) >= 6
    seen = set()
    for what, free in cases:
        want = _fit_layers(tiny_gguf, free, op_offload)
        got = _plan_layers(tiny_gguf, free, op_offload)
        assert got == want, (what, free, got, want)
        seen.add(None if want is None else len(want))
    # the table crosses every outcome: fits, each split, all out, nothing fits
    assert {0, 1, None} <= seen and max(s for s in seen if s is not None) == 4


def test_plan_of_a_gguf_counts_what_fit_counts(tiny_gguf):
    """The VRAM the plan shows for the file in VRAM is --fit's figure for everything on the GPU."""
    big = 1 << 40
    p = make_plan(open_source(str(tiny_gguf)), free=big, gpu="rtx4080")
    row = next(r for r in p["options"] if r["name"] == "this file in VRAM")
    f = fit_gguf(tiny_gguf, 99, devices=[GpuDevice("CUDA0", big, big)])
    assert row["fits"] and row["vram_bytes"] == f.gpu_bytes
    # token_embd is not in it, the margin is llama.cpp's 1 GiB
    assert f.account.margin == 1 << 30


def test_parallel_sizes_state_and_compute_buffer(tiny_gguf):
    """plan --parallel N sizes what serve --parallel N allocates: N + 1 sequences."""
    src = open_source(str(tiny_gguf))
    one = make_plan(src, free=1 << 40, gpu="rtx4080")
    four = make_plan(src, free=1 << 40, gpu="rtx4080", parallel=4)
    cfg = src.config
    assert four["sequences"] == 5
    assert four["overhead"]["state_bytes"] == 5 * one["overhead"]["state_bytes"] == V.state_bytes(cfg, 5)
    ub = V.runtime_n_ubatch(5, cfg.block_size)
    assert four["overhead"]["compute_buffer_bytes"] == V.compute_buffer_bytes(cfg, ub)
