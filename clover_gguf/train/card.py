"""clover-tiny's model card (models/clover-tiny/README.md) from its train_log.json: the
architecture, data, training, the quality targets (train/model_checks.py) and how to reproduce
it. Written by train/run.py for scripts/train_clover_tiny.py (after training, or alone with --card-only)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ..outputs import write_text


def run_commands(log: dict) -> list[str]:
    """The command of each part of a resumed run (log["runs"]), else the one command."""
    runs = [r for r in log.get("runs", []) if r.get("command")]
    if len(runs) < 2:
        return [log.get("command", "python scripts/train_clover_tiny.py --time-budget-min 43")]
    return [
        f"# part {i + 1}: from step {r['step']:,} ({r['tokens']:,} tokens, {r['elapsed_s'] / 60:.1f} min)"
        + (", a warm restart from the saved model" if r.get("warm_restart") else "")
        + f"\n{r['command']}"
        for i, r in enumerate(runs)
    ]


def quality_section(fin: dict) -> list[str]:
    """The model card's quality part: the three targets, then the details of each."""
    if not fin.get("targets"):
        return ["## Quality", "", "(not measured: run with --eval-only)", ""]
    ho, tp, fn, t = fin["heldout"], fin["thirdparty"], fin["functions"], fin["targets"]

    def yes(k):
        return "yes" if t[k]["met"] else "**no**"

    lines = [
        "## Quality",
        "",
        "Measured by `python scripts/train_clover_tiny.py --eval-only` (`clover_gguf/train/model_checks.py`) on the "
        "BF16 `model.safetensors`, computed in float32. Masked NLL: the text cut into sequences of 1024 tokens "
        "(64 blocks of 16, earlier clean blocks committed as history), half of each block's tokens masked (fixed "
        "seed), cross entropy on the masked tokens; the unigram (add-one) is scored on exactly the same tokens.",
        "",
        "| target | clover-tiny | bound | met |",
        "|---|---|---|---|",
        f"| held-out stdlib: masked NLL / unigram of the train split | {ho['ratio']:.3f} "
        f"({ho['bits_per_token']:.3f} / {ho['unigram_bits_per_token']:.3f} bits/token) | <= 0.75 | "
        f"{yes('heldout_ratio')} |",
        f"| third-party ({tp['wheel']}): masked NLL / unigram of the package's other files | {tp['ratio']:.3f} "
        f"({tp['bits_per_token']:.3f} / {tp['unigram_bits_per_token']:.3f} bits/token) | <= 0.8 | "
        f"{yes('thirdparty_ratio')} |",
        f"| function prompts whose greedy body `ast.parse` accepts | {fn['n_parse']} / {fn['n_prompts']} | "
        f">= half | {yes('functions_parse')} |",
        *issue_23_rows(fin),
        "",
        f"Held-out stdlib: {ho['n_masked']:,} masked of {ho['n_tokens']:,} tokens. Third-party: `{tp['wheel']}` "
        f"(sha256 `{tp['wheel_sha256'][:16]}...`, in `evaldata/thirdparty/`, read as a zip, never installed); "
        f"the unigram is fit on its {len(tp['fit_files'])} files at even positions of the sorted list, the "
        f"{len(tp['scored_files'])} others are scored ({tp['n_masked']:,} masked of {tp['n_tokens']:,} tokens).",
        "",
        "## Completions",
        "",
        f"The {fn['n_prompts']} prompts of `evaldata/function-prompts.json`, {fn['settings']}, PyTorch reference. "
        "The body is cut at the first line back at column 0 (and, when the token limit cut the text, its last "
        "line is dropped); it passes when it holds a statement and `ast.parse(prompt + body)` accepts it. "
        "The first six (\u2588 marks where the prompt ends):",
        "",
    ]
    for r in fn["rows"][:6]:
        lines += [
            f"{'parses' if r['parses'] else 'does not parse'}:",
            "",
            "```python",
            r["prompt"] + "\u2588" + r["completion"],
            "```",
            "",
        ]
    return lines


