"""click commands of `clover-gguf eval ...` and `clover-gguf report` (thin: parse options,
call one library function). Registered in clover_gguf/cli.py."""

from __future__ import annotations

import math
from pathlib import Path

import click

from ..constants import DEFAULT_THRESHOLD
from ..options import RANGES, InputPath, int_list, option_type

POS = option_type("count")
THREADS = option_type("threads")
BLOCK = option_type("block_size")
STEPS = option_type("steps")
UNIT = option_type("threshold")
SEED = option_type("seed")
MAX_NEW = option_type("max_new_tokens")
NGL = option_type("n_gpu_layers")


def _ratios(s: str) -> tuple[float, ...]:
    try:
        r = tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"--ratios {s!r}: comma-separated numbers expected") from None
    if not r or any(not (math.isfinite(x) and 0 < x <= 1) for x in r):
        raise click.BadParameter(f"--ratios {s!r}: every mask ratio must be in (0, 1]")
    return r


def _top_k(s):
    if str(s) == "auto":
        return "auto"
    try:
        k = int(s)
    except ValueError:
        raise click.BadParameter(f"--top-k {s!r}: a number or auto") from None
    if not RANGES["vocab"].ok(k):
        raise click.BadParameter(f"--top-k {s}: must be {RANGES['vocab'].describe()} (or auto)")
    return k


def _sampling(corpus, n_windows, n_blocks, block_size, ratios, seed, top_k):
    from .quality.run import Sampling

    return Sampling(
        corpus=list(corpus) or None,
        n_windows=n_windows,
        n_blocks=n_blocks,
        block_size=block_size,
        ratios=_ratios(ratios),
        seed=seed,
        top_k=_top_k(top_k),
    )


