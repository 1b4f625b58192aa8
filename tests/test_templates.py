"""Chat templates with limits (issue 47): a template is a program from the model file, and a
hostile one rendered for ever (nested range(100000) loops) or took 4-5 GB ('x' * 2000000000,
tojson(indent=1e9)). Rendering stops at TEMPLATE_LIMITS (time, output, range items, sizes of
`*` and of namespace values), `convert` renders a template once on a test conversation before it
writes it, and `run --chat` on a GGUF whose template is hostile is one line."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from testdata import TINY, editable_tiny

from clover_gguf.cli import cli
from clover_gguf.tokenizer import TemplateBudget, check_chat_template, render_chat_template

HOSTILE = {
    "nested range loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
    "a huge repetition": "{{ 'x' * 2000000000 }}",
    "a huge tojson indent": "{{ messages | tojson(indent=1000000000) }}",
    "a doubling namespace value": (
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"
    ),
    "unbounded recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "loops over the messages": (
        "{% for a in messages %}{% for b in messages %}{% for c in messages %}{{ a['role'] }}"
        "{% endfor %}{% endfor %}{% endfor %}"
    ),
    "a power": "{{ 10 ** 100000000 }}",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_templates_stop_at_a_limit(name):
    msgs = [{"role": "user", "content": "x"}] * 400
    with pytest.raises(TemplateBudget):
        render_chat_template(HOSTILE[name], messages=msgs, add_generation_prompt=True)


def test_the_models_templates_render_within_the_limits():
    for m in (TINY, TINY.parent / "clover-tiny-v3-wip"):
        tpl = json.loads((m / "tokenizer_config.json").read_text())["chat_template"]
        check_chat_template(tpl, str(m))  # raises if not


def test_convert_refuses_a_hostile_template_before_writing(tmp_path):
    m = editable_tiny(tmp_path)
    tc = m / "tokenizer_config.json"
    cfg = json.loads(tc.read_text())
    cfg["chat_template"] = HOSTILE["nested range loops"]
    tc.write_text(json.dumps(cfg))
    out = tmp_path / "o.gguf"
    res = CliRunner().invoke(cli, ["convert", str(m), "-o", str(out)])
    assert res.exit_code == 1 and res.stderr.count("\n") == 1, res.stderr
    assert "tokenizer_config.json: chat_template: " in res.stderr and "range items" in res.stderr
    assert not out.exists() and not list(tmp_path.glob(".*.tmp"))