def issue_23_rows(fin: dict) -> list[str]:
    """The chat and parallelism rows of the quality table (clover-tiny v3), when measured."""
    t, rows = fin["targets"], []

    def row(label, key, value, bound):
        if key in t:
            rows.append(f"| {label} | {value} | {bound} | {'yes' if t[key]['met'] else '**no**'} |")

    if "function_speed" in fin:
        sp = fin["function_speed"]
        row("tokens per step, threshold 0.9, function prompts (greedy, 64 tokens)", "functions_tokens_per_step",
            f"{sp['tokens_per_step']:.2f}", ">= 1.5")  # fmt: skip
    tl = fin.get("tools")
    if tl:

        def pct(k):
            return "–" if tl.get(k) is None else f"{100 * tl[k]:.1f} %"

        row(f"held-out tool transcripts: expected calls answered by a schema-valid call ({tl['expected_calls']} "
            "calls, `clover-gguf eval tools`, BF16, free decoding)", "tools_valid_calls", pct("valid_calls"), ">= 80 %")  # fmt: skip
        row("... with the right tool name", "tools_right_name", pct("name_accuracy"), ">= 70 %")
        v = tl.get("tokens_per_step_call")
        row("tokens per step inside tool calls (threshold 0.9)", "tools_call_tokens_per_step",
            "–" if v is None else f"{v:.2f}", ">= 2")  # fmt: skip
    return rows


def chat_note(log: dict) -> list[str]:
    """What a run with chat transcripts mixed in trained on, and where it started."""
    ch, parent = log.get("data", {}).get("chat"), log.get("init_from")
    out = []
    if parent:
        out += [
            f"This run started from the weights of `{parent['path']}` ({parent.get('tokens') or 0:,} tokens trained "
            "there; its train_log is kept under `init_from`), with a new optimizer and its own schedule.",
            "",
        ]
    if ch:
        L = ch["tokens_per_transcript"]
        out += [
            f"Mixed in: {ch['transcripts']:,} chat transcripts ({ch['tokens']:,} tokens; per transcript mean "
            f"{L['mean']:.0f}, p10 {L['p10']}, median {L['p50']}, p90 {L['p90']}, max {L['max']}) written by "
            f"`clover_gguf/train/transcripts.py` (generator {ch['generator']}, seed {ch['seed']}) about train-split "
            "modules only: requests, thinking, tool calls with real paths, names and lines, tool results, answers, "
            "rendered through the chat template as the server renders them. A share of "
            f"{ch['ratio']} of the batches are chat windows of about {ch['seq_tokens']} tokens, each starting "
            "where a transcript does; the loss is the same NELBO "
            + (
                "on the tokens the assistant writes (from after `<|im_start|>assistant\\n` through `<|im_end|>`), "
                "the rest of the window clean context, as a prompt at inference."
                if ch.get("loss") == "assistant"
                else "on every token of the window."
            ),
            "",
        ]
    return out


def docstrings_note(log: dict) -> list[str]:
    """Which parts of the run trained on docstrings cut to their first paragraph."""
    runs = log.get("runs", [])
    cut = [i for i, r in enumerate(runs) if re.search(r"--docstrings[= ]summary\b", r.get("command") or "")]
    if not cut:
        return []
    d = log.get("data", {})
    parts = ", ".join(str(i + 1) for i in cut)
    return [
        f"Part{'s' if len(cut) > 1 else ''} {parts} of the run (from step {runs[cut[0]]['step']:,}) trained on the "
        "same files with every docstring longer than its first paragraph cut to that paragraph (`--docstrings "
        "summary`, `clover_gguf/train/data.py:summary_docstrings`; the stream is "
        f"{d.get('stream_tokens', 0):,} tokens instead of {d.get('train_tokens', 0):,}): the stdlib's long "
        "docstrings had taught the model to open a docstring after a signature and not close it. Every "
        "evaluation (held-out, third-party, the unigram baselines) uses the files as they are.",
        "",
    ]


# what each --precision keeps in which dtype, for the training section
PRECISION_TEXT = {
    "bf16": "BF16 weights and activations, float32 master weights/optimizer",
    "autocast": "float32 weights, BF16 autocast",
    "fp32": "float32 throughout",
}

