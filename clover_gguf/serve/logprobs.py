"""OpenAI `logprobs` from what the runtime reports per generated token: its probability at the
denoising step that unmasked it (the confidence the schedule used; under the grammar for a
constrained reply) and, with `top_logprobs`, the most probable tokens of that row then
(docs/CONTRACTS.md "Constrained decoding", "Probabilities")."""

from __future__ import annotations

import math

MAX_TOP_CHAT = 20  # OpenAI's limits
MAX_TOP_COMPLETIONS = 5


def _lp(p: float) -> float:
    return math.log(p) if p > 0 else -9999.0  # OpenAI's floor for an impossible token


class Pieces:
    """Token -> (text, bytes), cached."""

    def __init__(self, rt):
        self.rt, self.cache = rt, {}

    def __call__(self, t: int) -> tuple[str, bytes]:
        if t not in self.cache:
            b = self.rt.token_bytes(t)
            self.cache[t] = (b.decode("utf-8", "replace"), b)
        return self.cache[t]


def chat_content(pieces: Pieces, tokens, probs, top, n_top: int) -> list[dict]:
    """choice.logprobs.content of a chat reply (or of one streamed chunk)."""
    out = []
    for t, p, alts in zip(tokens, probs, top):
        text, b = pieces(t)
        e = {"token": text, "logprob": _lp(p), "bytes": list(b), "top_logprobs": []}
        for a, q in alts[:n_top]:
            if a >= 0:
                at, ab = pieces(a)
                e["top_logprobs"].append({"token": at, "logprob": _lp(q), "bytes": list(ab)})
        out.append(e)
    return out


def completion(pieces: Pieces, tokens, probs, top, n_top: int, offset: int = 0) -> dict:
    """choice.logprobs of a legacy completion: tokens, token_logprobs, top_logprobs, text_offset."""
    d = {"tokens": [], "token_logprobs": [], "top_logprobs": [] if n_top else None, "text_offset": []}
    for t, p, alts in zip(tokens, probs, top):
        text, _ = pieces(t)
        d["tokens"].append(text)
        d["token_logprobs"].append(_lp(p))
        d["text_offset"].append(offset)
        offset += len(text)
        if n_top:
            d["top_logprobs"].append({pieces(a)[0]: _lp(q) for a, q in alts[:n_top] if a >= 0})
    return d


def returned(pieces: Pieces, tokens, text: str) -> int:
    """How many leading tokens make up `text` (the reply may have been cut at a stop string):
    those whose text starts before its end."""
    n = pos = 0
    for t in tokens:
        if pos >= len(text):
            break
        pos += len(pieces(t)[0])
        n += 1
    return n
