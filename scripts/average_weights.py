"""The uniform mean of several model folders' weights, runs fine-tuned from one starting point
(clover_gguf/train/average.py), written to a new model folder:

    python scripts/average_weights.py out/soup RUN_A/out RUN_B/out RUN_C/out
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="new model folder")
    ap.add_argument("models", nargs="+", help="model folders (model.safetensors, config.json, tokenizer)")
    a = ap.parse_args(argv)
    from clover_gguf.errors import error_line
    from clover_gguf.train.average import average_weights

    try:
        info = average_weights(a.out, a.models)
    except Exception as e:  # what the user can act on is one line; a bug keeps its traceback
        line = error_line(e)
        if line is None:
            raise
        raise SystemExit(line) from None
    print(f"{a.out}: the mean of {len(info['sources'])} model folders")
    return 0


if __name__ == "__main__":
    sys.exit(main())