def _sample_options(f):
    opts = [
        click.option(
            "--corpus",
            "corpus",
            multiple=True,
            type=InputPath(dir_okay=False),
            help='Text files or JSONL ({"text": ...} per line); default: the held-out stdlib '
            "modules (evaldata/heldout-stdlib.json).",
        ),
        click.option(
            "--windows", "n_windows", default=6, show_default=True, type=POS, help="Windows sampled from the corpus."
        ),
        click.option(
            "--blocks", "n_blocks", default=64, show_default=True, type=POS, help="Blocks per window (max history + 1)."
        ),
        click.option("--block-size", type=BLOCK, default=None, help="Block size (default: the model's)."),
        click.option("--ratios", default="0.15,0.5,0.85,1.0", show_default=True, help="Mask ratios."),
        click.option("--seed", default=1234, show_default=True, type=SEED),
        click.option(
            "--top-k",
            default="auto",
            show_default=True,
            help="Reference logits kept per position: a number, or auto (smallest of 256/512/1024/2048 "
            "leaving a mean tail mass <= 1e-3 on the first window).",
        ),
        click.option("--threads", type=THREADS, default=None, help="Torch / llama.cpp threads (default: all cores)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


@click.group("eval")
def eval_group():
    """Quality, speed and sensitivity of GGUFs against the BF16 reference."""


@eval_group.command("quality")
@click.option(
    "--reference",
    required=True,
    type=InputPath(file_okay=False),
    help="The BF16 model dir (safetensors + config.json [+ tokenizer]).",
)
@click.argument("ggufs", nargs=-1, required=True, type=InputPath(dir_okay=False))
@_sample_options
@click.option(
    "--backend",
    type=click.Choice(["auto", "reference", "runtime", "both"]),
    default="auto",
    show_default=True,
    help="reference = PyTorch on dequantized weights; runtime = patched llama.cpp; "
    "auto = both when the runtime is built.",
)
@click.option(
    "--prompts",
    type=InputPath(dir_okay=False),
    default=None,
    help="Prompt set (JSONL) for the generation agreement (default evaldata/prompts/clover-tiny-code.jsonl).",
)
@click.option("--n-prompts", type=POS, default=None, help="Use the first N prompts of the prompt set.")
@click.option("--max-new-tokens", default=64, show_default=True, type=MAX_NEW)
@click.option("--steps", "gen_steps", type=STEPS, default=None, help="steps schedule (default block_size/2).")
@click.option("--threshold", "gen_threshold", default=DEFAULT_THRESHOLD, show_default=True, type=UNIT)
@click.option("--no-generation", is_flag=True, help="Skip the generation agreement.")
@click.option("--runtime-threads", type=THREADS, default=None, help="llama.cpp threads (default --threads).")
@click.option("--name", "names", multiple=True, help="Display name per GGUF, in order.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="out/eval/quality", show_default=True)
def quality_cmd(
    reference,
    ggufs,
    corpus,
    n_windows,
    n_blocks,
    block_size,
    ratios,
    seed,
    top_k,
    threads,
    backend,
    prompts,
    n_prompts,
    max_new_tokens,
    gen_steps,
    gen_threshold,
    no_generation,
    runtime_threads,
    names,
    out_dir,
):
    """KL / NLL / top-1 / generation agreement of GGUFs against the reference."""
    from .quality.run import Generation, run_quality
    from .render.report import render

    run_quality(
        reference,
        ggufs,
        _sampling(corpus, n_windows, n_blocks, block_size, ratios, seed, top_k),
        Generation(
            enabled=not no_generation,
            prompts=prompts,
            n_prompts=n_prompts,
            max_new_tokens=max_new_tokens,
            steps=gen_steps,
            threshold=gen_threshold,
        ),
        backend,
        out_dir,
        threads=threads,
        runtime_threads=runtime_threads,
        names=list(names) or None,
    )
    click.echo(f"wrote {render(Path(out_dir) / 'quality.json')}")


@eval_group.command("speed")
@click.argument("ggufs", nargs=-1, type=InputPath(dir_okay=False))
@click.option(
    "--reference",
    type=InputPath(file_okay=False),
    default=None,
    help="BF16 model dir: adds the PyTorch reference row (the speedup baseline) and the prompt text.",
)
@click.option("--runs", default=5, show_default=True, type=POS, help="Recorded runs per figure (median, p10, p90).")
@click.option("--warmup", default=1, show_default=True, type=option_type("warmup"), help="Unrecorded runs before them.")
@click.option(
    "--backend",
    "backends",
    multiple=True,
    type=click.Choice(["auto", "runtime", "reference-dequant", "both"]),
    default=("auto",),
    show_default=True,
)
@click.option("--block-size", default=16, show_default=True, type=BLOCK)
@click.option("--steps", type=STEPS, default=None, help="steps schedule (default: threshold schedule).")
@click.option("--threshold", default=DEFAULT_THRESHOLD, show_default=True, type=UNIT)
@click.option("--prompt-len", default=64, show_default=True, type=option_type("prompt_len"))
@click.option("--max-new-tokens", default=64, show_default=True, type=MAX_NEW)
@click.option(
    "--sweep",
    "sweeps",
    multiple=True,
    help="PARAM=V1,V2,... over block_size, threshold, steps, prompt_len, max_new_tokens (one at a time).",
)
@click.option("--threads", type=THREADS, default=None)
@click.option("--runtime-threads", type=THREADS, default=None, help="llama.cpp threads (default --threads).")
@click.option(
    "--n-gpu-layers",
    "n_gpu_layers",
    default=0,
    show_default=True,
    type=NGL,
    help="llama.cpp layers offloaded to the GPU.",
)
@click.option("--name", "names", multiple=True)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="out/eval/speed", show_default=True)
def speed_cmd(
    ggufs,
    reference,
    runs,
    warmup,
    backends,
    block_size,
    steps,
    threshold,
    prompt_len,
    max_new_tokens,
    sweeps,
    threads,
    runtime_threads,
    n_gpu_layers,
    names,
    out_dir,
):
    """Prompt/generation tokens/s, step time, load time, peak memory, each over N runs."""
    from .bench.speed import parse_sweep, run_speed
    from .render.report import render

    if not ggufs and not reference:
        raise click.UsageError("give GGUF files and/or --reference")
    try:
        sw = parse_sweep(sweeps)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    base = {
        "block_size": block_size,
        "steps": steps,
        "threshold": None if steps else threshold,
        "prompt_len": prompt_len,
        "max_new_tokens": max_new_tokens,
    }
    run_speed(
        ggufs,
        reference,
        backends,
        runs,
        warmup,
        threads,
        base,
        sw,
        out_dir,
        names=list(names) or None,
        runtime_threads=runtime_threads,
        n_gpu_layers=n_gpu_layers,
    )
    click.echo(f"wrote {render(Path(out_dir) / 'speed.json')}")


@eval_group.command("passes")
@click.option(
    "--layers", default="2,4", show_default=True, callback=int_list("layers"), help="Synthetic Clover-35B-A3B depths."
)
@click.option("--threads", default="1,2", show_default=True, callback=int_list("threads"))
@click.option(
    "--head", "heads", multiple=True, type=click.Choice(["q8_0", "q4_k_m"]), help="lm_head variant(s) [default: both]."
)
@click.option(
    "--rounds", default=5, show_default=True, type=option_type("rounds"), help="Recorded rounds (after one warm-up)."
)
@click.option("-ngl", "--n-gpu-layers", "n_gpu_layers", default=0, show_default=True, type=NGL)
@click.option(
    "--work",
    type=click.Path(file_okay=False),
    default="out/bench-passes-work",
    show_default=True,
    help="Where the synthetic GGUFs and their Qwen3-MoE twins are written (reused).",
)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="out/bench-passes", show_default=True)
def passes_cmd(layers, threads, heads, rounds, n_gpu_layers, work, out_dir):
    """Clover's commit, denoising step, prefill and generation side by side with llama.cpp's own
    passes on a Qwen3-MoE twin (same tensors byte for byte), in one build and one process.
    Run it on a quiet machine: nothing else building, training or testing.

    \b
    clover-gguf eval passes --layers 2,4 --threads 1,2
    clover-gguf eval passes --layers 40 --threads 16 -ngl 99 --head q4_k_m --rounds 3
    """
    from .bench.passes import PassesConfig, run_passes

    cfg = PassesConfig(
        layers=layers,
        threads=threads,
        heads=tuple(heads) or ("q8_0", "q4_k_m"),
        rounds=rounds,
        n_gpu_layers=n_gpu_layers,
        work=Path(work),
        out=Path(out_dir),
    )
    run_passes(cfg, log=lambda m: click.echo(m, err=True))
    click.echo(f"report: {Path(out_dir) / 'report.md'}")


@eval_group.command("sensitivity")
@click.option("--reference", required=True, type=InputPath(file_okay=False))
@click.option(
    "--type",
    "qtypes",
    multiple=True,
    help="Type given to one group at a time [default: q4_k]; repeatable: one run per type under OUT/TYPE/.",
)
@click.option("--imatrix", type=InputPath(dir_okay=False), help="GGUF imatrix for the quantized group.")
@click.option("--base", default="bf16", show_default=True, help="Type of every other 2-D weight.")
@click.option(
    "--group",
    "groups",
    multiple=True,
    help="Groups of constants.TENSOR_GROUPS (default: experts_gate_up, "
    "experts_down, attention, memory, shared_expert, embeddings, output).",
)
@_sample_options
@click.option("--keep", is_flag=True, help="Keep the per-group GGUFs.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="out/eval/sensitivity", show_default=True)
def sensitivity_cmd(
    reference,
    qtypes,
    imatrix,
    base,
    groups,
    corpus,
    n_windows,
    n_blocks,
    block_size,
    ratios,
    seed,
    top_k,
    threads,
    keep,
    out_dir,
):
    """KL and bytes of each tensor group quantized alone (per type: the curves `plan` and
    `--recipe fit:SIZE` use)."""
    from ..convert import quants
    from .quality.sensitivity import DEFAULT_GROUPS, DEFAULT_QTYPE, run_sensitivity
    from .render.report import render

    qtypes = list(qtypes) or [DEFAULT_QTYPE]
    for t in qtypes:
        quants.parse_type(t)  # a bad name fails before any conversion
    for t in qtypes:
        d = Path(out_dir) / t if len(qtypes) > 1 else Path(out_dir)
        run_sensitivity(
            reference,
            d,
            tuple(groups) or DEFAULT_GROUPS,
            t,
            base,
            keep=keep,
            sampling=_sampling(corpus, n_windows, n_blocks, block_size, ratios, seed, top_k),
            threads=threads,
            imatrix=imatrix,
        )
        click.echo(f"wrote {render(d / 'sensitivity.json')}")


@eval_group.command("baseline")
@click.option("--reference", required=True, type=InputPath(file_okay=False))
@click.option(
    "--out", "out_dir", type=click.Path(file_okay=False), default="evaldata/baseline/clover-tiny", show_default=True
)
@click.option(
    "--work",
    "work_dir",
    type=click.Path(file_okay=False),
    default="out/eval/baseline-work",
    show_default=True,
    help="Where the GGUFs and the reference-logit cache go (not committed).",
)
@click.option("--windows", "n_windows", default=6, show_default=True, type=POS)
@click.option("--blocks", "n_blocks", default=64, show_default=True, type=POS)
@click.option("--runs", default=5, show_default=True, type=POS)
@click.option("--sweep", "sweeps", multiple=True, default=("block_size=8,16,32,64",), show_default=True)
@click.option("--n-prompts", type=POS, default=None, help="Use the first N prompts of the prompt set.")
@click.option(
    "--max-new-tokens",
    default=64,
    show_default=True,
    type=MAX_NEW,
    help="Generation length (quality and speed).",
)
@click.option("--sens-type", default="q4_k", show_default=True)
@click.option("--sens-windows", type=POS, default=None, help="Windows for the sensitivity run (default: --windows).")
@click.option("--no-speed", is_flag=True)
@click.option("--no-sensitivity", is_flag=True)
@click.option(
    "--stage",
    type=click.Choice(["all", "files", "quality", "sensitivity", "speed", "bundle"]),
    default="all",
    show_default=True,
    help="Run one stage (each writes its JSON in the work dir; 'bundle' gathers them).",
)
@click.option(
    "--summary-file",
    type=InputPath(dir_okay=False),
    default=None,
    help="Markdown put at the top of the report (bundle stage).",
)
@click.option(
    "--reference-sweep/--no-reference-sweep",
    default=False,
    show_default=True,
    help="Also sweep the PyTorch reference row (slow on CPU).",
)
@click.option("--threads", type=THREADS, default=None)
@click.option(
    "--runtime-threads",
    type=THREADS,
    default=None,
    help="llama.cpp threads (default --threads); 1 on an oversubscribed machine, where ggml's spinning "
    "thread pool stalls.",
)
@click.option(
    "--add",
    "add_names",
    multiple=True,
    metavar="NAME",
    help="Only convert and score these files (e.g. Q3_K-experts, IQ3_S-experts, IQ2_M-experts) and add their "
    "quality rows to the existing report in --out; the sample options must be the report's.",
)
@click.option(
    "--imatrix",
    type=InputPath(dir_okay=False),
    default=None,
    help="Importance matrix for the --add files' conversion.",
)
def baseline_cmd(
    reference,
    out_dir,
    work_dir,
    n_windows,
    n_blocks,
    runs,
    sweeps,
    n_prompts,
    max_new_tokens,
    sens_type,
    sens_windows,
    no_speed,
    no_sensitivity,
    stage,
    summary_file,
    reference_sweep,
    threads,
    runtime_threads,
    add_names,
    imatrix,
):
    """Convert the standard GGUF set and write the committed baseline report."""
    from .baseline import add_rows, run_baseline
    from .bench.speed import DEFAULT_BASE, parse_sweep
    from .quality.run import Generation, Sampling

    if imatrix and not add_names:
        raise click.UsageError("--imatrix goes with --add (the standard set is converted without one)")
    if add_names:
        add_rows(
            reference,
            out_dir,
            work_dir,
            list(add_names),
            imatrix=imatrix,
            sampling=Sampling(n_windows=n_windows, n_blocks=n_blocks),
            generation=Generation(n_prompts=n_prompts, max_new_tokens=max_new_tokens),
            threads=threads,
            runtime_threads=runtime_threads,
        )
        click.echo(f"wrote {Path(out_dir) / 'report.md'} (added {', '.join(add_names)})")
        return

    run_baseline(
        reference,
        out_dir,
        work_dir,
        speed=not no_speed,
        sensitivity=not no_sensitivity,
        sampling=Sampling(n_windows=n_windows, n_blocks=n_blocks),
        generation=Generation(n_prompts=n_prompts, max_new_tokens=max_new_tokens),
        threads=threads,
        runtime_threads=runtime_threads,
        speed_kw={
            "runs": runs,
            "sweeps": parse_sweep(sweeps),
            "threads": threads,
            "runtime_threads": runtime_threads,
            "sweep_reference": reference_sweep,
            "base": {**DEFAULT_BASE, "max_new_tokens": max_new_tokens},
        },
        sens_kw={"qtype": sens_type, "n_windows": sens_windows or n_windows},
        stage=stage,
        summary=Path(summary_file).read_text() if summary_file else None,
    )
    if stage in ("all", "bundle"):
        click.echo(f"wrote {Path(out_dir) / 'report.md'}")
    else:
        click.echo(f"stage {stage} done ({work_dir})")


@eval_group.command("tools")
@click.option(
    "--reference",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="The BF16 model dir (safetensors + config.json + tokenizer): the free-decoding baseline.",
)
@click.argument("ggufs", nargs=-1, type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--heldout",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Held-out transcripts (JSONL, tools.json beside it) [evaldata/tools/heldout.jsonl].",
)
@click.option("--limit", type=POS, default=None, help="Only the first N transcripts.")
@click.option(
    "--modes",
    default="free,constrained",
    show_default=True,
    help="Decoding of the GGUFs: free, constrained (the server's tool_choice auto grammar), or both.",
)
@click.option("--max-new-tokens", default=160, show_default=True, type=option_type("max_new_tokens"))
@click.option("--block-size", type=BLOCK, default=None, help="Block size (default: the model's).")
@click.option(
    "--steps", type=option_type("steps"), default=None, help="steps schedule (default: the threshold schedule)."
)
@click.option("--threshold", default=DEFAULT_THRESHOLD, show_default=True, type=UNIT)
@click.option("--temperature", default=0.0, show_default=True, type=option_type("temperature"))
@click.option("--repeats", default=1, show_default=True, type=POS, help="Seeds per turn (needs --temperature > 0).")
@click.option("--seed", default=0, show_default=True, type=option_type("seed"))
@click.option(
    "--stability-turns",
    default=20,
    show_default=True,
    type=click.IntRange(0, 1 << 20),
    help="Formatting stability inside a block on this many call turns (0: skip).",
)
@click.option("--threads", type=THREADS, default=None)
@click.option("--name", "names", multiple=True, help="Display name per GGUF, in order.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="out/eval/tools", show_default=True)
def tools_cmd(reference, ggufs, heldout, limit, modes, max_new_tokens, block_size, steps, threshold, temperature,
              repeats, seed, stability_turns, threads, names, out_dir):  # fmt: skip
    """Tool calls on held-out chat transcripts: call rate, right names, JSON and schema validity,
    exact arguments against BF16, calls where none is expected, tokens per step in calls vs prose,
    free and constrained, and formatting stability inside a block.

    \b
    clover-gguf eval tools --reference models/clover-tiny out/tiny-q4_k.gguf out/tiny-q8_0.gguf
    clover-gguf eval tools --reference models/clover-tiny a.gguf --limit 20 --modes free --stability-turns 5
    clover-gguf eval tools --reference models/clover-tiny a.gguf --temperature 0.7 --repeats 5
    """
    import torch

    from .quality.tools import ToolsConfig, run_tools

    if threads:
        torch.set_num_threads(threads)
    cfg = ToolsConfig(
        heldout=heldout,
        limit=limit,
        modes=_words(modes),
        max_new_tokens=max_new_tokens,
        block_size=block_size,
        steps=steps,
        threshold=threshold,
        temperature=temperature,
        repeats=repeats,
        seed=seed,
        stability_turns=stability_turns,
        threads=threads,
    )
    run_tools(reference, list(ggufs), cfg, out_dir, names=list(names) or None, log=click.echo)
    click.echo(f"wrote {Path(out_dir) / 'report.md'}")


def _words(value: str) -> tuple[str, ...]:
    """A comma-separated option's items."""
    return tuple(w.strip() for w in value.split(",") if w.strip())


def _csv_ints(name: str):
    def parse(ctx, param, value):
        try:
            out = tuple(int(x) for x in str(value).split(",") if x.strip())
        except ValueError:
            raise click.BadParameter(f"{value!r}: comma-separated integers expected") from None
        if not out:
            raise click.BadParameter(f"{value!r}: at least one value")
        return out

    return parse


@eval_group.command("memory")
@click.option(
    "--reference",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="The BF16 model dir (safetensors + config.json + tokenizer): the free-decoding baseline.",
)
@click.argument("ggufs", nargs=-1, type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--block-sizes",
    default="8,16,32,64",
    show_default=True,
    callback=_csv_ints("block-sizes"),
    help="Block sizes (generation and prefill), one run of every trace each.",
)
@click.option(
    "--n-results",
    default="1,4,16,64",
    show_default=True,
    callback=_csv_ints("n-results"),
    help="Tool results between the fact (or instruction) and the final request.",
)
@click.option(
    "--seeds", default=3, show_default=True, type=POS, help="Independent draws of the traces (median, p10, p90)."
)
@click.option("--traces", default=1, show_default=True, type=POS, help="Traces per kind and seed.")
@click.option(
    "--kinds",
    default=",".join(("recall_request", "recall_result", "comply_tests", "comply_grep", "comply_sentence")),
    show_default=True,
    help="Trace kinds (train/memory_traces.py).",
)
@click.option(
    "--controls/--no-controls",
    default=True,
    show_default=True,
    help="Also run the compliance traces without their instruction (the rule's base rate).",
)
@click.option(
    "--probe/--no-probe",
    default=True,
    show_default=True,
    help="Recall traces: also score the fact's path against paths the trace never mentions (a likelihood).",
)
@click.option(
    "--modes",
    default="free,constrained",
    show_default=True,
    help="Decoding of the GGUFs: free, constrained (the server's tool_choice auto grammar), or both.",
)
@click.option("--max-new-tokens", default=64, show_default=True, type=option_type("max_new_tokens"))
@click.option(
    "--steps", type=option_type("steps"), default=None, help="steps schedule (default: the threshold schedule)."
)
@click.option("--threshold", default=DEFAULT_THRESHOLD, show_default=True, type=UNIT)
@click.option("--temperature", default=0.0, show_default=True, type=option_type("temperature"))
@click.option("--first-seed", default=0, show_default=True, type=option_type("seed"), help="The first trace seed.")
@click.option("--threads", type=THREADS, default=None)
@click.option("--name", "names", multiple=True, help="Display name per GGUF, in order.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="out/eval/memory", show_default=True)
def memory_cmd(reference, ggufs, block_sizes, n_results, seeds, traces, kinds, controls, probe, modes,
               max_new_tokens, steps, threshold, temperature, first_seed, threads, names, out_dir):  # fmt: skip
    """Memory after N tool results: exact recall of an early fact and compliance with an early
    instruction in long synthetic agent traces (held-out files), by distance in tokens and block
    size, with tokens per step beside them; median and p10/p90 over seeds.

    \b
    clover-gguf eval memory --reference models/clover-tiny-v3-wip a.gguf b.gguf --threads 1
    clover-gguf eval memory --reference models/clover-tiny-v3-wip a.gguf --block-sizes 16 --n-results 1,4 --seeds 1
    clover-gguf eval memory --reference models/clover-tiny-v3-wip a.gguf --modes constrained --traces 2
    """
    import torch

    from .quality.memory import MemoryConfig, run_memory

    if threads:
        torch.set_num_threads(threads)
    cfg = MemoryConfig(
        block_sizes=block_sizes,
        n_results=n_results,
        seeds=seeds,
        first_seed=first_seed,
        traces=traces,
        kinds=_words(kinds),
        controls=controls,
        probe=probe,
        modes=_words(modes),
        max_new_tokens=max_new_tokens,
        steps=steps,
        threshold=threshold,
        temperature=temperature,
        threads=threads,
    )
    run_memory(reference, list(ggufs), cfg, out_dir, names=list(names) or None, log=click.echo)
    click.echo(f"wrote {Path(out_dir) / 'report.md'}")


@eval_group.command("agent")
@click.argument("model", required=False, type=InputPath(dir_okay=False))
@click.option("--url", help="A running clover-gguf serve (default http://127.0.0.1:8080 when no MODEL is given).")
@click.option("--api-key", envvar="CLOVER_GGUF_API_KEY", help="The server's API key.")
@click.option("--traces", multiple=True, type=InputPath(), help="Trace files/folders [evaldata/agent].")
@click.option(
    "--repeats", default=3, show_default=True, type=POS, help="Replays per trace and mode (median, p10, p90)."
)
@click.option("--max-tokens", default=64, show_default=True, type=MAX_NEW, help="Reply length per turn.")
@click.option("--block-size", type=BLOCK, help="clover.block_size [default: the model's].")
@click.option("--steps", type=STEPS, help="clover.steps (default: the threshold schedule).")
@click.option("--threshold", type=UNIT, help="clover.threshold [server default 0.9].")
@click.option("-t", "--threads", type=THREADS, help="Server threads (with MODEL).")
@click.option("-ngl", "--n-gpu-layers", default=0, show_default=True, type=NGL, help="Server GPU layers (with MODEL).")
@click.option("--experts-on-cpu", is_flag=True, help="Server keeps experts on the CPU (with MODEL).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="out/eval/agent", show_default=True)
def agent_cmd(
    model, url, api_key, traces, repeats, max_tokens, block_size, steps, threshold, threads, n_gpu_layers,
    experts_on_cpu, out_dir,
):  # fmt: skip
    """Agent-loop benchmark: replay multi-turn coding-agent traces (evaldata/agent) through the
    openai client, streaming, cold (no state reuse) and warm; report model vs tool time, first
    block, prefill vs reused tokens. With MODEL, starts `clover-gguf serve MODEL` itself.

    \b
    clover-gguf eval agent out/clover-tiny-q4_k.gguf -t 2 --repeats 3
    clover-gguf eval agent --url http://127.0.0.1:8080 --max-tokens 128 --steps 8
    """
    from openai import OpenAIError

    from .bench.agent import run_agent_eval

    clover = {k: v for k, v in (("block_size", block_size), ("steps", steps), ("threshold", threshold)) if v}
    srv = ["-ngl", str(n_gpu_layers)] + (["-t", str(threads)] if threads else [])
    srv += ["--experts-on-cpu"] if experts_on_cpu else []
    srv += ["--api-key", api_key] if api_key else []
    try:
        run_agent_eval(
            model,
            url,
            server_args=tuple(srv),
            out_dir=out_dir,
            traces=list(traces) or None,
            repeats=repeats,
            max_tokens=max_tokens,
            clover=clover,
            api_key=api_key,
            log=lambda m: click.echo(m, err=True),
        )
    except OpenAIError as e:
        raise click.ClickException(f"{type(e).__name__} from {url or 'the server'}: {e}") from None
    click.echo(f"wrote {Path(out_dir) / 'report.md'}")


@eval_group.command("throughput")
@click.argument("model", type=InputPath(dir_okay=False))
@click.option(
    "--parallel",
    "parallel",
    default="1,2,4",
    show_default=True,
    callback=int_list("parallel"),
    help="Concurrent clients N (each against `serve --parallel N`).",
)
@click.option("--runs", default=5, show_default=True, type=POS, help="Runs per N.")
@click.option("--requests", default=2, show_default=True, type=POS, help="Requests per client.")
@click.option("--max-tokens", default=64, show_default=True, type=MAX_NEW)
@click.option("--block-size", type=BLOCK, help="clover.block_size [default: the model's].")
@click.option("--steps", type=STEPS, help="clover.steps (default: the threshold schedule).")
@click.option("-t", "--threads", type=THREADS, help="Server threads.")
@click.option("-ngl", "--n-gpu-layers", default=0, show_default=True, type=NGL)
@click.option("--rpc", metavar="HOST:PORT[,...]", help="Server offloads to these rpc-servers.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="out/eval/throughput", show_default=True)
def throughput_cmd(model, parallel, runs, requests, max_tokens, block_size, steps, threads, n_gpu_layers, rpc, out_dir):
    """Serving throughput: total tok/s of N concurrent clients against `clover-gguf serve MODEL
    --parallel N` for each N (median, p10/p90 over --runs), with the replies checked against
    N = 1's and the server's count of denoising graphs vs sequence steps. Writes
    throughput.json and throughput.md.

    \b
    clover-gguf eval throughput out/clover-tiny-q4_k.gguf -t 2 --parallel 1,2,4 --runs 5
    """
    from openai import OpenAIError

    from .bench.throughput import run_throughput

    clover = {k: v for k, v in (("block_size", block_size), ("steps", steps)) if v}
    srv = ["-ngl", str(n_gpu_layers)] + (["-t", str(threads)] if threads else []) + (["--rpc", rpc] if rpc else [])
    try:
        run_throughput(
            model,
            out_dir,
            parallel=tuple(parallel),
            runs=runs,
            requests=requests,
            max_tokens=max_tokens,
            clover=clover,
            server_args=tuple(srv),
            log=lambda m: click.echo(m, err=True),
        )
    except OpenAIError as e:
        raise click.ClickException(f"{type(e).__name__} from the server: {e}") from None
    click.echo(f"wrote {Path(out_dir) / 'throughput.md'}")


@click.command("report")
@click.argument("run_json", type=InputPath(dir_okay=False))
@click.option(
    "-o",
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Output folder (default: the JSON's folder).",
)
def report_command(run_json, out_dir):
    """Render a saved eval JSON (quality, speed, sensitivity, bundle, tools, memory, passes, agent
    or throughput) to Markdown + PNG."""
    from .render.report import render

    click.echo(f"wrote {render(run_json, out_dir)}")
