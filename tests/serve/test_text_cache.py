"""The server's pure parts: stop strings and held-back text, the thinking split, the snapshot LRU,
the request body reader."""

from __future__ import annotations

import asyncio
import random

import pytest

from clover_gguf.serve.cache import StateCache
from clover_gguf.serve.text import ReasoningSplitter, TextStream, split_reasoning

# a byte-level "vocabulary": token i is PIECES[i]; "é" is split over two tokens
PIECES = [b"def", b" f", b"(x)", b":\n", b"    return", b" x", b"\xc3", b"\xa9", b"<th", b"ink>", b"</think>", b"\n\n"]


def detok(ids):
    return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def stream(blocks, stop=()):
    ts = TextStream(detok, list(stop))
    out = [ts.feed(b, last=(i == len(blocks) - 1)) for i, b in enumerate(blocks)]
    return out, ts


def test_stream_concatenation_equals_whole_text():
    ids = [0, 1, 2, 3, 4, 5, 6, 7, 5]
    for cuts in ([3, 6], [1, 2, 7], [6, 7], []):
        blocks = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]
        out, _ = stream(blocks)
        assert "".join(out) == detok(ids)


def test_incomplete_utf8_is_held_back():
    out, _ = stream([[0, 6], [7, 5]])
    assert out[0] == "def" and "\ufffd" not in "".join(out)
    assert "".join(out) == "defé x"


def test_stop_string_across_blocks():
    # " return" starts in block 2, completes in block 3: nothing of it is ever sent
    out, ts = stream([[0, 1, 2, 3], [4], [5]], stop=["return x"])
    assert ts.stopped and "".join(out) == "def f(x):\n    "
    assert all("ret" not in o for o in out)


def test_partial_stop_released_at_the_end():
    out, ts = stream([[0, 1], [4]], stop=[" returned"])
    assert not ts.stopped and "".join(out) == "def f    return"


def test_stop_inside_one_block_and_earliest_wins():
    out, ts = stream([[0, 1, 2, 3, 4, 5]], stop=["x", "f("])
    assert ts.stopped and out == ["def "]


def test_n_tokens_counts_what_is_returned():
    # no stop string: every token fed; a stop string: the fewest tokens whose text reaches the cut
    _, ts = stream([[0, 1, 2, 3], [4, 5]])
    assert ts.n_tokens() == 6
    _, ts = stream([[0, 1, 2, 3, 4, 5]], stop=["(x"])
    assert ts.text == "def f" and ts.n_tokens() == 2
    _, ts = stream([[0, 1, 2, 3, 4, 5]], stop=["x)"])  # the cut falls inside token 2 "(x)"
    assert ts.text == "def f(" and ts.n_tokens() == 3
    _, ts = stream([[0, 1]], stop=["def"])
    assert ts.text == "" and ts.n_tokens() == 0


def test_reasoning_split():
    assert split_reasoning("<think>\nplan\n</think>\n\ncode") == ("plan\n", "code")
    assert split_reasoning("<think>\nstill thinking") == ("still thinking", "")
    assert split_reasoning("no tags") == (None, "no tags")


def test_reasoning_stream_equals_whole():
    rng = random.Random(0)
    for text in ("<think>\nplan it\n</think>\n\nreturn 1", "\n<think>a</think>b", "plain", "\n", "<think>x"):
        for _ in range(20):
            cuts = sorted(rng.sample(range(1, len(text)), min(3, len(text) - 1))) if len(text) > 1 else []
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            sp = ReasoningSplitter()
            got = [sp.feed(p, last=i == len(pieces) - 1) for i, p in enumerate(pieces)]
            r, c = split_reasoning(text)
            assert "".join(g[0] for g in got) == (r or "") and "".join(g[1] for g in got) == c, (text, pieces)


def test_think_tags_held_back_in_a_stream():
    # "<th" + "ink>" must not reach the client as content before the tag is complete
    sp = ReasoningSplitter()
    assert sp.feed("<th") == ("", "")
    assert sp.feed("ink>plan</th") == ("plan", "")
    assert sp.feed("ink>\n\nx", last=True) == ("", "x")


def test_cache_keeps_only_full_block_prefixes():
    c = StateCache(4)
    assert not c.store([1, 2, 3], 2, b"x")  # 3 tokens: not whole blocks of 2
    assert not c.store([], 2, b"x")
    assert c.store([1, 2], 2, b"a") and c.store([1, 2, 3, 4], 2, b"b")
    assert c.lookup([1, 2, 3, 4, 5], 2) == (4, b"b")  # the longest prefix
    assert c.lookup([1, 2, 3, 9], 2) == (2, b"a")
    assert c.lookup([1, 2, 3, 4], 4) == (0, None)  # another block size: other boundaries
    assert c.lookup([1], 2) == (0, None)
    assert c.lookup([1, 2, 3, 4], 2) == (4, b"b")  # a prompt equal to the snapshot


def test_cache_lru_eviction():
    c = StateCache(2)
    c.store([1, 1], 2, b"a")
    c.store([2, 2], 2, b"b")
    c.lookup([1, 1, 5], 2)  # touch a
    c.store([3, 3], 2, b"c")  # evicts b
    assert c.lookup([2, 2], 2) == (0, None)
    assert c.lookup([1, 1], 2)[1] == b"a" and c.lookup([3, 3], 2)[1] == b"c"
    assert len(c) == 2 and StateCache(0).store([1, 1], 2, b"x") is False


class _Body:
    """What read_json needs of a starlette Request."""

    def __init__(self, chunks, headers=None):
        self.chunks, self.headers = chunks, headers or {}

    async def stream(self):
        for c in self.chunks:
            yield c


def test_read_json_limits_and_errors():
    from clover_gguf.serve.http import BadRequest, read_json

    ok = asyncio.run(read_json(_Body([b'{"a":', b" 1}"]), limit=16))
    assert ok == {"a": 1}
    for chunks, headers, status, code in (
        ([b"x" * 10, b"x" * 10], {}, 413, None),  # streamed (chunked) past the limit
        ([], {"content-length": "17"}, 413, None),  # declared past the limit
        ([b'{"a": "\xff"}'], {}, 400, "invalid_encoding"),
        ([b'{"a": '], {}, 400, "invalid_json"),
    ):
        with pytest.raises(BadRequest) as ei:
            asyncio.run(read_json(_Body(chunks, headers), limit=16))
        assert (ei.value.status, ei.value.code) == (status, code)
