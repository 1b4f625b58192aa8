"""Text out of generated tokens, one block at a time: stop strings, incomplete UTF-8 and the
thinking split (`<think>`…`</think>` as reasoning_content).

Text that could still turn into a stop string or a think tag, and a trailing incomplete UTF-8
character, are held back until the next block decides them, so that what a stream has sent
is never taken back and equals the non-streamed text.
"""

from __future__ import annotations

from collections.abc import Callable

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def _held_tail(text: str, watch: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a watched string, or
    a run of U+FFFD (bytes of a character the next token may complete)."""
    n = len(text) - len(text.rstrip("\ufffd"))
    for w in watch:
        for k in range(min(len(w) - 1, len(text)), n, -1):
            if text.endswith(w[:k]):
                n = k
                break
    return n


class TextStream:
    """Detokenizes the growing output; `feed(ids)` returns the text that is now final."""

    def __init__(self, detokenize: Callable[[list[int]], str], stop: list[str]):
        self.detokenize = detokenize
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""  # final text so far
        self.stopped = False  # a stop string was found
        self.stop_word: str | None = None  # which one

    def feed(self, ids: list[int], last: bool = False) -> str:
        """Add a block's tokens; returns the new final text. `last`: nothing follows, release all."""
        if self.stopped:
            return ""
        self.ids += ids
        full = self.detokenize(self.ids)
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        found = [(i, s) for s in self.stop if (i := full.find(s, start)) >= 0]
        if found:
            cut, self.stop_word = min(found)
            self.stopped = True
            end = cut
        else:
            end = len(full) if last else len(full) - _held_tail(full, self.stop)
        end = max(end, len(self.text))
        delta = full[len(self.text) : end]
        self.text = full[:end]
        return delta

    def n_tokens(self) -> int:
        """How many of the tokens fed make up the final text: all of them, unless a stop string
        cut it, then the fewest whose text reaches its end (what usage.completion_tokens counts)."""
        if not self.stopped:
            return len(self.ids)
        lo, hi = 0, len(self.ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.detokenize(self.ids[:mid])) >= len(self.text):
                hi = mid
            else:
                lo = mid + 1
        return lo


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, content) of a thinking-mode reply: what follows a leading `<think>` up to
    `</think>` is reasoning (all of it while `</think>` has not come), the rest is content.
    Only leading newlines are stripped, so that the split of a growing text only grows."""
    s = text.lstrip()
    if not s.startswith(THINK_OPEN):
        return None, text
    body = s[len(THINK_OPEN) :]
    if THINK_CLOSE not in body:
        return body.lstrip("\n"), ""
    r, c = body.split(THINK_CLOSE, 1)
    return r.lstrip("\n"), c.lstrip("\n")


class ReasoningSplitter:
    """Deltas of (reasoning, content) as the final text grows; a partial tag waits for the next feed."""

    def __init__(self):
        self.text = ""
        self.r_sent = self.c_sent = 0

    def feed(self, delta: str, last: bool = False) -> tuple[str, str]:
        self.text += delta
        text = self.text if last else self.text[: len(self.text) - _held_tail(self.text, [THINK_OPEN, THINK_CLOSE])]
        if not last and not text.strip():
            return "", ""  # `<think>` may still come
        r, c = split_reasoning(text)
        r = r or ""
        dr, dc = r[self.r_sent :], c[self.c_sent :]
        self.r_sent, self.c_sent = len(r), len(c)
        return dr, dc
