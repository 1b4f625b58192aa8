"""--fit in `clover-gguf run`/`serve`: the decision (a pure function of byte counts), the GGUF's
byte accounting, and the CPU build's message end to end."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from clover_gguf.cli import cli
from clover_gguf.plan import cpu_layers_regex
from clover_gguf.plan.placement import (
    NO_GPU,
    FitError,
    GpuDevice,
    choose_cpu_layers,
    fit_gguf,
    fit_overrides,
    gguf_bytes,
    gpu_devices,
    gpu_layers,
)

MiB = 1 << 20
LAYERS = {i: 100 * MiB for i in range(8)}  # 800 MiB of experts


def test_fits_needs_no_override():
    assert choose_cpu_layers(LAYERS, 200 * MiB, 1100 * MiB, 100 * MiB) == []
    assert choose_cpu_layers(LAYERS, 200 * MiB, 1100 * MiB - 1, 100 * MiB) == [0]  # one byte short


def test_minimal_leading_layers():
    # 1100 MiB needed, 850 free: 250 MiB must go, so three 100 MiB layers and not two
    assert choose_cpu_layers(LAYERS, 200 * MiB, 850 * MiB, 100 * MiB) == [0, 1, 2]
    # uneven layers: the leading ones, as llama.cpp's --n-cpu-moe
    assert choose_cpu_layers({3: 50 * MiB, 4: 300 * MiB, 5: 10 * MiB}, 0, 200 * MiB, 0) == [3, 4]


def test_nothing_fits_all_experts_on_cpu():
    # exactly the non-expert part fits: every layer's experts leave
    assert choose_cpu_layers(LAYERS, 200 * MiB, 300 * MiB, 100 * MiB) == list(range(8))


def test_not_even_without_experts():
    with pytest.raises(FitError, match=r"even with every layer's experts in CPU memory .* free 299\.00 MiB"):
        choose_cpu_layers(LAYERS, 200 * MiB, 299 * MiB, 100 * MiB)


def test_gpu_layers_as_llama_cpp_counts():
    assert gpu_layers(4, -1) == ([0, 1, 2, 3], True)
    assert gpu_layers(4, 99) == ([0, 1, 2, 3], True)
    assert gpu_layers(4, 5) == ([0, 1, 2, 3], True)
    assert gpu_layers(4, 3) == ([2, 3], True)  # the output layer counts as one
    assert gpu_layers(4, 0) == ([], False)


def _per_layer(experts):
    return {il: sum(ts) for il, ts in experts.items()}


def test_gguf_bytes_add_up(tiny_gguf):
    """Experts + other + token_embd = every tensor in the file; partial -ngl drops leading layers."""
    from clover_gguf.gguf_io.reader import open_gguf

    r = open_gguf(tiny_gguf)
    total = sum(int(t.n_bytes) for t in r.tensors)
    embd = sum(int(t.n_bytes) for t in r.tensors if t.name.startswith("token_embd"))
    experts, other, cfg = gguf_bytes(tiny_gguf, 99)
    assert sorted(experts) == list(range(cfg.num_hidden_layers))
    assert sum(_per_layer(experts).values()) + other + embd == total
    want = sum(int(t.n_bytes) for t in r.tensors if re.match(r"blk\.0\.ffn_(up|down|gate)_exps", t.name))
    assert _per_layer(experts)[0] == want > 0 and len(experts[0]) == 3  # gate, up, down
    part, _, _ = gguf_bytes(tiny_gguf, 2)
    assert sorted(part) == [cfg.num_hidden_layers - 1]


def test_fit_gguf_with_given_free_memory(tiny_gguf):
    experts, other, _ = gguf_bytes(tiny_gguf, 99)
    layers = _per_layer(experts)
    big = [GpuDevice("CUDA0", 1 << 40, 1 << 40)]
    p = fit_gguf(tiny_gguf, 99, devices=big)
    assert p.cpu_layers == [] and p.override() is None and p.message().startswith("fit: everything fits")
    # free memory for the overheads, the non-expert weights, one layer's experts and the GPU copy
    # of one host expert tensor (op offload)
    overhead = p.gpu_bytes - sum(layers.values()) - other
    one = overhead + other + layers[0] + max(experts[0])
    p = fit_gguf(tiny_gguf, 99, devices=[GpuDevice("CUDA0", one, one)])
    n = len(experts)
    assert p.cpu_layers == list(range(n - 1))  # the leading layers; the last one stays
    assert p.account.offload_copy == max(experts[0])
    assert p.gpu_bytes <= one and p.override() == cpu_layers_regex(p.cpu_layers)
    assert re.fullmatch(
        rf"fit: {n - 1} of {n} layers' experts in CPU memory \(.*\), .* on CUDA0 \(free .*\)", p.message()
    )
    with pytest.raises(FitError):
        fit_gguf(tiny_gguf, 99, devices=[GpuDevice("CUDA0", overhead, overhead)])


def test_fit_overrides_when_on(tiny_gguf):
    lines = []
    small = [GpuDevice("CUDA0", 1, 1)]
    assert fit_overrides(tiny_gguf, 0, None, False, log=lines.append, devices=small) == []  # -ngl 0: off
    assert fit_overrides(tiny_gguf, 99, False, False, log=lines.append, devices=small) == []  # --no-fit
    assert fit_overrides(tiny_gguf, 99, None, True, log=lines.append, devices=small) == []  # user's -ot wins
    assert lines == []
    with pytest.raises(FitError, match="not both"):
        fit_overrides(tiny_gguf, 99, True, True, log=lines.append, devices=small)
    assert fit_overrides(tiny_gguf, 99, None, False, log=lines.append, devices=[]) == []
    assert lines == [NO_GPU]


def test_run_cpu_build_says_nothing_to_fit(tiny_gguf):
    """End to end through `clover-gguf run`: on this CPU build ggml reports no GPU device."""
    args = ["run", str(tiny_gguf), "--prompt-ids", "5,6,7", "-n", "4", "-t", "1"]
    devs = gpu_devices()
    r = CliRunner().invoke(cli, [*args, "-ngl", "99"])
    assert r.exit_code == 0, r.output
    fit_lines = [x for x in r.stderr.splitlines() if x.startswith("fit:")]
    if not devs:
        assert fit_lines == [NO_GPU]
    else:  # a CUDA build: the line names the device
        assert len(fit_lines) == 1 and devs[0].name in fit_lines[0]
    r = CliRunner().invoke(cli, [*args, "-ngl", "99", "--no-fit"])
    assert r.exit_code == 0 and "fit:" not in r.stderr
    r = CliRunner().invoke(cli, [*args, "-ngl", "99", "--fit", "-ot", "exps=CPU"])
    assert r.exit_code != 0 and len(r.output.strip().splitlines()) == 1 and "not both" in r.output


def test_serve_fit_with_own_placement_is_one_line(tiny_gguf):
    """serve takes --fit too, and refuses it next to --experts-on-cpu before loading anything."""
    r = CliRunner().invoke(cli, ["serve", str(tiny_gguf), "-ngl", "99", "--fit", "--experts-on-cpu"])
    assert r.exit_code != 0 and len(r.output.strip().splitlines()) == 1 and "not both" in r.output


def test_llama_clover_cli_runs_the_plans_commands(tiny_gguf):
    """llama-clover-cli is on common's parser and fit: the command lines the plan prints for this
    file (-ngl all -fit off, -ot, --cpu-moe, -lm none, --no-op-offload) run, and give the tokens of
    a plain run, where common's --fit (on by default) has no GPU to fit on this build."""
    import shlex
    import subprocess

    from clover_gguf.plan.planner import LINKS, Option, _commands
    from clover_gguf.plan.sizes import open_source
    from clover_gguf.runtime.build import runtime_paths

    exe = str(Path(runtime_paths()["bin_dir"]) / "llama-clover-cli")
    extra = ["-n", "4", "-t", "1", "--verbose-prompt", "--no-perf"]

    def ids(args):
        r = subprocess.run([exe, *args, *extra], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stderr == "", (args, r.stderr[-2000:])
        return r.stdout.splitlines()[-1]

    plain = ids(["-m", str(tiny_gguf), "-p", "def f(x):"])
    assert plain.startswith("ids: ")
    src = open_source(str(tiny_gguf))
    n_layers = src.config.num_hidden_layers
    for link, flags in LINKS.values():  # a row of each split kind, some layers' experts or all on the CPU
        for cpu_layers in ([0], list(range(n_layers))):
            o = Option("split", "split", None, None, cpu_layers=cpu_layers, link=link, flags=flags)
            c = shlex.split(_commands(src, o, "x.gguf")["llama_clover_cli"])
            assert c[:3] == ["llama-clover-cli", "-m", str(tiny_gguf)] and c[-2:] == ["-p", "PROMPT"], c
            assert ("--cpu-moe" in c) == (len(cpu_layers) == n_layers) and "--no-mmap" not in c, c
            assert ids([*c[1:-1], "def f(x):"]) == plain, c
    assert ids(["-m", str(tiny_gguf), "-p", "def f(x):", "-fit", "off"]) == plain


def test_rpc_servers_turn_the_default_off(tiny_gguf):
    """rpc-servers place their own share: --fit stays off unless asked for, then sizes local GPUs."""
    said = []
    assert fit_overrides(tiny_gguf, 99, None, False, log=said.append, rpc=True) == [] and said == []
    fit_overrides(tiny_gguf, 99, True, False, log=said.append, rpc=True, devices=[])
    assert said == [NO_GPU]
