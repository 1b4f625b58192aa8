#!/usr/bin/env python
"""Measure how much of each layer's routed experts a block touches, on a model's real router
over the held-out corpus (clover_gguf.plan.routing.measure), and write the JSON the plan's cost
model reads (evaldata/plan/routing-NAME.json). Small: one thread, a few minutes for clover-tiny.

    nice -n 10 python scripts/measure_routing.py models/clover-tiny -o evaldata/plan/routing-clover-tiny.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clover_gguf.plan import routing  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path, help="safetensors model folder (with tokenizer.json)")
    ap.add_argument("-o", "--out", type=Path, required=True)
    ap.add_argument("--windows", type=int, default=24, help="windows per block size")
    ap.add_argument("--blocks", type=int, default=8, help="blocks per window")
    ap.add_argument("--block-sizes", default=",".join(map(str, routing.BLOCK_SIZES)))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-t", "--threads", type=int, default=1)
    a = ap.parse_args()
    sizes = tuple(int(x) for x in a.block_sizes.split(","))
    data = routing.measure(a.model, sizes, n_windows=a.windows, n_blocks=a.blocks, seed=a.seed, threads=a.threads)
    routing.write(data, a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
