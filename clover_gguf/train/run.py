"""A clover-tiny training run as scripts/train_clover_tiny.py drives it, from the script's
options (an argparse namespace): the model and train configs, the token streams, the run
(trainer.train, with its stop clock and exports), the final evaluation, loss.png and the model
card. Each function is one step; the script calls them."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import torch

from ..config import preset
from . import TrainError, streams
from . import trainer as T
from .card import write_model_card
from .distill import distill_stream
from .export import exporter, read_train_log, write_train_log
from .final_eval import final_eval
from .loss_plot import plot_loss
from .step_speed import bench_train_steps


def model_config(a, vocab_size=None):
    """The clover-tiny preset with the options' overrides (--layers, --experts, --top-k, --block-size)."""
    over = {}
    if a.layers:
        over["num_hidden_layers"] = a.layers
    if a.experts:
        over["num_experts"] = a.experts
    if a.top_k:
        over["num_experts_per_tok"] = a.top_k
    if a.block_size:
        over["block_size"] = a.block_size
    if vocab_size:
        over["vocab_size"] = vocab_size
    return preset("clover-tiny", **over)


def train_config(a) -> T.TrainConfig:
    _, ratios, seqs = distill_options(a)
    return T.TrainConfig(
        seed=a.seed,
        lr=a.lr,
        min_lr_frac=a.min_lr_frac,
        weight_decay=a.weight_decay,
        warmup_steps=a.warmup_steps,
        max_steps=a.max_steps,
        max_tokens=a.max_tokens,
        time_budget_min=a.time_budget_min,
        grad_clip=a.grad_clip,
        tokens_per_batch=a.tokens_per_batch,
        seq_tokens=a.seq_tokens,
        block_sizes=tuple(int(x) for x in a.block_sizes.split(",")),
        block_probs=tuple(float(x) for x in a.block_probs.split(",")),
        precision=a.precision or T.default_precision(a.device),
        compile=a.compile,
        threads=a.threads,
        device=a.device,
        ckpt_every_min=a.ckpt_every_min,
        eval_every_min=a.eval_every_min,
        ckpt_dir=a.ckpt_dir,
        out_dir=a.out,
        eval_tokens=a.eval_tokens,
        chat_ratio=a.chat_ratio,
        chat_seq_tokens=a.chat_seq_tokens,
        export_every_min=a.export_every_min,
        certainty=a.certainty,
        copy_ratio=a.copy_ratio,
        distill_ratio=tuple(ratios),
        distill_seq_tokens=tuple(seqs),
        distill_certainty=a.distill_certainty,
    )


def distill_options(a) -> tuple[list, list, list]:
    """(files, ratios, window tokens) of the --distill streams: one --distill-ratio and one
    --distill-seq-tokens for each --distill, or one of each for all of them (ratio 0.2, 64 tokens)."""
    files = a.distill or []

    def per_file(flag: str, vals: list | None, default) -> list:
        vals = vals or [default]
        if files and len(vals) not in (1, len(files)):
            raise TrainError(f"{flag}: give one, or one per --distill ({len(files)}), not {len(vals)}")
        return vals * len(files) if len(vals) == 1 else vals

    return (
        files,
        per_file("--distill-ratio", a.distill_ratio, 0.2),
        per_file("--distill-seq-tokens", a.distill_seq_tokens, 64),
    )


def bench(a, log=print) -> None:
    """--bench: tokens/s of train steps on random tokens (step_speed.py)."""
    bench_train_steps(model_config(a), train_config(a), a.bench, a.bench_steps, log)


def stopper(run_minutes: float | None):
    """should_stop for trainer.train: true after run_minutes, or once SIGINT/SIGTERM came."""
    t_end = time.time() + run_minutes * 60 if run_minutes else None
    signalled = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: signalled.append(True))
    return lambda step: bool(signalled) or (t_end is not None and time.time() > t_end)


def tokenizer_dir(a) -> Path:
    """Where the tokenizer comes from: --init-from's folder for a new run from it, else --out."""
    return Path(a.init_from) if a.init_from and not a.resume else Path(a.out)


