"""The converter streams: its peak memory follows the chunk size, not the model or the largest
tensor. Measured in a fresh process as the rise of its peak RSS (Linux: VmHWM, restarted with
/proc/self/clear_refs, over VmRSS) during the conversion of a synthetic checkpoint 5x larger
than its largest tensor, after a warm-up conversion has loaded every library."""

import json
import math
import os
import subprocess
import sys

from convert_helpers import REPO, small_config

from clover_gguf.synthetic import write_synthetic

CHILD = r"""
import gc, json, sys
from clover_gguf.convert.converter import convert

def status_mib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024

small, big, out = sys.argv[1:4]
kw = dict(outtype="q8_0", experts="q4_k", threads=2, force=True, progress=False)
convert(small, out, **kw)
gc.collect()
with open("/proc/self/clear_refs", "w") as f:  # restart the high-water mark (VmHWM) from here
    f.write("5")
base = status_mib("VmRSS")
convert(big, out, **kw)
print(json.dumps({"base_mib": base, "peak_mib": status_mib("VmHWM")}))
"""


def test_peak_rss_bounded_by_chunks_not_tensors(tmp_path):
    # largest tensors: embeddings and lm_head, 32768 x 1024 (64 MiB BF16, 128 MiB float32);
    # the whole checkpoint ~360 MiB BF16 (per-expert layout: each expert 1 MiB)
    big_cfg = small_config(
        vocab_size=32768,
        hidden_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_experts=16,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
    )
    big = write_synthetic(tmp_path / "big", big_cfg, progress=False)
    small = write_synthetic(tmp_path / "small", small_config(), progress=False)
    sizes = {n: math.prod(s) for n, s in big_cfg.expected_tensors(fused=False).items()}
    largest_f32_mib = max(sizes.values()) * 4 / 2**20
    total_bf16_mib = sum(sizes.values()) * 2 / 2**20
    assert largest_f32_mib == 128 and total_bf16_mib > 5 * largest_f32_mib / 2

    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(small), str(big), str(tmp_path / "o.gguf")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    rise = m["peak_mib"] - m["base_mib"]
    # a few 8 MB chunks in flight (reader, quantizer, writer queues: ~55 MiB measured); one
    # whole tensor as float32 would already cost 128 MiB, the model 360+ MiB
    assert rise < largest_f32_mib, f"peak RSS rose by {rise:.0f} MiB over {m['base_mib']:.0f} MiB"
    assert (tmp_path / "o.gguf").stat().st_size > 100 * 2**20
