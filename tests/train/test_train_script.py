"""scripts/train_clover_tiny.py end to end on a tiny budget (a 1-layer model, a few steps of
a few hundred tokens; the stdlib token streams cached in .cache/tokens as the script does):
what it writes into --out, its log lines, stop and --resume, --init-from, exports, --card-only,
--bench, and bad options as one line. The final evaluation is tests/train/test_final_eval.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from testdata import REPO, TINY

from clover_gguf.train import trainer as T

SCRIPT = REPO / "scripts" / "train_clover_tiny.py"
SMALL = (
    "--layers 1 --experts 2 --top-k 1 --tokens-per-batch 128 --seq-tokens 32 --block-sizes 8 --block-probs 1 "
    "--eval-tokens 256 --no-final-eval"
).split()
MODEL_FILES = {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "train_log.json"}
CARD_FILES = {"loss.png", "README.md"}


def script(*args, ok: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    if ok:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def lines(r: subprocess.CompletedProcess) -> list[str]:
    """stdout without the [HH:MM:SS] stamps."""
    return [ln.split("] ", 1)[1] for ln in r.stdout.splitlines() if ln.startswith("[")]


def model_folder(path):
    path.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, path / name)
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One run of 6 steps that exports, checkpoints and evaluates after every step."""
    root = tmp_path_factory.mktemp("script")
    out = model_folder(root / "out")
    r = script("--out", out, "--ckpt-dir", root / "ck", *SMALL, "--max-steps", 6,
               "--export-every-min", 1e-9, "--ckpt-every-min", 1e-9, "--eval-every-min", 1e-9)  # fmt: skip
    return out, root / "ck", lines(r)


def test_a_run_writes_the_model_folder_and_says_so(trained):
    out, ck, log = trained
    assert {p.name for p in out.iterdir()} == MODEL_FILES | CARD_FILES
    assert (ck / "ckpt-last.pt").is_file() and (ck / "hf" / "model.safetensors").is_file()
    assert log[0].startswith("data: ") and " train tokens (" in log[0] and " held-out tokens (" in log[0]
    assert log[1].startswith("model: ") and "'num_hidden_layers': 1" in log[1]
    for step in range(1, 7):
        assert f"eval step {step}: held-out " in "\n".join(log)
        assert f"checkpoint step {step} -> {ck}" in log
        assert f"exported step {step} -> {out}" in log
    assert log[-2].startswith(f"saved {out / 'model.safetensors'} after 6 steps, ")
    assert log[-1] == f"wrote {out / 'train_log.json'}, {out / 'loss.png'} and {out / 'README.md'}"
    tlog = json.loads((out / "train_log.json").read_text())
    assert tlog["finished"] and tlog["step"] == 6 and len(tlog["evals"]) == 6
    assert tlog["command"].startswith("python scripts/train_clover_tiny.py --out ")
    assert tlog["data"]["train_tokens"] > 1_000_000 and tlog["data"]["docstrings"] == "full"
    assert tlog["model_config"]["num_hidden_layers"] == 1
    assert (out / "README.md").read_text().startswith("# clover-tiny\n")


def test_card_only_rewrites_the_card_and_the_plot(trained):
    out, _, _ = trained
    (out / "README.md").unlink()
    (out / "loss.png").unlink()
    assert lines(script("--out", out, "--card-only")) == [f"wrote {out / 'README.md'}"]
    assert (out / "loss.png").read_bytes().startswith(b"\x89PNG")
    assert "Trained 6 steps" in (out / "README.md").read_text()


def test_stopped_then_resumed_equals_one_run(tmp_path):
    """--run-minutes stops with a checkpoint (and no model); --resume ends the same run."""
    one = model_folder(tmp_path / "one")
    script("--out", one, "--ckpt-dir", tmp_path / "ck1", *SMALL, "--max-steps", 4)
    parts = model_folder(tmp_path / "parts")
    ck = tmp_path / "ck2"
    log = lines(script("--out", parts, "--ckpt-dir", ck, *SMALL, "--max-steps", 4, "--run-minutes", 1e-6))
    assert log[-1] == f"stopping at step 0, 0 tokens; --resume {ck / 'ckpt-last.pt'} continues"
    assert not (parts / "model.safetensors").exists() and (ck / "ckpt-last.pt").is_file()
    log = lines(script("--out", parts, "--ckpt-dir", ck, *SMALL, "--max-steps", 4, "--resume", ck / "ckpt-last.pt"))
    assert f"resumed from {ck / 'ckpt-last.pt'} at step 0, 0 tokens" in log
    assert (parts / "model.safetensors").read_bytes() == (one / "model.safetensors").read_bytes()
    tlog = json.loads((parts / "train_log.json").read_text())
    assert [r["step"] for r in tlog["runs"]] == [0, 0] and tlog["step"] == 4


