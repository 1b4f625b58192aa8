#!/usr/bin/env python
"""Train clover-tiny (block diffusion, spec section 6) on the stdlib train split, save it as
BF16 safetensors (HF names, per-expert layout) + config.json in models/clover-tiny, and
evaluate it on the held-out modules. The logic lives in clover_gguf/train/ (trainer.py,
model_checks.py, card.py).

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
import json
import os
import sys
import time
from pathlib import Path

# OpenMP threads that spin at barriers waste the CPU when the machine is shared; must be set
# before torch starts its thread pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from clover_gguf.config import preset  # noqa: E402
from clover_gguf.train import data  # noqa: E402
from clover_gguf.train import trainer as T  # noqa: E402
from clover_gguf.train.card import write_model_card  # noqa: E402


def log_print(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--tokens-per-batch", type=int, default=4096)
    ap.add_argument("--seq-tokens", type=int, default=256)
    ap.add_argument("--block-sizes", default="16,32,8")
    ap.add_argument("--block-probs", default="0.45,0.45,0.1")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "autocast", "fp32"])
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
    return ap.parse_args(argv)


def model_config(a, vocab_size=None):
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
        precision=a.precision,
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
    )


def bench(a) -> None:
    """Steady-state tokens/s of train steps on random tokens: median and range over
    --bench-steps steps per shape, after one warm-up step."""
    torch.set_num_threads(a.threads)
    c = model_config(a)
    tc = train_config(a)
    m = T.new_model(c, a.seed).to(tc.device)
    ms = T.MasterWeights(m) if tc.precision == "bf16" else None
    opt = T.make_optimizer(m, tc, ms)
    if tc.compile:
        T.compile_model(m)
    stream = torch.randint(2, c.vocab_size, (500_000,))
    g = torch.Generator().manual_seed(0)
    for spec in a.bench.split(","):
        n, B, nb = map(int, spec.split("x"))
        rates, cpu_rates = [], []
        for i in range(a.bench_steps + 1):
            b = T.sample_batch(stream, n, B, nb, g, c.mask_token_id, c.pad_token_id).to(tc.device)
            w0, c0 = time.time(), time.process_time()
            st = T.train_step(m, opt, b, tc, 1e-4, ms)
            if i:  # the first step of a shape compiles / warms up
                rates.append(st["n_tokens"] / (time.time() - w0))
                cpu_rates.append(st["n_tokens"] / (time.process_time() - c0))
        log_print(
            f"bench {spec} vocab={c.vocab_size} threads={a.threads} precision={tc.precision} "
            f"compile={tc.compile}: median {np.median(rates):.0f} tok/s wall (range {min(rates):.0f}-"
            f"{max(rates):.0f}, {len(rates)} steps), {np.median(cpu_rates):.0f} tok per CPU-s; "
            f"load average {os.getloadavg()[0]:.2f}"
        )


def stopper(a):
    """should_stop for T.train: true after --run-minutes, or once SIGINT/SIGTERM came."""
    import signal

    t_end = time.time() + a.run_minutes * 60 if a.run_minutes else None
    signalled = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: signalled.append(True))
    return lambda step: bool(signalled) or (t_end is not None and time.time() > t_end)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def tokenizer_dir(a) -> Path:
    """Where the tokenizer comes from: --init-from's folder for a new run from it, else --out."""
    return Path(a.init_from) if a.init_from and not a.resume else Path(a.out)


def load_data(a, c):
    from clover_gguf.tokenizer import CloverTokenizer

    tok = CloverTokenizer.from_dir(tokenizer_dir(a))
    if tok.vocab_size != c.vocab_size:
        raise SystemExit(f"tokenizer has {tok.vocab_size} tokens, config vocab_size is {c.vocab_size}")
    ids = {
        "mask_token_id": tok.mask_id,
        "bos_token_id": tok.bos_id,
        "eos_token_id": tok.eos_id,
        "pad_token_id": tok.pad_id,
    }
    for k, v in ids.items():
        if v is not None and getattr(c, k) != v:
            raise SystemExit(f"tokenizer {k} = {v}, config says {getattr(c, k)}")
    train_ids = data.train_tokens(tok, a.cache_dir)
    stream_ids = train_ids if a.docstrings == "full" else data.train_tokens(tok, a.cache_dir, a.docstrings)
    held_ids = data.heldout_tokens(tok, a.cache_dir)
    m = data.load_heldout_manifest()
    info = {
        "train_files": len(data.train_files()),
        "heldout_files": len(m["files"]),
        "heldout_modules": m["modules"],
        "train_tokens": int(train_ids.size),
        "heldout_tokens": int(held_ids.size),
        "python_version": data.python_version(),
        "docstrings": a.docstrings,
        "stream_tokens": int(stream_ids.size),
    }
    return tok, train_ids, stream_ids, held_ids, info


