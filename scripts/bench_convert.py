#!/usr/bin/env python3
"""Benchmark `clover-gguf convert` against llama.cpp's own two-step pipeline.

Prints figures; it is not a timed test. For each layer count (default 1 and 2):

1. a synthetic Clover checkpoint with Clover-35B-A3B's full tensor shapes
   (clover_gguf.synthetic.write_synthetic, preset clover-35b-a3b, BF16, sharded);
2. an equivalent Qwen3-MoE checkpoint (Qwen3MoeForCausalLM config, same embeddings,
   attention, router and expert tensors, byte for byte, and the clover-tiny tokenizer);
3. a synthetic importance matrix for every quantized tensor (llama.cpp GGUF imatrix);
4. runs, each a fresh process under /usr/bin/time (wall time, peak RSS), page cache warm:
   - clover-gguf convert --experts bf16                 (BF16 everything)
   - clover-gguf convert --outtype q8_0                 (experts Q4_K, the rest Q8_0)
   - clover-gguf convert --outtype q8_0 --imatrix       (same, imatrix-weighted)
   - llama.cpp convert_hf_to_gguf.py --outtype bf16     (step 1 of theirs)
   - llama-quantize Q8_0 --tensor-type ffn_*_exps=q4_k  (step 2: experts Q4_K, the rest Q8_0;
     llama-quantize applies --tensor-type only under a quantized ftype)
   - the same with --imatrix
   The smaller layer counts run only the Q4_K pipelines (they feed the fit).
5. checks that the Q4_K expert blocks of both pipelines are byte-identical (with and
   without the imatrix): both call ggml's quantizer on the same weights.

Throughput is input GB/s (safetensors bytes / wall time). With two layer counts the wall
time and peak RSS are fitted as a + b * layers and extrapolated to 40 layers.

Needs: libggml-base (see clover_gguf.ggml_lib), llama-quantize (--llama-quantize), the
vendored llama.cpp source (--llama-cpp, for convert_hf_to_gguf.py), and transformers for
that script (--pythonpath: a folder with transformers/tokenizers/huggingface_hub
installed by `pip install --target DIR --no-deps transformers==4.57.6 "tokenizers<=0.23.0"
"huggingface_hub<1" regex filelock fsspec`, keeping the project's venv untouched).

    python scripts/bench_convert.py --quality models/clover-tiny     # acceptance: KL / top-1
    python scripts/bench_convert.py --work /work/cache/bench \\
        --llama-cpp /work/cache/ggml-src/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        --llama-quantize /work/cache/ggml-build/bin/llama-quantize --pythonpath /work/cache/bench-pylib
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from clover_gguf.checkpoint import Checkpoint  # noqa: E402
from clover_gguf.config import preset  # noqa: E402
from clover_gguf.constants import GGUF_EXPERT_NAME  # noqa: E402
from clover_gguf.convert.imatrix import write_imatrix  # noqa: E402
from clover_gguf.convert.pipeline import ShardReader  # noqa: E402
from clover_gguf.synthetic import plan_shards, write_synthetic  # noqa: E402

QWEN_TENSORS = re.compile(
    r"^(model\.embed_tokens\.weight|lm_head\.weight|model\.norm\.weight|"
    r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight|"
    r"model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj\.weight|model\.layers\.\d+\.self_attn\.(q|k)_norm\.weight|"
    r"model\.layers\.\d+\.mlp\.gate\.weight|model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight)$"
)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def dir_bytes(d: Path, pattern="*.safetensors") -> int:
    return sum(p.stat().st_size for p in d.glob(pattern))


def warm(paths):
    """Read files once so both pipelines start with the same (warm) page cache."""
    for p in paths:
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass


def write_qwen3(clover_dir: Path, out: Path, shard_mb: int = 2000) -> Path:
    """Qwen3-MoE checkpoint with Clover's shared tensors, copied byte for byte."""
    ck = Checkpoint(clover_dir)
    c = ck.config
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in c.expected_tensors() if QWEN_TENSORS.match(n)]
    shards = plan_shards({n: ck.nbytes(n) for n in names}, shard_mb << 20)  # as synth shards
    wm = {}
    with ShardReader(ck) as reader:  # the converter's reader: where each tensor's bytes start
        files = {}
        for i, members in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            header, off = {}, 0
            for n in members:
                nb = ck.nbytes(n)
                header[n] = {"dtype": ck.dtype(n), "shape": list(ck.shape(n)), "data_offsets": [off, off + nb]}
                off += nb
                wm[n] = fname
            hj = json.dumps(header, separators=(",", ":")).encode()
            hj += b" " * (-len(hj) % 8)
            with open(out / fname, "wb") as f:
                f.write(struct.pack("<Q", len(hj)) + hj)
                for n in members:
                    shard, _, _, pos = reader.info(n)
                    src = files.setdefault(shard, open(shard, "rb"))
                    end = pos + ck.nbytes(n)
                    while pos < end:
                        k = min(64 << 20, end - pos)
                        f.write(os.pread(src.fileno(), k, pos))
                        pos += k
        for src in files.values():
            src.close()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_experts": c.num_experts,
        "num_experts_per_tok": c.num_experts_per_tok,
        "moe_intermediate_size": c.moe_intermediate_size,
        "intermediate_size": 6144,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "models" / "clover-tiny" / f, out / f)
    return out