def test_init_from_a_folder_with_chat_copies_its_tokenizer(trained, tmp_path):
    src, _, _ = trained
    out = tmp_path / "child"  # does not exist yet: the run makes it, the tokenizer comes from src
    log = lines(script("--out", out, "--ckpt-dir", tmp_path / "ck", *SMALL, "--max-steps", 3, "--init-from", src,
                       "--chat-ratio", 0.5, "--chat-transcripts", 30, "--chat-seq-tokens", 64, "--chat-loss", "assistant"))  # fmt: skip
    assert any(ln.startswith("chat: {'generator': ") for ln in log)
    assert f"new run from the weights of {src} (" in "\n".join(log)
    assert {p.name for p in out.iterdir()} == MODEL_FILES | CARD_FILES
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    tlog = json.loads((out / "train_log.json").read_text())
    assert tlog["init_from"]["path"] == str(src) and tlog["init_from"]["step"] == 6 and tlog["step"] == 3
    assert tlog["data"]["chat"]["transcripts"] == 30 and tlog["data"]["chat"]["loss"] == "assistant"
    assert all("chat" in r for r in tlog["steps"])


def test_warm_restart_from_a_model_folder(trained, tmp_path):
    src, _, _ = trained
    out = tmp_path / "warm"
    shutil.copytree(src, out)
    log = lines(script("--out", out, "--ckpt-dir", tmp_path / "ck", *SMALL, "--max-steps", 8, "--resume", out,
                       "--docstrings", "summary"))  # fmt: skip
    assert any(ln.startswith(f"warm restart from {out} at step 6, ") for ln in log)
    tlog = json.loads((out / "train_log.json").read_text())
    assert tlog["step"] == 8 and tlog["warm_start_step"] == 6 and tlog["data"]["docstrings"] == "summary"
    assert tlog["data"]["stream_tokens"] < tlog["data"]["train_tokens"]


def test_bench_prints_one_line_per_shape():
    log = lines(script("--bench", "2x8x3,1x16x2", "--bench-steps", 1, "--layers", 1, "--experts", 2, "--top-k", 1))
    assert [ln.split(":")[0] for ln in log] == [
        f"bench 2x8x3 vocab=4100 threads=1 precision={T.default_precision()} compile=False",
        f"bench 1x16x2 vocab=4100 threads=1 precision={T.default_precision()} compile=False",
    ]
    assert all(" tok/s wall (range " in ln and ", 1 steps), " in ln for ln in log)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--resume", "{tmp}/nothing"],
            "--resume {tmp}/nothing: neither a checkpoint nor a model folder with train_log.json",
        ),
        (["--init-from", "{tmp}"], "--init-from {tmp}: no model.safetensors there"),
        (
            ["--chat-ratio", "0.7", "--copy-ratio", "0.4"],
            "--copy-ratio 0.4: must be in [0, 1 - --chat-ratio (0.7)]",
        ),
        (
            ["--distill", "{tmp}/t.jsonl", "--chat-ratio", "0.9", "--distill-ratio", "0.2"],
            "--distill-ratio 0.2: each > 0, in all at most 1 - --chat-ratio - --copy-ratio",
        ),
        (
            ["--distill", "{tmp}/t.jsonl", "--distill", "{tmp}/u.jsonl", "--distill-ratio", "0.2"]
            + ["--distill-ratio", "0.1", "--distill-ratio", "0.1"],
            "--distill-ratio: give one, or one per --distill (2), not 3",
        ),
        (
            ["--distill", "{tmp}/t.jsonl", "--distill", "{tmp}/u.jsonl", "--chat-ratio", "0.5"]
            + ["--distill-ratio", "0.3", "--distill-ratio", "0.3"],
            "--distill-ratio 0.3 + 0.3: each > 0, in all at most 1 - --chat-ratio - --copy-ratio",
        ),
        (["--distill", "{tmp}/none.jsonl"], "--distill {tmp}/none.jsonl: no such file"),
        (["--eval-only"], "--eval-only: no train_log.json in --out {tmp}"),
        (["--bench", "4x8"], "--bench 4x8: expected a comma list of NxBxNB (sequences x block size x blocks)"),
        (["--card-only"], "{tmp}/train_log.json: "),
    ],
)
def test_bad_options_are_one_line(tmp_path, args, message):
    r = script("--out", tmp_path, "--ckpt-dir", tmp_path / "ck", *[a.format(tmp=tmp_path) for a in args], ok=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().startswith(message.format(tmp=tmp_path)) and len(r.stderr.strip().splitlines()) == 1