def load_chat(a, tok, info: dict):
    """The training transcripts' stream (ids, starts) as tensors, or None without --chat-ratio."""
    if not a.chat_ratio:
        return None
    from clover_gguf.train import transcripts

    t0 = time.time()
    ids, starts, assistant = transcripts.transcript_tokens(tok, "train", a.chat_seed, a.chat_transcripts, a.cache_dir)
    lengths = np.diff(np.append(starts, ids.size))
    info["chat"] = {
        "generator": transcripts.GENERATOR_VERSION,
        "seed": a.chat_seed,
        "transcripts": int(starts.size),
        "tokens": int(ids.size),
        "tokens_per_transcript": {
            "mean": round(float(lengths.mean()), 1),
            **{f"p{q}": int(np.percentile(lengths, q)) for q in (10, 50, 90, 95)},
            "max": int(lengths.max()),
        },
        "ratio": a.chat_ratio,
        "seq_tokens": a.chat_seq_tokens,
        "loss": a.chat_loss,
        "assistant_tokens": int(assistant.sum()),
    }
    log_print(f"chat: {info['chat']} ({time.time() - t0:.0f} s)")
    out = (torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(starts.astype(np.int64)))
    return out + ((torch.from_numpy(assistant),) if a.chat_loss == "assistant" else ())


def exporter(a, info: dict):
    """export(model, log) for T.train: the model folder --out as it stands (weights, config,
    tokenizer, train_log.json, loss.png), each file replaced whole."""
    import shutil

    out, src = Path(a.out), tokenizer_dir(a)

    def export(model, log) -> Path:
        T.save_hf(model, out)
        for name in TOKENIZER_FILES:
            if (src / name).resolve() != (out / name).resolve():
                shutil.copyfile(src / name, out / f"{name}.tmp")
                os.replace(out / f"{name}.tmp", out / name)
        full = {**log, "data": info}
        tmp = out / "train_log.json.tmp"
        tmp.write_text(json.dumps(compact_log(full), separators=(",", ":")) + "\n")
        os.replace(tmp, out / "train_log.json")
        plot_loss(full, out / "loss.png")
        return out

    return export


