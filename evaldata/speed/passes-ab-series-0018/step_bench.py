"""One denoising step with N masked rows of a 32-token block, timed REPS times after 3 warm-up steps;
prints the median, p10 and p90 in ms. Run with each build's Python and libraries (PYTHONPATH,
LLAMA_CPP_LIB_PATH) to compare them; the model is one of `eval passes`' synthetic GGUFs.
    python step_bench.py MODEL.gguf THREADS N REPS"""

import random
import statistics
import sys
import time

from clover_gguf.reference.sampling import step_key
from clover_gguf.runtime.runtime import CloverRuntime

model, threads, n, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rt = CloverRuntime(model, n_threads=threads, n_gpu_layers=0, n_ubatch=512, n_ctx=4096)
rng = random.Random(0)
V, mask, B = rt.n_vocab, rt.mask_token_id, 32
prompt, block = ([rng.randrange(256, V - 8) for _ in range(k)] for k in (64, B))
rt.reset()
rt.commit(prompt, B)
ts = []
for r in range(reps + 3):
    blk = list(block)
    for i in rng.sample(range(B), n):
        blk[i] = mask
    t = time.perf_counter()
    rt.block_candidates(blk, 0.0, step_key(r, 0, n))
    if r >= 3:
        ts.append((time.perf_counter() - t) * 1e3)
ts.sort()
print(f"{statistics.median(ts):.2f} {ts[int(0.1 * (len(ts) - 1))]:.2f} {ts[int(0.9 * (len(ts) - 1))]:.2f}")
rt.close()
