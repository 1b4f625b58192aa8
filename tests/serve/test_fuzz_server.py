"""The server request fuzzer (tests/fuzz/fuzz_server.py): its bodies encode what a client could not
send (NaN, lone surrogates, deep nesting), and a short campaign against the test server gets only
2xx and 4xx answers. CI runs the longer campaign (scripts/test.sh); docs/serving.md has the long one."""

import json

from conftest import API_KEY
from fuzz import fuzz_server as F


def test_encode_splices_raw_fragments():
    body = {"a": F.Raw("NaN"), "b": ["\ud800", F.deep(3)], "c": {"d": F.Raw("1e999")}}
    assert F.encode(body) == b'{"a": NaN, "b": ["\\ud800", [[[]]]], "c": {"d": 1e999}}'
    assert json.loads(F.encode({"x": 1})) == {"x": 1}


def test_cases_are_reproducible_and_varied():
    cases = [F.make_case(i, 5) for i in range(300)]
    assert [c.body for c in cases[:20]] == [F.make_case(i, 5).body for i in range(20)]
    assert {c.path for c in cases} == {"/v1/completions", "/v1/chat/completions", "/infill", "/tokenize",
                                       "/detokenize", "/apply-template", "/v1/messages",
                                       "/v1/messages/count_tokens", "/v1/responses"}  # fmt: skip
    kinds = {"tools": b'"tools"', "grammar": b'"grammar"', "schema": b'"json_schema"', "nan": b"NaN"}
    for k, marker in kinds.items():
        assert any(marker in c.body for c in cases), k
    assert any(c.abandon for c in cases)


def test_short_campaign_only_2xx_and_4xx(server):
    t = F.Target(server.url, API_KEY, None, None, 0)
    tally = F.campaign(t, 120, seed=11, timeout=60, keep=None)
    assert tally.bad == 0, tally.counts
    assert tally.counts.get("2xx", 0) > 10 and tally.counts.get("4xx", 0) > 10, tally.counts
    assert F.alive(server.port)