def plot_loss(log: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = log["steps"]
    tok = np.array([r["tokens"] for r in steps]) / 1e6
    loss = np.array([r["loss"] for r in steps]) / np.log(2)
    mce = np.array([r["masked_ce"] for r in steps]) / np.log(2)
    k = max(1, len(steps) // 100)

    def smooth(x):
        return np.convolve(x, np.ones(k) / k, mode="valid") if len(x) >= k else x

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    ax.plot(tok, loss, color="C0", alpha=0.2, lw=0.6)
    ax.plot(tok[k - 1 :], smooth(loss), color="C0", label="train NELBO (1/t-weighted), bits/token")
    ax.plot(tok[k - 1 :], smooth(mce), color="C1", label="train masked CE (unweighted), bits/token")
    if log.get("evals"):
        ax.plot(
            [e["tokens"] / 1e6 for e in log["evals"]],
            [e["bits_per_token"] for e in log["evals"]],
            "o-",
            color="C2",
            label="held-out masked CE, ratio 0.5, B=16 (first tokens)",
        )
    if log.get("unigram"):
        ax.axhline(log["unigram"]["cross_entropy"], color="gray", ls="--", lw=1, label="held-out unigram cross-entropy")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("bits / token")
    ax.set_ylim(0, max(14, float(np.nanmax(smooth(loss)[:5])) if len(loss) else 14))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("clover-tiny block-diffusion training")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def compact_log(log: dict, max_points: int = 600) -> dict:
    out = dict(log)
    steps = log["steps"]
    k = max(1, -(-len(steps) // max_points))
    keep = [i for i, r in enumerate(steps) if i % k == 0 or i == len(steps) - 1 or "tok_per_s" in r]
    out["steps"] = [steps[i] for i in keep]
    out["steps_subsampled_every"] = k
    return out


def final_eval(a, tok, train_ids, held_ids, info) -> dict:
    """The issue-13 quality targets on the saved BF16 weights (computed in float32)."""
    from clover_gguf.reference.model import CloverModel
    from clover_gguf.train import model_checks

    torch.set_num_threads(a.threads)
    model = CloverModel.from_pretrained(a.out, dtype=torch.float32)
    t0 = time.time()
    res = {"heldout": model_checks.heldout_quality(model, train_ids, held_ids, max_tokens=a.final_eval_tokens)}
    res["thirdparty"] = model_checks.thirdparty_quality(model, tok, max_tokens=a.final_eval_tokens)
    res["functions"] = model_checks.function_completions(model, tok, model_checks.load_function_prompts())
    res["function_speed"] = model_checks.threshold_speed(model, tok, model_checks.load_function_prompts())
    if tok.token_to_id("<tool_call>") is not None:  # the held-out tool transcripts (eval/quality/tools.py)
        res["tools"] = model_checks.tool_call_quality(a.out, log=log_print)
    res["targets"] = model_checks.targets(res)
    res["unigram"] = data.unigram_entropy_bits(train_ids, held_ids, vocab_size=model.config.vocab_size)
    res["data"] = info
    res["time_s"] = round(time.time() - t0, 1)
    for k in ("heldout", "thirdparty"):
        e = res[k]
        log_print(
            f"{k}: {e['bits_per_token']:.3f} bits/token (masked, ratio 0.5, B=16, {e['n_masked']} of "
            f"{e['n_tokens']} tokens), unigram {e['unigram_bits_per_token']:.3f} on the same tokens: "
            f"ratio {e['ratio']:.3f}"
        )
    f = res["functions"]
    log_print(f"functions: {f['n_parse']}/{f['n_prompts']} bodies parse")
    log_print(f"threshold 0.9 on the function prompts: {res['function_speed']['tokens_per_step']:.3f} tokens/step")
    if "tools" in res:
        log_print(f"tools: { ({k: res['tools'][k] for k in ('valid_calls', 'name_accuracy', 'call_rate')}) }")
    for r in f["rows"]:
        log_print(f"{'ok ' if r['parses'] else 'BAD'} {r['prompt']!r} -> {r['completion']!r}")
    return res


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.bench:
        bench(a)
        return 0
    out = Path(a.out)
    if a.card_only:
        log = json.loads((out / "train_log.json").read_text())
        plot_loss(log, out / "loss.png")
        log_print(f"wrote {write_model_card(out, log)}")
        return 0
    c = model_config(a)
    tok, train_ids, stream_ids, held_ids, info = load_data(a, c)
    log_print(
        f"data: {info['train_tokens']} train tokens ({info['train_files']} files), "
        f"{info['heldout_tokens']} held-out tokens ({info['heldout_files']} files)"
    )
    out = Path(a.out)
    log_path = out / "train_log.json"
    if a.eval_only:
        log = json.loads(log_path.read_text())
    else:
        tc = train_config(a)
        model = T.new_model(c, a.seed)
        log_print(f"model: {sum(p.numel() for p in model.parameters())} parameters; {c.to_dict()}")
        stream = torch.from_numpy(stream_ids.astype(np.int64))
        if a.resume and not (Path(a.resume).is_file() or (Path(a.resume) / "train_log.json").is_file()):
            raise SystemExit(f"--resume {a.resume}: neither a checkpoint nor a model folder with train_log.json")
        if a.init_from and not (Path(a.init_from) / "model.safetensors").is_file():
            raise SystemExit(f"--init-from {a.init_from}: no model.safetensors there")
        command = "python scripts/train_clover_tiny.py " + " ".join(sys.argv[1:] if argv is None else argv)
        chat = load_chat(a, tok, info)
        export = exporter(a, info)
        try:
            log = T.train(
                model,
                stream,
                tc,
                heldout=held_ids,
                log_fn=log_print,
                resume=a.resume,
                should_stop=stopper(a),
                command=command,
                chat=chat,
                init_from=a.init_from,
                export=export,
            )
        except ValueError as e:  # a checkpoint of another shape
            raise SystemExit(str(e)) from None
        if not log["finished"]:
            return 0
        export(model, log)
        log["data"] = info
        log["command"] = command
        log_path.write_text(json.dumps(compact_log(log), separators=(",", ":")) + "\n")
        log_print(
            f"saved {out / 'model.safetensors'} after {log['step']} steps, {log['tokens']} tokens, "
            f"{log['elapsed_s'] / 60:.1f} min"
        )
    if not a.no_final_eval:
        log["final"] = final_eval(a, tok, train_ids, held_ids, info)
        log["unigram"] = log["final"]["unigram"]
        log_path.write_text(json.dumps(compact_log(log), separators=(",", ":")) + "\n")
    plot_loss(log, out / "loss.png")
    write_model_card(out, log)
    log_print(f"wrote {log_path}, {out / 'loss.png'} and {out / 'README.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
