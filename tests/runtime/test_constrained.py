"""Constrained decoding in the runtime (clover.h's clover_batch_set_constraint through
GenerationConfig.grammar), token probabilities (n_probs), fixed block positions (first_block) and
the JSON-schema converter behind libclover-grammar."""

from __future__ import annotations

import json

import jsonschema
import pytest
from testdata import TINY

from clover_gguf.reference.generate import GenerationConfig
from clover_gguf.runtime.grammar import SchemaError, json_schema_to_grammar, prefix_rules, tool_call_grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
        "nested": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    },
    "required": ["name", "age", "tags", "nested"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def rt(converted):
    from clover_gguf.runtime.runtime import CloverRuntime

    r = CloverRuntime(converted(TINY, "q4_k"), n_threads=1)
    yield r
    r.close()


@pytest.fixture(scope="module")
def chat_ids(rt):
    return rt.tokenize(rt.chat_prompt([{"role": "user", "content": "Give me a JSON record"}], enable_thinking=False))


def _text(rt, res) -> str:
    return rt.detokenize([t for t in res.tokens if t not in rt.eog])


@pytest.mark.parametrize(
    "cfg",
    [
        dict(),  # greedy, threshold 0.9
        dict(steps=4),
        dict(threshold=0.5),
        dict(temperature=0.8, seed=1),
        dict(temperature=1.0, top_k=20, top_p=0.9, seed=2),
        dict(block_size=8),
    ],
    ids=["greedy", "steps4", "thr0.5", "temp", "topk-topp", "B8"],
)
def test_json_schema_output_always_validates(rt, chat_ids, cfg):
    g = json_schema_to_grammar(SCHEMA)
    res = rt.generate(chat_ids, GenerationConfig(max_new_tokens=160, grammar=g, **({"block_size": 16} | cfg)))
    text = _text(rt, res)
    assert len(res.tokens) < 160  # the grammar ended the reply (EOS and what follows are dropped)
    jsonschema.validate(json.loads(text), SCHEMA)  # a complete, valid object: the grammar ended the reply


def test_constrained_steps_walk_left_to_right(rt, chat_ids):
    """A step unmasks from the leftmost masked position on while the schedule allows: at threshold
    0 the whole block in one step, with `steps` exactly the schedule's count per step."""
    lit = '{"answer": "yes", "n": 12345}'
    g = f"root ::= {json.dumps(lit)}"
    res = rt.generate(chat_ids, GenerationConfig(max_new_tokens=32, block_size=32, grammar=g, threshold=0.0))
    assert _text(rt, res) == lit
    assert res.blocks[0].steps == 1
    res = rt.generate(chat_ids, GenerationConfig(max_new_tokens=32, block_size=16, grammar=g, steps=4))
    assert _text(rt, res) == lit
    assert res.blocks[0].tokens_per_step == [4, 4, 4, 4]


def _read_file_grammar(rt):
    tool = {
        "type": "function",
        "function": {
            "name": "read_file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }
    return tool_call_grammar([tool], parallel=False), [rt.token_id("<tool_call>")]


@pytest.mark.parametrize(
    "cfg", [dict(), dict(steps=4), dict(temperature=0.8, seed=3)], ids=["greedy", "steps4", "temp"]
)
def test_a_lazy_grammar_before_its_trigger_writes_what_free_decoding_writes(rt, chat_ids, cfg):
    """A lazy grammar filters nothing before its trigger: the sequence steps as an unconstrained
    one (most confident first), the same tokens in the same steps, not left to right."""
    g, trig = _read_file_grammar(rt)
    free = rt.generate(chat_ids, GenerationConfig(max_new_tokens=48, block_size=16, **cfg))
    lazy = rt.generate(
        chat_ids, GenerationConfig(max_new_tokens=48, block_size=16, grammar=g, grammar_triggers=trig, **cfg)
    )
    assert trig[0] not in free.tokens  # clover-tiny never opens a call by itself
    end = next((i for i, t in enumerate(free.tokens) if t in rt.eog), len(free.tokens))
    assert lazy.tokens[:end] == free.tokens[:end]
    assert [b.tokens_per_step for b in lazy.blocks] == [b.tokens_per_step for b in free.blocks][: len(lazy.blocks)]


def test_a_lazy_grammar_constrains_what_follows_its_trigger(rt, chat_ids):
    """A trigger token given at position 5: positions 0-4 are decoded freely, the call after it
    under the grammar (a complete, valid call), and the grammar ends the reply."""
    g, trig = _read_file_grammar(rt)
    m = rt.mask_token_id
    res = rt.generate(
        chat_ids,
        GenerationConfig(
            max_new_tokens=96, block_size=16, grammar=g, grammar_triggers=trig, first_block=[m] * 5 + trig + [m] * 10
        ),
    )
    assert res.tokens[5] == trig[0] and trig[0] not in res.tokens[:5]
    after = rt.detokenize([t for t in res.tokens[6:] if t not in rt.eog])
    assert after.startswith("\n") and after.endswith("}\n</tool_call>")
    call = json.loads(after[1 : -len("\n</tool_call>")])
    assert call["name"] == "read_file" and isinstance(call["arguments"]["path"], str)


def test_probs_and_top_tokens(rt, chat_ids):
    res = rt.generate(chat_ids, GenerationConfig(max_new_tokens=16, block_size=16, n_probs=3))
    b = res.blocks[0]
    assert len(b.probs) == 16 and all(0.0 < p <= 1.0 for p in b.probs)
    assert len(b.top) == 16
    for tok, p, top in zip(res.tokens, b.probs, b.top):
        assert [t for t, _ in top][0] == tok  # greedy: the chosen token is the most probable
        assert top[0][1] == pytest.approx(p, rel=1e-5)
        assert top[0][1] >= top[1][1] >= top[2][1] > 0
    # the same tokens as without probabilities (the host path picks what the graph picks)
    assert rt.generate(chat_ids, GenerationConfig(max_new_tokens=16, block_size=16)).tokens == res.tokens


def test_first_block_keeps_fixed_positions(rt):
    prefix = rt.tokenize("def add(a, b):\n    return")
    suffix = rt.tokenize("\n\n\ndef sub(a, b):")
    m = rt.mask_token_id
    block = [m] * 6 + suffix
    res = rt.generate(prefix, GenerationConfig(max_new_tokens=len(block), block_size=16, first_block=block))
    got = res.blocks[0]
    assert got.n_tokens == len(block)
    assert res.tokens[6 : 6 + len(suffix)] == suffix or rt.eos_token_id in res.tokens[:6]
    assert all(p == 1.0 for p in got.probs[6:])  # given, not generated


def test_bad_grammars_are_refused_in_one_line(rt):
    from clover_gguf.runtime.runtime import GrammarError

    with pytest.raises(GrammarError, match="Undefined rule identifier 'foo'"):
        rt.check_grammar("root ::= foo")
    with pytest.raises(GrammarError, match="allows no first token"):
        rt.check_grammar(f"root ::= <[{rt.mask_token_id}]>")  # only the mask token, never a candidate
    with pytest.raises(SchemaError, match="parse error"):
        json_schema_to_grammar('{"type":')


def test_tool_call_grammar_composes_tools_without_name_clashes(rt):
    tools = [
        {
            "type": "function",
            "function": {"name": "a", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}},
        },
        {
            "type": "function",
            "function": {"name": "b", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        },
    ]
    g = tool_call_grammar(tools)
    assert "t0-root" in g and "t1-root" in g and "\nroot ::=" not in "\n" + g.split("\n", 1)[1]
    rt.check_grammar(g)
    assert (
        prefix_rules('root ::= "root" [a-z] <think> x\nx ::= "y"', "p-")
        == 'p-root ::= "root" [a-z] <think> p-x\np-x ::= "y"'
    )


def test_an_untrained_model_still_writes_valid_json(tmp_path):
    """The guarantee is the grammar's, not the model's: random weights of clover-tiny's shapes,
    with its tokenizer, still give JSON that validates, at every schedule."""
    import shutil

    from clover_gguf.config import CloverConfig
    from clover_gguf.convert.converter import convert
    from clover_gguf.runtime.runtime import CloverRuntime
    from clover_gguf.synthetic import write_synthetic

    d = write_synthetic(tmp_path / "random", CloverConfig.load(TINY / "config.json"), seed=3, progress=False)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / f, d / f)
    gguf = tmp_path / "random.gguf"
    convert(d, gguf, recipe="q4_k", progress=False)
    schema = {
        "type": "object",
        "properties": {
            "kind": {"enum": ["bug", "style", "perf"]},
            "line": {"type": "integer", "minimum": 1, "maximum": 999},
            "fixed": {"type": "boolean"},
            "note": {"type": "string", "maxLength": 8},
        },
        "required": ["kind", "line", "fixed", "note"],
        "additionalProperties": False,
    }
    g = json_schema_to_grammar(schema)
    rt = CloverRuntime(gguf, n_threads=1)
    try:
        ids = rt.tokenize(rt.chat_prompt([{"role": "user", "content": "A finding, as JSON"}], enable_thinking=False))
        for cfg in (dict(), dict(steps=4), dict(temperature=1.0, seed=5)):
            res = rt.generate(ids, GenerationConfig(max_new_tokens=256, block_size=16, grammar=g, **cfg))
            assert len(res.tokens) < 256, cfg
            jsonschema.validate(json.loads(_text(rt, res)), schema)
    finally:
        rt.close()
