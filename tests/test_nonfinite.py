"""Non-finite logits never become tokens (issue 26, defect 3): a finite but huge weight (3e38 in
blk.0.attn_norm.weight, BF16 3.4e38 in output.weight) made every logit NaN and `run` printed
tokens with exit 0. Now `run` and every Python generation path stop with one line naming the
first layer or tensor whose output went non-finite (a debug pass: llama.cpp's eval callback on
a second context, or forward hooks on the PyTorch reference), and the converter warns about
such weights, one line per tensor."""

import shutil

import pytest
import torch
from click.testing import CliRunner
from testdata import REPO, TINY, VECTORS

from clover_gguf.checkpoint import Checkpoint
from clover_gguf.cli import cli
from clover_gguf.convert.pipeline import BIG_WEIGHT_EXP, first_at_least
from clover_gguf.reference.generate import GenerationConfig, NonFiniteError, generate

VEC = VECTORS / "random-clover"


def _with(dst, name, value):
    """random-clover with every element of tensor ``name`` set to ``value`` (BF16)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(VEC, dst)
    sd = load_file(dst / "model.safetensors")
    sd[name] = torch.full_like(sd[name], value)
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _huge_norm(dst):
    return _with(dst, "model.layers.0.input_layernorm.weight", 3e38)


def _huge_output(dst):  # BF16's largest value, 0x7F7F = 3.39e38
    return _with(dst, "lm_head.weight", torch.tensor([0x7F7F], dtype=torch.int16).view(torch.bfloat16).item())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from clover_gguf.convert.converter import convert

    d = tmp_path_factory.mktemp("nonfinite")
    out = {}
    for name, make in (("norm", _huge_norm), ("output", _huge_output)):
        m = make(d / name)
        g = d / f"{name}.gguf"
        convert(m, g, progress=False)
        out[name] = (m, g)
    return out


def _cli(*args):
    res = CliRunner().invoke(cli, [str(a) for a in args])
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res


def _refused(res, *needles):
    assert res.exit_code == 1, (res.stdout, res.stderr)
    assert res.stdout == "", "tokens were printed"
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("Error: "), res.stderr
    for n in needles:
        assert n in res.stderr, res.stderr


# ---- the converter's warning ---------------------------------------------------------------


@pytest.mark.parametrize(
    "name,tensor,source",
    [
        ("norm", "blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
        ("output", "output.weight", "lm_head.weight"),
    ],
)
def test_converter_warns_once_per_tensor(models, tmp_path, name, tensor, source):
    m, _ = models[name]
    res = _cli("convert", m, "-o", tmp_path / "o.gguf", "-q")
    assert res.exit_code == 0, res.stderr
    warnings = [line for line in res.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1, res.stderr
    assert warnings[0].startswith(f"warning: {tensor}: |w| up to 3") and source in warnings[0]
    assert f"weights of 2^{BIG_WEIGHT_EXP} or more overflow" in warnings[0]


def test_no_warning_on_real_weights(tmp_path):
    """The bound is far above any trained weight: clover-tiny and the spec model have none."""
    for model in (TINY, VEC):
        ck = Checkpoint(model)
        assert all(first_at_least(ck.get(n)) is None for n in ck.names()), model
    res = _cli("convert", VEC, "-o", tmp_path / "o.gguf", "-q")
    assert res.exit_code == 0 and "warning:" not in res.stderr, res.stderr


def test_first_at_least_matches_the_bound():
    x = torch.tensor([1.0, 65000.0, -65536.0, 70000.0], dtype=torch.bfloat16)  # bf16(65000) = 65024
    assert first_at_least(x) == 2
    for dt in (torch.float32, torch.float64):
        assert first_at_least(torch.tensor([1.0, 65535.0, -65536.0], dtype=dt)) == 2
    assert first_at_least(torch.tensor([1.0, -2.0], dtype=torch.float16)) is None


# ---- the PyTorch reference ---------------------------------------------------------------


@pytest.mark.parametrize(
    "name,needle",
    [
        ("norm", "model.layers.0.input_layernorm (RMSNorm, in the prompt commit)"),
        ("output", "lm_head (Linear, in the denoising step)"),
    ],
)
def test_reference_run_stops_naming_the_module(models, name, needle):
    m, _ = models[name]
    _refused(_cli("run", m, "--prompt-ids", "1,2,3", "-n", "8"), f"{m}: non-finite logits in a denoising step", needle)


def test_reference_generate_raises(models):
    from clover_gguf.reference.generate import TorchBackend
    from clover_gguf.reference.model import CloverModel

    model = CloverModel.from_pretrained(models["norm"][0])
    cfg = GenerationConfig(block_size=8, max_new_tokens=8, mask_token_id=96)
    with pytest.raises(NonFiniteError, match="first non-finite output is model.layers.0.input_layernorm"):
        generate(TorchBackend(model), [1, 2, 3], cfg)


# ---- the llama.cpp runtime (CLOVER_ERR_NONFINITE, then the eval-callback pass) -------------


@pytest.mark.parametrize(
    "name,needle",
    [
        ("norm", "attn_norm-0 (layer 0, MUL of norm-0 and blk.0.attn_norm.weight, in the prompt commit)"),
        ("output", "result_output (MUL_MAT of output.weight and result_norm, in the denoising step)"),
    ],
)
def test_gguf_run_stops_naming_the_tensor(models, name, needle):
    _, g = models[name]
    res = _cli("run", g, "--prompt-ids", "1,2,3", "-n", "8", "-t", "1")
    _refused(res, f"{g}: non-finite logits in a denoising step (sequence 0, block 0, step 0", needle)


def test_runtime_python_loop_and_batch(models):
    """RuntimeBackend (generate.py's loop over clover_block_logits) and generate_batch both stop."""
    from clover_gguf.runtime.runtime import CloverRuntime, RuntimeBackend

    rt = CloverRuntime(models["norm"][1], n_threads=1, n_seq_max=2)
    cfg = GenerationConfig(block_size=8, max_new_tokens=8, mask_token_id=rt.mask_token_id)
    with pytest.raises(NonFiniteError, match=r"first non-finite output is attn_norm-0 \(layer 0"):
        generate(RuntimeBackend(rt), [1, 2, 3], cfg)
    with pytest.raises(NonFiniteError, match="non-finite logits in a denoising step"):
        rt.generate_batch([[1, 2, 3], [4, 5]], [cfg, cfg])
    rt.close()


def test_healthy_model_debug_pass_finds_nothing(converted):
    """The debug pass checks real outputs: on a healthy model every one is finite."""
    from clover_gguf.runtime.nonfinite import first_nonfinite
    from clover_gguf.runtime.runtime import CloverRuntime

    rt = CloverRuntime(converted(VEC), n_threads=1)
    found, checked = first_nonfinite(rt, [([1, 2, 3, 4, 5], 8)], [rt.mask_token_id] * 8)
    assert found is None and checked > 50
    rt.close()


@pytest.mark.parametrize(
    "kw",
    [{}, {"n_probs": 2}, {"temperature": 0.7, "top_k": 5}, {"grammar": "root ::= [^\\x00]*"}],
    ids=["graph-candidate", "host-top-probs", "host-top-k", "host-constrained"],
)
def test_one_minus_inf_logit_stops_generation(kw):
    """Found by the seed-7 GGUF fuzz campaign (tests/data/fuzz/nonfinite-neginf-*): a huge BF16
    weight in one element of output.weight made one logit -Inf at one position, which the
    candidate's probability did not show (exp(-Inf) = 0), and generation went on with exit 0.
    Every candidate path, ggml_gumbel_argmax's in the graph and the host's, refuses such a row."""
    from clover_gguf.runtime.runtime import CloverRuntime

    rt = CloverRuntime(REPO / "tests" / "data" / "fuzz" / "nonfinite-neginf-16bf63b787e7.gguf", n_threads=1)
    try:
        cfg = GenerationConfig(max_new_tokens=16, block_size=rt.default_block_size, **kw)
        with pytest.raises(NonFiniteError, match=r"non-finite logits in a denoising step \(sequence 0, block 0"):
            rt.generate(list(range(1, 12)), cfg)
    finally:
        rt.close()
