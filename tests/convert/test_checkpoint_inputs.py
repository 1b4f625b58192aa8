"""What the converter reads from a checkpoint folder besides the weights (issue 47): a JSON key
given twice is refused naming the file and the key (json.loads kept the last value silently),
a tokenizer file too large to read whole is refused unread, and the disk-space refusal states
the figures it compares, margin included. One line and exit 1 each."""

import json
import shutil
from collections import namedtuple

import pytest
from click.testing import CliRunner
from testdata import TINY, editable_tiny

from clover_gguf.cli import cli
from clover_gguf.config import CloverConfig, ConfigError
from clover_gguf.convert import ConvertError, converter
from clover_gguf.convert.converter import convert
from clover_gguf.inputs import DuplicateKeyError, InputError, loads_json, read_bytes
from clover_gguf.tokenizer import MAX_TOKENIZER_FILE, CloverTokenizer, TokenizerError


def _convert_fails(m, out, needle):
    res = CliRunner().invoke(cli, ["convert", str(m), "-o", str(out)])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert res.exit_code == 1 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("Error: ") and needle in res.stderr, res.stderr
    assert not out.exists() and not list(out.parent.glob(".*.tmp"))


def _dup_after(text: str, anchor: str, key: str, value: str) -> str:
    """The JSON text with ``"key": value,`` inserted after the first ``anchor``."""
    i = text.index(anchor) + len(anchor)
    return text[:i] + f' "{key}": {value},' + text[i:]


def test_loads_json_refuses_a_key_given_twice_at_any_depth():
    assert loads_json('{"a": 1, "b": {"a": 2}}') == {"a": 1, "b": {"a": 2}}
    for text, key in (('{"a": 1, "a": 1}', "a"), ('{"x": [{"k": 1, "k": 2}]}', "k")):
        with pytest.raises(DuplicateKeyError) as e:
            loads_json(text)
        assert e.value.key == key and str(e.value) == f"duplicate key {key!r}"


def test_config_json_key_given_twice(tmp_path):
    """num_experts 8, then 4: json.loads took 4 without a word."""
    m = editable_tiny(tmp_path)
    c = m / "config.json"
    c.write_text(c.read_text().replace('"num_experts": 8,', '"num_experts": 8, "num_experts": 4,'))
    assert c.read_text().count('"num_experts"') == 2
    with pytest.raises(ConfigError) as e:
        CloverConfig.load(m)
    assert str(e.value) == f"{c}: key 'num_experts' is given more than once"
    _convert_fails(m, tmp_path / "o.gguf", f"{c}: key 'num_experts' is given more than once")


def test_tokenizer_config_json_key_given_twice(tmp_path):
    m = editable_tiny(tmp_path)
    tc = m / "tokenizer_config.json"
    tc.write_text(_dup_after(tc.read_text(), "{", "eos_token", '"<|mask|>"'))
    with pytest.raises(TokenizerError) as e:
        CloverTokenizer.from_dir(m)
    assert str(e.value) == f"{tc}: key 'eos_token' is given more than once"
    _convert_fails(m, tmp_path / "o.gguf", f"{tc}: key 'eos_token' is given more than once")


def test_tokenizer_json_vocabulary_key_given_twice(tmp_path):
    """A token string twice in model.vocab: the tokenizers library keeps the last id; the GGUF's
    vocabulary would silently miss one."""
    m = editable_tiny(tmp_path)
    tj = m / "tokenizer.json"
    text = tj.read_text()
    vocab = json.loads(text)["model"]["vocab"]
    token = next(t for t, i in vocab.items() if i >= 300 and t.isalnum())
    tj.write_text(_dup_after(text, '"vocab": {', token, str(vocab[token] + 1)))
    _convert_fails(m, tmp_path / "o.gguf", f"{tj}: key '{token}' is given more than once")


def test_index_json_key_given_twice(tmp_path):
    from clover_gguf.checkpoint import Checkpoint, CheckpointError

    m = editable_tiny(tmp_path)
    names = list(Checkpoint(TINY).names())
    wm = ", ".join(f'"{n}": "model.safetensors"' for n in names)
    (m / "model.safetensors.index.json").write_text(
        '{"metadata": {}, "weight_map": {' + wm + f', "{names[3]}": "model.safetensors"' + "}}"
    )
    with pytest.raises(CheckpointError) as e:
        Checkpoint(m)
    assert str(e.value) == f"{m / 'model.safetensors.index.json'}: bad index file (duplicate key {names[3]!r})"


def test_a_tokenizer_file_over_the_limit_is_refused_unread(tmp_path):
    """Issue 47: a 500 MB tokenizer.json was read whole (1.26 GB peak). A sparse file of that
    size is refused from its size alone: no byte of it is read."""
    assert MAX_TOKENIZER_FILE == 64 << 20  # twice Gemma 3's 33 MB tokenizer.json, the largest in wide use
    m = editable_tiny(tmp_path)
    tj = m / "tokenizer.json"
    with open(tj, "r+b") as f:
        f.truncate(500 << 20)
    why = (
        f"{tj}: 524,288,000 bytes (500.0 MiB), more than the 67,108,864 bytes (64.0 MiB) such a file may have; not read"
    )
    with pytest.raises(TokenizerError) as e:
        CloverTokenizer.from_dir(m)
    assert str(e.value) == why
    _convert_fails(m, tmp_path / "o.gguf", why)
    tj.unlink()
    shutil.copy(TINY / "tokenizer.json", tj)
    tc = m / "tokenizer_config.json"
    with open(tc, "r+b") as f:
        f.truncate(MAX_TOKENIZER_FILE + 1)
    with pytest.raises(TokenizerError, match=f"{tc}: 67,108,865 bytes"):
        CloverTokenizer.from_dir(m)


def test_read_bytes_limit_is_inclusive(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"x" * 10)
    assert read_bytes(p, max_bytes=10) == b"x" * 10
    with pytest.raises(InputError, match="f: 10 bytes, more than the 9 bytes such a file may have; not read"):
        read_bytes(p, max_bytes=9)


def test_disk_space_refusal_states_the_margin(tmp_path, monkeypatch):
    """Issue 47: "not enough disk space (X free, Y needed)" compared X with Y plus a 16 MiB margin
    it did not state. Now the line gives what is needed, margin included, and what is free; a
    folder with exactly that much free is enough."""
    from clover_gguf.convert.tensor_plan import fmt_bytes

    need = convert(TINY, dry_run=True, progress=False).plan.total_bytes
    total = need + converter.HEADER_MARGIN
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(converter.shutil, "disk_usage", lambda p: usage(10 * total, 0, total - 1))
    out = tmp_path / "o.gguf"
    with pytest.raises(ConvertError) as e:
        convert(TINY, out, progress=False)
    assert str(e.value) == (
        f"{tmp_path}: not enough disk space: {fmt_bytes(total)} needed ({fmt_bytes(need)} of tensor data and "
        f"16.00 MiB for the header and metadata), {fmt_bytes(total - 1)} free"
    )
    assert not out.exists()
    monkeypatch.setattr(converter.shutil, "disk_usage", lambda p: usage(10 * total, 0, total))
    convert(TINY, out, progress=False)
    assert out.stat().st_size <= total