def check_inputs(a) -> None:
    """The folders and checkpoint the options name, before any work."""
    if a.eval_only:
        if not (Path(a.out) / "train_log.json").is_file():
            raise TrainError(f"--eval-only: no train_log.json in --out {a.out}")
        return
    if a.resume and not (Path(a.resume).is_file() or (Path(a.resume) / "train_log.json").is_file()):
        raise TrainError(f"--resume {a.resume}: neither a checkpoint nor a model folder with train_log.json")
    if a.init_from and not (Path(a.init_from) / "model.safetensors").is_file():
        raise TrainError(f"--init-from {a.init_from}: no model.safetensors there")
    if not 0 <= a.copy_ratio <= 1 - a.chat_ratio:
        raise TrainError(f"--copy-ratio {a.copy_ratio}: must be in [0, 1 - --chat-ratio ({a.chat_ratio})]")
    files, ratios, seqs = distill_options(a)
    if files and not (all(r > 0 for r in ratios) and sum(ratios) <= 1 - a.chat_ratio - a.copy_ratio):
        shown = " + ".join(f"{r:g}" for r in ratios)
        raise TrainError(f"--distill-ratio {shown}: each > 0, in all at most 1 - --chat-ratio - --copy-ratio")
    if any(n < 16 for n in seqs):
        raise TrainError(f"--distill-seq-tokens {min(seqs)}: at least 16")
    for f in files:
        if not Path(f).is_file():
            raise TrainError(f"--distill {f}: no such file")


def load_streams(a, c, log=print) -> streams.Streams:
    s = streams.load_streams(tokenizer_dir(a), c, a.cache_dir, a.docstrings)
    i = s.info
    log(
        f"data: {i['train_tokens']} train tokens ({i['train_files']} files), "
        f"{i['heldout_tokens']} held-out tokens ({i['heldout_files']} files)"
    )
    return s


def train_model(a, c, s: streams.Streams, command: str, log=print) -> dict:
    """Train a new model (or --resume / --init-from) on the streams; a finished run is exported
    to --out with its train_log.json. Returns the log (log["finished"] false: stopped early)."""
    model = T.new_model(c, a.seed)
    log(f"model: {sum(p.numel() for p in model.parameters())} parameters; {c.to_dict()}")
    stream = torch.from_numpy(s.stream_ids.astype(np.int64))
    chat = None
    if a.chat_ratio:
        chat = streams.chat_stream(
            s.tok,
            a.chat_seed,
            a.chat_transcripts,
            a.cache_dir,
            a.chat_ratio,
            a.chat_seq_tokens,
            a.chat_loss,
            s.info,
            log,
        )
    distill = [distill_stream(f) for f in a.distill or []]
    if distill:
        s.info["distill"] = [
            {"file": str(f), "rows": int(d[1].numel()), "tokens": int(d[0].numel()), "scored": int(d[2].sum())}
            for f, d in zip(a.distill, distill)
        ]
        log(f"distill: {s.info['distill']}")
    export = exporter(a.out, tokenizer_dir(a), s.info)
    try:
        tlog = T.train(
            model,
            stream,
            train_config(a),
            heldout=s.held_ids,
            log_fn=log,
            resume=a.resume,
            should_stop=stopper(a.run_minutes),
            command=command,
            chat=chat,
            init_from=a.init_from,
            export=export,
            distill=distill,
        )
    except ValueError as e:  # a checkpoint of another shape
        raise TrainError(str(e)) from None
    if tlog["finished"]:
        out = Path(export(model, tlog))
        tlog["data"], tlog["command"] = s.info, command
        write_train_log(out, tlog)
        log(
            f"saved {out / 'model.safetensors'} after {tlog['step']} steps, {tlog['tokens']} tokens, "
            f"{tlog['elapsed_s'] / 60:.1f} min"
        )
    return tlog


def evaluate_and_card(a, s: streams.Streams, tlog: dict, log=print) -> None:
    """The final evaluation (unless --no-final-eval) into train_log.json, then loss.png and README.md."""
    out = Path(a.out)
    if not a.no_final_eval:
        tlog["final"] = final_eval(
            out, s.tok, s.train_ids, s.held_ids, s.info, a.threads, max_tokens=a.final_eval_tokens, log=log
        )
        tlog["unigram"] = tlog["final"]["unigram"]
        write_train_log(out, tlog)
    plot_loss(tlog, out / "loss.png")
    write_model_card(out, tlog)
    log(f"wrote {out / 'train_log.json'}, {out / 'loss.png'} and {out / 'README.md'}")


def card_only(out: str | Path, log=print) -> None:
    """--card-only: README.md and loss.png again from the folder's train_log.json."""
    out = Path(out)
    tlog = read_train_log(out)
    plot_loss(tlog, out / "loss.png")
    log(f"wrote {write_model_card(out, tlog)}")


def train_and_evaluate(a, command: str, log=print) -> None:
    """The script's default: train (or, with --eval-only, take the saved model), evaluate, write the card."""
    check_inputs(a)
    c = model_config(a)
    s = load_streams(a, c, log)
    if a.eval_only:
        tlog = read_train_log(a.out)
    else:
        tlog = train_model(a, c, s, command, log)
        if not tlog["finished"]:
            return
    evaluate_and_card(a, s, tlog, log)