# the config.json keys of the Architecture table, in its order
ARCHITECTURE_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "conv_kernel_size",
    "block_size",
    "rope_theta",
    "rms_norm_eps",
    "mask_token_id",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def write_model_card(out: Path, log: dict) -> Path:
    """models/clover-tiny/README.md from train_log.json (re-run with --card-only)."""
    lines = [
        *intro_section(log),
        *architecture_section(log),
        *data_section(log),
        *docstrings_note(log),
        *chat_note(log),
        *training_section(log),
        *quality_section(log.get("final", {})),
        *reproduce_section(log),
    ]
    return write_text(Path(out) / "README.md", "\n".join(lines))


def param_counts(log: dict) -> tuple[int, int | None]:
    """(total, active per token) parameters from the model config; the log's n_params and no
    active count when the config cannot be read."""
    try:
        from ..config import CloverConfig

        cfg = CloverConfig.from_dict(log["model_config"])
        n_total = cfg.n_params()
        per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
        return n_total, n_total - cfg.num_hidden_layers * (cfg.num_experts - cfg.num_experts_per_tok) * per_expert
    except Exception:
        return log.get("n_params"), None


def intro_section(log: dict) -> list[str]:
    """The title, what the model is and its files."""
    return [
        "# clover-tiny",
        "",
        "A tiny Clover (block-diffusion mixture-of-experts, the spec, `shared/spec/CLOVER.md`) trained "
        + (
            f"from the weights of `{log['init_from']['path']}` on the Python standard library and chat transcripts "
            "with tool calls about it"
            if log.get("init_from")
            else "from scratch on the Python standard library"
        )
        + ", on CPU, to exercise the clover-gguf toolkit end to end (converter, llama.cpp runtime, eval, server) "
        "with a model whose outputs are not random. It is a test model, not a useful code model.",
        "",
        "Files: `model.safetensors` (BF16, HF names, per-expert layout), `config.json`, `tokenizer.json` + "
        "`tokenizer_config.json` (byte-level BPE trained on the same train split), `train_log.json` (config, "
        "per-step log, evals, final numbers), `loss.png`.",
        "",
    ]


def architecture_section(log: dict) -> list[str]:
    """The config table and the parameter count."""
    c = log["model_config"]
    n_total, n_active = param_counts(log)
    return [
        "## Architecture",
        "",
        "| key | value |",
        "|---|---|",
        *(f"| {k} | {c[k]} |" for k in ARCHITECTURE_KEYS),
        "",
        f"Parameters: {n_total:,} in total"
        + (f", about {n_active:,} active per token" if n_active else "")
        + f" ({n_total * 2 / 1e6:.1f} MB in BF16).",
        "",
    ]


def data_section(log: dict) -> list[str]:
    """The train and held-out splits of the standard library."""
    d = log.get("data", {})
    return [
        "## Data",
        "",
        f"The `*.py` files of the Python {d.get('python_version', '?')} standard library (test directories "
        "excluded; see `clover_gguf/train/data.py`). Held out: whole top-level modules, about 5 % of the bytes, listed "
        "in `evaldata/heldout-stdlib.json`; neither the tokenizer nor the model saw them.",
        "",
        f"- train: {d.get('train_files', '?')} files, {d.get('train_tokens', 0):,} tokens",
        f"- held-out: {d.get('heldout_files', '?')} files ({', '.join(d.get('heldout_modules', []))}), "
        f"{d.get('heldout_tokens', 0):,} tokens",
        "",
        "Token streams have `<|endoftext|>` between files.",
        "",
    ]