def synth_imatrix(path: Path, c, seed=0):
    """Random but plausible statistics for every tensor either pipeline quantizes."""
    rng = np.random.default_rng(seed)
    sums, counts = {}, {}
    E, d, F = c.num_experts, c.hidden_size, c.moe_intermediate_size
    for bid in range(c.num_hidden_layers):
        for proj in ("gate", "up", "down"):
            n = GGUF_EXPERT_NAME[proj].format(bid=bid)
            cols = d if proj != "down" else F
            cnt = rng.integers(0, 400, E).astype(np.float32)
            sums[n] = (rng.gamma(2.0, 1.0, (E, cols)) * cnt[:, None]).astype(np.float32)
            counts[n] = cnt
        for t, cols in (
            ("attn_q", d),
            ("attn_k", d),
            ("attn_v", d),
            ("attn_output", c.num_attention_heads * c.head_dim),
        ):
            n = f"blk.{bid}.{t}.weight"
            sums[n] = (rng.gamma(2.0, 1.0, (1, cols)) * 1000).astype(np.float32)
            counts[n] = np.array([1000], np.float32)
    write_imatrix(path, sums, counts, ["synthetic"], 10, 512)


def timed(cmd, env=None, cwd=None) -> dict:
    log("$", " ".join(map(str, cmd)))
    t0 = time.perf_counter()
    p = subprocess.run(
        ["/usr/bin/time", "-v", *map(str, cmd)],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
    if p.returncode != 0:
        log(p.stdout[-3000:], p.stderr[-5000:])
        raise SystemExit(f"command failed ({p.returncode}): {cmd}")
    return {"wall_s": wall, "peak_rss_mib": int(m.group(1)) / 1024 if m else float("nan"), "log": p.stderr}


def tensor_bytes(path, names):
    from gguf import GGUFReader

    r = GGUFReader(path)
    return {t.name: np.asarray(t.data).tobytes() for t in r.tensors if t.name in names}


def run_layers(L: int, args, results: dict):
    work = Path(args.work)
    cdir, qdir = work / f"clover-{L}", work / f"qwen3moe-{L}"
    cfg = preset("clover-35b-a3b")
    if not (cdir / "config.json").exists():
        log(f"synthesizing {cdir}")
        write_synthetic(cdir, cfg, layers=L, shard_size_mb=2000, progress=False)
    if not (qdir / "config.json").exists():
        log(f"writing {qdir}")
        write_qwen3(cdir, qdir)
    c = Checkpoint(cdir).config
    im = work / f"imatrix-{L}.gguf"
    synth_imatrix(im, c)
    outd = work / f"out-{L}"
    outd.mkdir(exist_ok=True)
    py = sys.executable
    env = dict(os.environ)
    th = str(args.threads)
    in_c, in_q = dir_bytes(cdir), dir_bytes(qdir)
    runs = {}

    def mine(name, extra):
        out = outd / f"clover-{name}.gguf"
        warm(sorted(cdir.glob("*.safetensors")))
        r = timed(
            [py, "-m", "clover_gguf.cli", "convert", cdir, "-o", out, "--force", "-q", "-t", th, *extra],
            env=env,
            cwd=REPO,
        )
        r.update(input_bytes=in_c, output_bytes=out.stat().st_size, path=str(out))
        runs[f"clover {name}"] = r

    full = L == max(args.layer_list)  # the smaller layer counts only feed the fit of the q4_k runs
    if full:
        mine("bf16", ["--experts", "bf16"])
    # the rest at Q8_0 like llama-quantize's Q8_0 ftype, so that both files hold the same types
    mine("q4_k", ["--outtype", "q8_0"])
    if full:
        mine("q4_k+imatrix", ["--outtype", "q8_0", "--imatrix", im])

    # llama.cpp step 1: convert_hf_to_gguf.py (pre-tokenizer check bypassed: our tokenizer's
    # hash is not in its table; the vocabulary is tiny next to the tensors)
    lenv = dict(env)
    lenv["PYTHONPATH"] = os.pathsep.join(
        [
            str(Path(args.pythonpath)) if args.pythonpath else "",
            str(Path(args.llama_cpp)),
            str(Path(args.llama_cpp) / "gguf-py"),
        ]
    )
    q_bf16 = outd / "qwen3moe-bf16.gguf"
    wrapper = (
        "import sys, runpy; import conversion.base as b; "
        "b.TextModel.get_vocab_base_pre = lambda self, tok: 'qwen2'; "
        f"sys.argv = ['convert_hf_to_gguf.py', {str(qdir)!r}, '--outfile', {str(q_bf16)!r}, '--outtype', 'bf16']; "
        f"runpy.run_path({str(Path(args.llama_cpp) / 'convert_hf_to_gguf.py')!r}, run_name='__main__')"
    )
    warm(sorted(qdir.glob("*.safetensors")))
    r = timed([py, "-c", wrapper], env=lenv)
    r.update(input_bytes=in_q, output_bytes=q_bf16.stat().st_size, path=str(q_bf16))
    runs["llama.cpp convert_hf_to_gguf bf16"] = r

    def quantize(name, extra):
        out = outd / f"qwen3moe-{name}.gguf"
        warm([q_bf16])
        # overrides apply only under a quantized ftype: Q8_0 for the rest, experts Q4_K
        r = timed(
            [
                args.llama_quantize,
                *extra,
                "--tensor-type",
                "ffn_gate_exps=q4_k",
                "--tensor-type",
                "ffn_up_exps=q4_k",
                "--tensor-type",
                "ffn_down_exps=q4_k",
                q_bf16,
                out,
                "Q8_0",
                th,
            ],
            env=env,
        )
        r.update(input_bytes=q_bf16.stat().st_size, output_bytes=out.stat().st_size, path=str(out))
        runs[f"llama-quantize {name}"] = r

    quantize("q4_k", [])
    if full:
        quantize("q4_k+imatrix", ["--imatrix", im])

    # bit-exactness of the expert blocks between the two pipelines
    names = {GGUF_EXPERT_NAME[p].format(bid=b) for p in ("gate", "up", "down") for b in range(L)}
    same = {}
    for tag in ("q4_k", "q4_k+imatrix") if full else ("q4_k",):
        a = tensor_bytes(runs[f"clover {tag}"]["path"], names)
        b = tensor_bytes(runs[f"llama-quantize {tag}"]["path"], names)
        same[tag] = all(a[n] == b[n] for n in names) and len(a) == len(names) == len(b)
    results[L] = {
        "runs": {k: {kk: vv for kk, vv in v.items() if kk != "log"} for k, v in runs.items()},
        "experts_identical": same,
        "input_clover": in_c,
        "input_qwen": in_q,
    }
    if not args.keep:
        for p in outd.glob("*.gguf"):
            p.unlink()


def report(results: dict, args):
    Ls = sorted(results)
    print(f"\nClover-35B-A3B shapes, layers {Ls}; {os.cpu_count()} CPUs (shared), threads {args.threads}")
    for L in Ls:
        R = results[L]
        print(
            f"\n== {L} layer(s): clover input {R['input_clover'] / 1e9:.2f} GB, "
            f"qwen3moe input {R['input_qwen'] / 1e9:.2f} GB =="
        )
        print(f"{'run':<40} {'wall s':>8} {'in GB/s':>8} {'peak RSS MiB':>13} {'output GB':>10}")
        for name, r in R["runs"].items():
            print(
                f"{name:<40} {r['wall_s']:8.1f} {r['input_bytes'] / r['wall_s'] / 1e9:8.3f} "
                f"{r['peak_rss_mib']:13.0f} {r['output_bytes'] / 1e9:10.3f}"
            )
        ru = R["runs"]
        for tag in R["experts_identical"]:
            mine = ru[f"clover {tag}"]
            theirs_t = ru["llama.cpp convert_hf_to_gguf bf16"]["wall_s"] + ru[f"llama-quantize {tag}"]["wall_s"]
            theirs_rss = max(
                ru["llama.cpp convert_hf_to_gguf bf16"]["peak_rss_mib"], ru[f"llama-quantize {tag}"]["peak_rss_mib"]
            )
            print(
                f"end to end {tag:<13}: clover-gguf {mine['wall_s']:.1f}s, llama.cpp two steps {theirs_t:.1f}s "
                f"(x{theirs_t / mine['wall_s']:.2f}); peak RSS {mine['peak_rss_mib']:.0f} vs {theirs_rss:.0f} MiB "
                f"({100 * mine['peak_rss_mib'] / theirs_rss:.1f}%); expert blocks identical: "
                f"{R['experts_identical'][tag]}"
            )
    if len(Ls) >= 2:
        a_L, b_L = Ls[0], Ls[-1]
        print(f"\n== extrapolated to 40 layers (linear in layers from {a_L} and {b_L}) ==")
        print(f"{'run':<40} {'wall s':>9} {'peak RSS MiB':>13} {'output GB':>10}")

        def fit(key, field):
            ya, yb = results[a_L]["runs"][key][field], results[b_L]["runs"][key][field]
            return ya + (yb - ya) / (b_L - a_L) * (40 - a_L)

        def family(key):
            return "clover q4_k" if key.startswith("clover") else "llama-quantize q4_k"

        e = {}
        for key in results[b_L]["runs"]:
            if key in results[a_L]["runs"]:
                e[key] = tuple(fit(key, f) for f in ("wall_s", "peak_rss_mib", "output_bytes"))
                how = "fit"
            else:  # measured at b_L only: RSS as measured (streaming: it does not grow with
                # layers); same output types as its family's fitted run -> scaled like it, else
                # (the BF16 copy) time and output scaled with the input size
                fam = family(key)
                rb, rf = results[b_L]["runs"][key], results[b_L]["runs"][fam]
                if (
                    abs(rb["output_bytes"] - rf["output_bytes"]) < 1e-3 * rf["output_bytes"]
                ):  # same types (metadata aside)
                    k_t, k_o = fit(fam, "wall_s") / rf["wall_s"], fit(fam, "output_bytes") / rf["output_bytes"]
                    how = f"scaled as {fam}"
                else:
                    in_key = "input_clover" if key.startswith("clover") else "input_qwen"
                    in40 = results[a_L][in_key] + (results[b_L][in_key] - results[a_L][in_key]) / (b_L - a_L) * (
                        40 - a_L
                    )
                    k_t = k_o = in40 / results[b_L][in_key]
                    how = "scaled with input size"
                e[key] = (rb["wall_s"] * k_t, rb["peak_rss_mib"], rb["output_bytes"] * k_o)
            print(f"{key:<40} {e[key][0]:9.0f} {e[key][1]:13.0f} {e[key][2] / 1e9:10.2f}  ({how})")
        for tag in ("q4_k", "q4_k+imatrix"):
            theirs = e["llama.cpp convert_hf_to_gguf bf16"][0] + e[f"llama-quantize {tag}"][0]
            mine = e[f"clover {tag}"][0]
            print(
                f"end to end {tag:<13}: clover-gguf {mine / 60:.1f} min vs llama.cpp {theirs / 60:.1f} min "
                f"(x{theirs / mine:.2f})"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def quality(model_dir: str, work: str, n_tokens: int = 8192, seq_len: int = 512):
    """Acceptance figures: the PyTorch reference on weights dequantized from each GGUF vs on
    the source (BF16) weights, on held-out stdlib text (clover_gguf.data): mean KL and top-1
    agreement of the denoising logits (half the tokens of each block masked)."""
    from clover_gguf.convert.converter import convert
    from clover_gguf.gguf_io.reader import logit_agreement
    from clover_gguf.tokenizer import CloverTokenizer
    from clover_gguf.train.data import heldout_files, read_corpus

    tok = CloverTokenizer.from_dir(model_dir)
    ids = []
    for text in read_corpus(heldout_files()):
        ids += tok.encode(text)
        if len(ids) >= n_tokens:
            break
    ids = ids[:n_tokens]
    Path(work).mkdir(parents=True, exist_ok=True)
    print(f"\n== quality: {model_dir}, {len(ids)} held-out tokens, sequences of {seq_len}, mask ratio 0.5 ==")
    print(f"{'GGUF':<34} {'bpw':>6} {'mean KL':>9} {'top-1':>7} {'KL masked':>10} {'top-1 masked':>13}")
    for name, kw in (
        ("bf16", dict(recipe="bf16")),
        ("q8_0", dict(recipe="q8_0")),
        ("q4_k (experts Q4_K, rest BF16)", dict(recipe="q4_k")),
        ("q4_k_m", dict(recipe="q4_k_m")),
        ("q4_0 experts", dict(experts="q4_0")),
        ("mxfp4 experts", dict(experts="mxfp4")),
    ):
        out = Path(work) / f"quality-{name.split()[0]}.gguf"
        res = convert(model_dir, out, force=True, progress=False, **kw)
        r = logit_agreement(model_dir, out, ids, seq_len=seq_len)
        print(
            f"{name:<34} {res.plan.bpw:6.2f} {r['mean_kl']:9.2e} {r['top1_agreement']:7.3f} "
            f"{r['mean_kl_masked']:10.2e} {r['top1_agreement_masked']:13.3f}"
        )


def main():
    if "--quality" in sys.argv:
        i = sys.argv.index("--quality")
        quality(
            sys.argv[i + 1], sys.argv[sys.argv.index("--work") + 1] if "--work" in sys.argv else "/tmp/clover-quality"
        )
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/clover-bench")
    ap.add_argument("--layers", default="1,2", help="comma-separated layer counts")
    ap.add_argument("--llama-cpp", required=True, help="llama.cpp source tree (convert_hf_to_gguf.py)")
    ap.add_argument("--llama-quantize", required=True)
    ap.add_argument("--pythonpath", help="extra folder with transformers for convert_hf_to_gguf.py")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--keep", action="store_true", help="keep the output GGUFs")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--report-only", metavar="JSON", help="print the report of an earlier --json and exit")
    ap.add_argument(
        "--quality",
        metavar="MODEL_DIR",
        help="instead: KL / top-1 of the reference on dequantized "
        "weights vs the source, on held-out text, for several recipes (needs a tokenizer)",
    )
    if "--report-only" in sys.argv:
        i = sys.argv.index("--report-only")
        args = argparse.Namespace(json=None, threads=os.cpu_count())
        results = {int(k): v for k, v in json.loads(Path(sys.argv[i + 1]).read_text()).items()}
        report(results, args)
        return
    args = ap.parse_args()
    args.layer_list = [int(x) for x in args.layers.split(",")]
    Path(args.work).mkdir(parents=True, exist_ok=True)
    results = {}
    for L in args.layer_list:
        run_layers(L, args, results)
        report(results, args)  # partial figures as soon as they exist
    print("\n(final)")


if __name__ == "__main__":
    main()
