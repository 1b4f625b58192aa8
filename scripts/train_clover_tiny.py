#!/usr/bin/env python
"""Train clover-tiny (block diffusion, spec section 6) on the stdlib train split, save it as
BF16 safetensors (HF names, per-expert layout) + config.json in models/clover-tiny, and
evaluate it on the held-out modules. This script only parses the options; the run is
clover_gguf/train/run.py (which calls trainer.py, streams.py, export.py, final_eval.py,
loss_plot.py, card.py and, for --bench, step_speed.py).

    python scripts/train_clover_tiny.py --time-budget-min 45          # train + eval + model card
    python scripts/train_clover_tiny.py --bench 16x16x17,8x32x9       # tokens/s, random tokens
    python scripts/train_clover_tiny.py --resume out/clover-tiny-train/ckpt-last.pt --time-budget-min 90
    python scripts/train_clover_tiny.py --eval-only                   # eval + card for the saved model
    python scripts/train_clover_tiny.py --max-tokens 60000000 --run-minutes 120   # a long run in parts:
    python scripts/train_clover_tiny.py --max-tokens 60000000 --run-minutes 120 \
        --resume out/clover-tiny-train/ckpt-last.pt                   # ... until the token budget is reached
    python scripts/train_clover_tiny.py --resume models/clover-tiny --time-budget-min 240  # checkpoint lost:
                                                  # warm restart from the saved model (new optimizer state)
    python scripts/train_clover_tiny.py --resume models/clover-tiny --docstrings summary --time-budget-min 365
                                                  # ... trained on with docstrings cut to their first paragraph
    python scripts/train_clover_tiny.py --init-from models/clover-tiny --out models/clover-tiny-v3-wip \
        --chat-ratio 0.35 --chat-seq-tokens 1280 --export-every-min 60 --time-budget-min 330
                                                  # a new run from a model's weights, with chat transcripts
                                                  # (train/transcripts.py) mixed in, exported every hour
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# OpenMP threads that spin at barriers waste the CPU when the machine is shared; must be set
# before torch starts its thread pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from clover_gguf.errors import error_line  # noqa: E402
from clover_gguf.train import data, run  # noqa: E402


def log_print(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for add in (folder_and_budget_options, step_options, start_and_data_options, model_and_mode_options):
        add(ap)
    return ap.parse_args(argv)


def folder_and_budget_options(ap) -> None:
    """Where the run reads and writes, and how long it runs."""
    ap.add_argument(
        "--out", default=str(REPO / "models" / "clover-tiny"), help="model folder (tokenizer read from here)"
    )
    ap.add_argument("--ckpt-dir", default=str(REPO / "out" / "clover-tiny-train"))
    ap.add_argument("--cache-dir", default=str(REPO / ".cache" / "tokens"))
    ap.add_argument("--time-budget-min", type=float, default=None)
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--max-tokens", type=int, default=None, help="token budget of the whole (resumable) run")
    ap.add_argument(
        "--run-minutes",
        type=float,
        default=None,
        help="stop this run after so many minutes with a checkpoint; --resume continues (SIGINT/SIGTERM do the same)",
    )


def step_options(ap) -> None:
    """The optimizer, the batches and the arithmetic of a training step."""
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument(
        "--certainty",
        type=float,
        default=0.0,
        help="add this weight times the entropy of masked positions whose argmax is already right "
        "(certainty forcing: confidence for the threshold schedule); 0: the plain NELBO",
    )
    ap.add_argument(
        "--copy-ratio",
        type=float,
        default=0.0,
        help="share of the batches that are copy windows of the code stream: a span, then pieces of it "
        "(in-context copying, as tool arguments copy the request's names); chat + copy <= 1",
    )
    ap.add_argument(
        "--distill",
        action="append",
        help="a JSONL of the model's own continuations (scripts/distill_targets.py): a --distill-ratio "
        "share of the batches train on them, their prompts as clean context; repeat for several streams",
    )
    ap.add_argument(
        "--distill-ratio", type=float, action="append", help="share of the batches, one for each --distill (0.2)"
    )
    ap.add_argument(
        "--distill-seq-tokens",
        type=int,
        action="append",
        help="tokens per window, one for each --distill (64: a def line and its body; a chat turn needs its prompt)",
    )
    ap.add_argument(
        "--distill-certainty",
        type=float,
        default=1.0,
        help="the certainty weight (see --certainty) in distill batches: self-distilled certainty forcing",
    )
    ap.add_argument("--tokens-per-batch", type=int, default=4096)
    ap.add_argument("--seq-tokens", type=int, default=256)
    ap.add_argument("--block-sizes", default="16,32,8")
    ap.add_argument("--block-probs", default="0.45,0.45,0.1")
    ap.add_argument(
        "--precision",
        default=None,
        choices=["bf16", "autocast", "fp32"],
        help="default: bf16 on a GPU or a CPU with native BF16 (AVX512_BF16, AMX), else fp32 (emulated BF16 "
        "matmuls make a step about twice as slow)",
    )
    ap.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="torch.compile the training forward (fuses the elementwise work)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads; 1 is fastest on the shared 2-core box (2 threads: OpenMP barrier stalls)",
    )


def start_and_data_options(ap) -> None:
    """What the run starts from and trains on (code, chat transcripts), and its exports."""
    ap.add_argument(
        "--docstrings",
        default="full",
        choices=data.DOCSTRINGS,
        help="train on the files as they are, or with docstrings cut to their first paragraph "
        "(data.summary_docstrings); evaluation always uses the files as they are",
    )
    ap.add_argument(
        "--init-from",
        default=None,
        help="a model folder whose weights (and tokenizer) start a new run: step 0, this run's own schedule",
    )
    ap.add_argument(
        "--chat-ratio",
        type=float,
        default=0.0,
        help="share of the batches drawn from chat transcripts (train/transcripts.py, train split)",
    )
    ap.add_argument("--chat-seq-tokens", type=int, default=1280, help="tokens per chat window, about")
    ap.add_argument("--chat-transcripts", type=int, default=20000, help="number of training transcripts")
    ap.add_argument("--chat-seed", type=int, default=0, help="seed of the training transcripts")
    ap.add_argument(
        "--chat-loss",
        default="all",
        choices=("all", "assistant"),
        help="in chat windows, noise and score every token, or only what the assistant writes (the rest "
        "stays clean context, as a prompt at inference)",
    )
    ap.add_argument(
        "--export-every-min",
        type=float,
        default=0.0,
        help="write the model (weights, config, tokenizer, train_log.json) to --out this often (0: at the end only)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine (untested there)")


def model_and_mode_options(ap) -> None:
    """The model's shape, the periodic checkpoints and evals, and the modes besides training."""
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=None, help="config.json block_size (default decoding block)")
    ap.add_argument("--ckpt-every-min", type=float, default=4.0)
    ap.add_argument("--eval-every-min", type=float, default=10.0)
    ap.add_argument("--eval-tokens", type=int, default=8192, help="held-out tokens for the periodic eval")
    ap.add_argument(
        "--resume",
        default=None,
        help="a checkpoint (continues exactly), or a model folder with train_log.json (warm restart: new optimizer)",
    )
    ap.add_argument("--bench", default=None, help="comma list NxBxNB: time train steps on random tokens and exit")
    ap.add_argument("--bench-steps", type=int, default=8, help="timed steps per --bench shape")
    ap.add_argument("--eval-only", action="store_true", help="skip training: evaluate the model in --out")
    ap.add_argument("--no-final-eval", action="store_true")
    ap.add_argument("--card-only", action="store_true", help="rewrite README.md and loss.png from train_log.json")
    ap.add_argument("--final-eval-tokens", type=int, default=None, help="limit the final held-out eval (smoke tests)")


def command_line(argv=None) -> str:
    """How this run was started, as train_log.json's runs record it."""
    return "python scripts/train_clover_tiny.py " + " ".join(sys.argv[1:] if argv is None else argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        if a.bench:
            run.bench(a, log_print)
        elif a.card_only:
            run.card_only(a.out, log_print)
        else:
            run.train_and_evaluate(a, command_line(argv), log_print)
    except Exception as e:  # what the user can act on is one line; a bug keeps its traceback
        line = error_line(e)
        if line is None:
            raise
        raise SystemExit(line) from None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