def training_section(log: dict) -> list[str]:
    """The objective, the optimizer and batch settings, how long it trained and its final loss."""
    tc, d, steps = log["train_config"], log.get("data", {}), log["steps"]
    last = steps[-min(len(steps), 20) :]
    tps = [r["tok_per_s"] for r in steps if "tok_per_s" in r]
    ln2 = np.log(2)
    return [
        "## Training",
        "",
        "Block-diffusion NELBO (spec section 6, `clover_gguf/train/trainer.py`): windows of the train stream; per sequence "
        "a random first-block length r in [1, B] (block 0 = r tokens + padding, positions contiguous); the clean "
        "blocks are committed layer-parallel with the chunked delta rule and every noisy block (tokens masked with "
        "probability t ~ U(1e-3, 1] per block, stratified over the batch) is run against the clean state at its "
        "start; loss = sum of masked-token cross entropy / t over the number of real tokens. Block size drawn "
        f"per batch from {tc['block_sizes']} with probabilities {tc['block_probs']}.",
        "",
        f"- optimizer: AdamW (betas {tc['betas']}, weight decay {tc['weight_decay']} on matrices), peak lr "
        f"{tc['lr']}, {tc['warmup_steps']} warmup steps, cosine to {tc['min_lr_frac']} x peak over the time "
        f"budget ({tc['time_budget_min']} min), grad-norm clip {tc['grad_clip']}"
        + "".join(
            f"; warm restart at step {r['step']:,} from the saved model (its checkpoint was lost): new optimizer "
            "state, the warmup climbing to the cosine's value there"
            for r in log.get("runs", [])
            if r.get("warm_restart")
        ),
        f"- batch: about {tc['tokens_per_batch']} real tokens (windows of about {tc['seq_tokens']} tokens)",
        f"- precision: {tc['precision']} ({PRECISION_TEXT.get(tc['precision'], tc['precision'])}; "
        "norms, softmaxes, router and delta rule in float32 as the model does); seed "
        f"{tc['seed']}; {tc['threads']} torch thread(s)",
        "- init: normal(0, 0.02) (residual output projections / sqrt(2 n_layer)), norms 1, A_log = log U(1,16), "
        "dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 0.1], calibration 1, conv scale 1",
        "",
        f"Trained {log['step']:,} steps, {log['tokens']:,} tokens "
        f"({log['tokens'] / max(d.get('train_tokens', 1), 1):.2f} epochs) in {log['elapsed_s'] / 60:.1f} min "
        f"wall on this project's 2-core CPU (no GPU was lent to this task). Throughput: median "
        f"{np.median(tps) if tps else float('nan'):.0f} tokens/s (range {min(tps) if tps else 0:.0f} to "
        f"{max(tps) if tps else 0:.0f}; real tokens, both streams computed), from the per-step log.",
        "",
        f"Final train loss (mean of the last {len(last)} steps): NELBO {np.mean([r['loss'] for r in last]):.3f} "
        f"nats/token = {np.mean([r['loss'] for r in last]) / ln2:.3f} bits/token; unweighted masked CE "
        f"{np.mean([r['masked_ce'] for r in last]) / ln2:.3f} bits/token.",
        "",
        "![loss](loss.png)",
        "",
        "Train-step speed: `python scripts/train_clover_tiny.py --bench 8x16x17 --threads N` (random tokens, "
        "median of 8 steps); figures in `evaldata/speed/train-step.md`.",
        "",
    ]


def reproduce_section(log: dict) -> list[str]:
    """The model's limitations and the commands that trained it."""
    return [
        f"Limitations: {log['tokens'] / 1e6:.1f}M training tokens of one corpus (the standard library). The model "
        "writes Python-shaped text (indentation, names, calls, docstrings), not working programs; it exists to "
        "exercise the toolkit (converter, runtime, quantization reports) with predictions that are not flat.",
        "",
        "## Reproduce",
        "",
        "```sh",
        ". .venv/bin/activate",
        "# tokenizer.json / tokenizer_config.json: scripts/train_tokenizer.py (already in the model folder);",
        "# the script encodes the train/held-out streams itself (cached in .cache/tokens)",
        *run_commands(log),
        "```",
        "",
        "Training is seeded, but a time budget makes the number of steps depend on the machine's speed; "
        "`--max-steps N` (no time budget) gives a fixed schedule. `--resume out/clover-tiny-train/ckpt-last.pt` "
        "continues from the last checkpoint (written every few minutes); with the checkpoint gone, `--resume "
        "models/clover-tiny` restarts warm from the saved model (new optimizer state).",
        "",
    ]
