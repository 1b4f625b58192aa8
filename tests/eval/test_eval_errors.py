"""`clover-gguf eval ...`: every bad option or input is one line and a non-zero exit, and a
GGUF that is not a conversion of the reference is refused before anything is scored."""

import pytest
from click.testing import CliRunner
from eval_helpers import RC, docs
from testdata import TINY

from clover_gguf.cli import cli
from clover_gguf.eval.quality.run import Generation, QualityError, Sampling, check_matches_reference, run_quality
from clover_gguf.gguf_io import codec as F


@pytest.fixture(scope="module")
def rc_gguf(converted):
    return converted(RC, "bf16")


def _invoke(*args):
    res = CliRunner().invoke(cli, list(args))
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res


def _one_line(res, needle):
    assert res.exit_code != 0, res.output
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("Error: "), res.stderr
    assert needle in res.stderr, res.stderr


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--windows", "0"], "'--windows': 0 is not in the range 1<=x<=1048576"),
        (["--blocks", "-1"], "'--blocks': -1 is not in the range 1<=x<=1048576"),
        (["--top-k", "0"], "--top-k 0: must be an integer in [1, 16777216] (or auto)"),
        (["--top-k", "many"], "--top-k 'many': a number or auto"),
        (["--block-size", "-3"], "'--block-size': -3 is not in the range 1<=x<=1024"),
        (["--ratios", "0.5,1.5"], "every mask ratio must be in (0, 1]"),
        (["--ratios", "nan"], "every mask ratio must be in (0, 1]"),
        (["--ratios", "a,b"], "comma-separated numbers expected"),
        (["--threshold", "nan"], "nan is not a finite number in [0, 1]"),
        (["--threshold", "2"], "'--threshold': 2 is not a finite number in [0, 1]"),
        (["--threads", "0"], "'--threads': 0 is not in the range 1<=x<=512"),
        (["--max-new-tokens", "0"], "'--max-new-tokens': 0 is not in the range"),
        (["--n-prompts", "0"], "'--n-prompts': 0 is not in the range 1<=x<=1048576"),
    ],
)
def test_quality_options(rc_gguf, tmp_path, args, needle):
    _one_line(_invoke("eval", "quality", "--reference", str(RC), str(rc_gguf), "--out", str(tmp_path), *args), needle)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--sweep", "block_size=0,8"], "every block_size must be in [1, 1024]"),
        (["--sweep", "threshold=nan"], "every threshold must be in [0.0, 1.0]"),
        (["--sweep", "steps=x"], "integers expected"),
        (["--sweep", "bogus=1"], "one of block_size"),
        (["--runs", "0"], "'--runs': 0 is not in the range 1<=x<=1048576"),
        (["--block-size", "5000"], "'--block-size': 5000 is not in the range 1<=x<=1024"),
    ],
)
def test_speed_options(rc_gguf, tmp_path, args, needle):
    _one_line(_invoke("eval", "speed", str(rc_gguf), "--out", str(tmp_path), *args), needle)


def test_sensitivity_unknown_type_and_group(tmp_path):
    _one_line(_invoke("eval", "sensitivity", "--reference", str(RC), "--type", "q9_z", "--out", str(tmp_path)), "q9_z")
    _one_line(
        _invoke("eval", "sensitivity", "--reference", str(RC), "--group", "nope", "--out", str(tmp_path)),
        "unknown tensor group 'nope'",
    )


def test_empty_and_non_utf8_corpus(tmp_path, converted):
    g = converted(TINY, "bf16")
    (tmp_path / "empty.txt").write_text("")
    res = _invoke("eval", "quality", "--reference", str(TINY), str(g), "--corpus", str(tmp_path / "empty.txt"))
    _one_line(res, "the corpus (1 documents, 0 tokens) has no document of two blocks of 16 tokens")
    (tmp_path / "bad.txt").write_bytes(b"def f():\n    return '\xff'\n")
    res = _invoke("eval", "quality", "--reference", str(TINY), str(g), "--corpus", str(tmp_path / "bad.txt"))
    _one_line(res, f"{tmp_path / 'bad.txt'}: not UTF-8 text (byte 21)")


def test_bad_prompt_file(rc_gguf, tmp_path):
    """Checked before the corpus and the reference logits (the random clover has no tokenizer:
    the corpus would fail after the prompts)."""
    p = tmp_path / "p.jsonl"
    for content, needle in [
        ("{nope\n", "p.jsonl:1: not JSON"),
        ('{"ids": [1, 99999]}\n', "p.jsonl:1: token 99999 is not an id in [0, 96]"),
        ('{"ids": "1,2"}\n', 'p.jsonl:1: "ids" must be a list of integers'),
        ("\n", "p.jsonl: no prompts"),
    ]:
        p.write_text(content)
        res = _invoke(
            "eval", "quality", "--reference", str(RC), str(rc_gguf), "--prompts", str(p), "--out", str(tmp_path / "o"),
            "--windows", "1", "--blocks", "3", "--backend", "reference", "--top-k", "8",
        )  # fmt: skip
        _one_line(res, needle)


