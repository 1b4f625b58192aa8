"""The model's own greedy continuations (one token a step, B=16, 64 tokens) of the train
split's def lines, or with --tools its replies (160 tokens) to the turns that call a tool in N
train-split chat transcripts, as a JSONL for `train_clover_tiny.py --distill`
(clover_gguf/train/distill.py). Appends to OUT, so a cut-off run goes on where it stopped.

    python scripts/distill_targets.py models/clover-tiny-v3-wip out/distill.jsonl --n 1500
    python scripts/distill_targets.py models/clover-tiny-v3-wip out/tools.jsonl --tools --n 300
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="model folder (safetensors, config.json, tokenizer)")
    ap.add_argument("out", help="JSONL to append to")
    ap.add_argument("--n", type=int, default=1500, help="signatures to continue (transcripts with --tools)")
    ap.add_argument("--seed", type=int, default=None, help="order of the signatures (0); transcript seed (3)")
    ap.add_argument("--tools", action="store_true", help="replies to train-split chat turns")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    import torch

    from clover_gguf.train.distill import write_targets, write_tool_targets

    if not (Path(a.model) / "model.safetensors").is_file():
        raise SystemExit(f"{a.model}: no model.safetensors")
    torch.set_num_threads(a.threads)
    write = write_tool_targets if a.tools else write_targets
    write(a.model, Path(a.out), a.n, **({} if a.seed is None else {"seed": a.seed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
