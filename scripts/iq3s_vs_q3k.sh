#!/usr/bin/env bash
# IQ3_S against Q3_K experts (rest BF16) on one model, each with an imatrix from the v3 corpus
# (stdlib-style code interleaved with training chat transcripts), scored by `eval quality` on
# the held-out stdlib code and on the held-out chat transcripts (docs/plan.md "Quality").
#
#   bash scripts/iq3s_vs_q3k.sh [MODEL_DIR] [OUT_DIR]     # about 10 minutes on one core
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
M=${1:-models/clover-tiny}
O=${2:-out/iq3s-vs-q3k}
mkdir -p "$O"
python - "$M" "$O" <<'PY'
import json
import sys
from pathlib import Path

from clover_gguf.tokenizer import CloverTokenizer
from clover_gguf.train.transcripts import load_heldout_set, make_transcript, render_training_text

model, out = sys.argv[1], Path(sys.argv[2])
tok = CloverTokenizer.from_dir(model)
files = sorted(Path("clover_gguf/convert").glob("*.py")) + sorted(Path("clover_gguf/eval").glob("*.py"))
code = "".join(p.read_text() for p in files)
chats = [render_training_text(tok, make_transcript("train", 1, i)) for i in range(300)]
# interleaved, so that the chunks the imatrix reads hold both kinds of text
parts = [code[i : i + 2000] for i in range(0, len(code), 2000)]
(out / "calib.txt").write_text("".join(c + p for c, p in zip(chats, parts + [""] * len(chats))))
with open(out / "heldout-chat.jsonl", "w") as f:
    for t in load_heldout_set()[0]:
        f.write(json.dumps({"text": render_training_text(tok, t)}) + "\n")
PY
clover-gguf imatrix "$M" -f "$O/calib.txt" -o "$O/imatrix.gguf" --ctx 256 --chunks 64
for t in q3_k iq3_s; do
  clover-gguf convert "$M" -o "$O/$t.gguf" --experts $t --imatrix "$O/imatrix.gguf" --force -t 1 -q
done
q="clover-gguf eval quality --reference $M $O/q3_k.gguf $O/iq3_s.gguf --windows 6 --threads 1 --runtime-threads 1"
$q --n-prompts 8 --max-new-tokens 32 --out "$O/code"
$q --corpus "$O/heldout-chat.jsonl" --no-generation --out "$O/chat"