def test_truncated_gguf(rc_gguf, tmp_path):
    t = tmp_path / "t.gguf"
    t.write_bytes(rc_gguf.read_bytes()[:3000])
    _one_line(_invoke("eval", "quality", "--reference", str(RC), str(t), "--out", str(tmp_path / "o")), str(t))


def test_permuted_token_strings_are_refused(rc_gguf, tmp_path):
    """The same weights with two token strings swapped would score perfectly: refused by hash."""
    g = F.parse(rc_gguf.read_bytes())
    toks = next(kv for kv in g.kvs if kv.key == b"tokenizer.ggml.tokens").value[1]
    toks[5], toks[6] = toks[6], toks[5]
    bad = tmp_path / "perm.gguf"
    bad.write_bytes(F.serialize(g)[0])
    with pytest.raises(QualityError, match=r"tokenizer token strings differ \(sha256 \w+ vs \w+; first at token 5"):
        run_quality(RC, [bad], Sampling(n_windows=1, n_blocks=2), log=lambda *a: None)
    res = _invoke("eval", "quality", "--reference", str(RC), str(bad), "--out", str(tmp_path / "o"))
    _one_line(res, "does not match the reference")


def test_gguf_of_another_model_is_refused(tmp_path, converted):
    from clover_gguf.config import CloverConfig

    other = converted(TINY, "bf16")
    with pytest.raises(QualityError, match="vocab_size is 4100, the reference's is 97"):
        check_matches_reference(other, RC, CloverConfig.load(RC))
    _one_line(
        _invoke("eval", "quality", "--reference", str(RC), str(other), "--out", str(tmp_path / "o")),
        "vocab_size is 4100, the reference's is 97",
    )


def test_conversion_of_the_reference_matches(rc_gguf):
    from clover_gguf.config import CloverConfig

    check_matches_reference(rc_gguf, RC, CloverConfig.load(RC))  # no error


def test_same_shapes_other_weights_is_refused(tmp_path):
    """Issue 26 defect 8: a synthetic model of the reference's shapes and tokenizer was scored
    (KL 3.5, exit 0). The GGUF records the source weights' fingerprint; eval compares it."""
    from clover_gguf.config import CloverConfig
    from clover_gguf.convert.converter import convert
    from clover_gguf.synthetic import write_synthetic

    other = tmp_path / "other"
    write_synthetic(other, CloverConfig.load(RC), seed=3, progress=False)
    g = tmp_path / "other.gguf"
    convert(other, g, recipe="bf16", progress=False)
    check = lambda: check_matches_reference(g, RC, CloverConfig.load(RC))  # noqa: E731
    with pytest.raises(QualityError, match="it is not a conversion of this reference"):
        check()  # config, shapes and (placeholder) tokenizer all match: only the fingerprint differs
    res = _invoke("eval", "quality", "--reference", str(RC), str(g), "--out", str(tmp_path / "o"))
    _one_line(res, "clover_gguf.source_weights_sha256")
    assert not (tmp_path / "o" / "quality.json").exists()


def test_a_gguf_without_the_fingerprint_keeps_the_other_checks(rc_gguf, tmp_path):
    """Files converted before the fingerprint (or by llama.cpp's converter) are matched by config,
    shapes and tokenizer as before, and the report says so."""
    from clover_gguf.config import CloverConfig
    from clover_gguf.constants import Keys

    g = F.parse(rc_gguf.read_bytes())
    g.kvs = [kv for kv in g.kvs if kv.key != Keys.SOURCE_WEIGHTS_SHA256.encode()]
    old = tmp_path / "old.gguf"
    old.write_bytes(F.serialize(g)[0])
    note = check_matches_reference(old, RC, CloverConfig.load(RC))
    assert "has no clover_gguf.source_weights_sha256" in note and "config, shapes and tokenizer only" in note
    s = Sampling(docs=docs(), n_windows=1, n_blocks=2, top_k=8)
    run = run_quality(RC, [old], s, Generation(enabled=False), backend="reference", log=lambda *a: None)
    assert any("has no clover_gguf.source_weights_sha256" in n for n in run.notes)
    assert check_matches_reference(rc_gguf, RC, CloverConfig.load(RC)) is None  # carries the matching value
