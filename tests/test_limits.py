"""The limits table: the C++ copy in the llama.cpp patch (src/clover-validate.cpp) equals
limits.py, and both sides word a refusal alike."""

import math
import re

import pytest
from testdata import REPO

from clover_gguf.gguf_io import reader
from clover_gguf.limits import BY_GGUF, LIMITS, MAX_STATE_BYTES, LimitError, check_config_values


def _cpp_table():
    patch = next((REPO / "patches").glob("*-add-the-clover-architecture*.patch"))  # src/clover-validate.cpp
    text = patch.read_text()
    body = text[text.index("const clover_limit CLOVER_LIMITS[] = {") :]
    body = body[: body.index("};")]
    rows = re.findall(
        r'\{\s*"([^"]+)",\s*([-\w.+]+),\s*([-\w.+]+),\s*(true|false),\s*(true|false),\s*(true|false)\s*\}', body
    )
    state = re.search(r"CLOVER_MAX_STATE_BYTES = (\d+)ull", text)
    return rows, int(state.group(1))


def test_cpp_table_equals_python_table():
    rows, state = _cpp_table()
    assert [r[0] for r in rows] == [lim.gguf for lim in LIMITS]
    for (key, lo, hi, integer, lo_open, required), lim in zip(rows, LIMITS):
        assert float(lo) == lim.lo and float(hi) == lim.hi, key
        assert (integer == "true") == lim.integer and (lo_open == "true") == lim.lo_open, key
        assert (required == "true") == (key in reader._REQUIRED), key
    assert state == MAX_STATE_BYTES


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("diffusion.block_size", 10**9, "clover.diffusion.block_size = 1000000000: must be an integer in [1, 1024]"),
        ("attention.layer_norm_rms_epsilon", math.nan, "= nan: must be a finite number in (0, 1]"),
        ("attention.layer_norm_rms_epsilon", -1e-6, "= -1e-06: must be a finite number in (0, 1]"),
        ("rope.freq_base", math.inf, "clover.rope.freq_base = inf: must be a finite number in [1, 1e+12]"),
        ("rope.freq_base", 0.0, "clover.rope.freq_base = 0: must be a finite number in [1, 1e+12]"),
        ("expert_count", 0, "clover.expert_count = 0: must be an integer in [1, 1024]"),
    ],
)
def test_wording(key, value, message):
    with pytest.raises(LimitError) as e:
        BY_GGUF[key].check(value)
    assert message in str(e.value)


def test_rules_between_keys():
    base = {
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "attention.key_length": 16,
        "expert_count": 4,
        "expert_used_count": 2,
        "diffusion.block_size": 8,
        "context_length": 64,
        "block_count": 2,
    }

    def check(**over):
        v = {**base, **over}
        check_config_values(lambda lim: v.get(lim.gguf))

    check()
    for over, msg in [
        (
            dict(**{"attention.head_count_kv": 3}),
            "clover.attention.head_count_kv = 3: must divide clover.attention.head_count (4)",
        ),
        (dict(**{"attention.key_length": 15}), "clover.attention.key_length = 15: must be even"),
        (dict(expert_used_count=5), "clover.expert_used_count = 5: must be at most clover.expert_count (4)"),
        (dict(context_length=4), "clover.context_length = 4: must be at least clover.diffusion.block_size (8)"),
        (
            dict(
                block_count=512,
                **{"attention.head_count_kv": 256, "attention.head_count": 256, "attention.key_length": 512},
            ),
            "clover.block_count = 512: memory state of 137438953472 bytes",
        ),
    ]:
        with pytest.raises(LimitError, match=re.escape(msg)):
            check(**over)


BIG = 10**400  # a JSON integer has no size limit; float() of it raises OverflowError


def test_huge_integers_are_refused_by_every_limit():
    for lim in LIMITS:
        with pytest.raises(LimitError) as e:
            lim.check(BIG)
        assert "(401 digits)" in str(e.value) and lim.gguf_key in str(e.value)


@pytest.mark.parametrize("key", ["vocab_size", "rms_norm_eps", "max_position_embeddings", "mask_token_id"])
@pytest.mark.parametrize("command", ["inspect", "convert", "run"])
def test_huge_integer_in_config_json_is_one_line(tmp_path, key, command):
    """Issue 26 defect 7: a 400-digit integer in config.json was an OverflowError traceback."""
    import json
    import shutil

    from click.testing import CliRunner
    from testdata import VECTORS

    from clover_gguf.cli import cli

    model = tmp_path / "m"
    shutil.copytree(VECTORS / "random-clover", model)
    cfg = json.loads((model / "config.json").read_text())
    cfg[key] = BIG
    (model / "config.json").write_text(json.dumps(cfg))
    args = {
        "inspect": ["inspect", str(model)],
        "convert": ["convert", str(model), "-o", str(tmp_path / "o.gguf")],
        "run": ["run", str(model), "--prompt-ids", "1"],
    }[command]
    res = CliRunner().invoke(cli, args)
    assert not isinstance(res.exception, OverflowError), res.exception
    assert res.exit_code == 1 and res.stderr.count("\n") == 1, res.stderr
    assert f"key '{key}'" in res.stderr and "digits" in res.stderr, res.stderr
    assert not (tmp_path / "o.gguf").exists()
