"""What a request asks of the decoder, whatever its API: `Decoding` holds the values the front
doors read from their own field names (max_tokens, max_output_tokens, stop_sequences, ...), and
`sampling()` turns it into the GenerationConfig of the job, within the server's limits: a reply
has at most the smallest of what the request asks, --n-predict and the room the context leaves
(a larger ask is capped, as llama-server does, not refused)."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from ..reference.generate import GenerationConfig
from . import fields
from .fields import MAX_STOP, MAX_STOP_CHARS
from .http import BadRequest, opt_bool

# the `clover` extension object of a request (any API)
CLOVER_FIELDS = {
    "block_size": "decoding block size B (1 .. the context's n_ubatch); default: the model's",
    "steps": "`steps` schedule: denoising steps per block (>= 1)",
    "threshold": "`threshold` schedule: unmask every position at least this confident, in (0, 1]; default 0.9",
    "cache_prompt": "reuse and keep memory snapshots for this request (default true)",
}
MAX_LOGIT_BIAS = 1024  # entries of one logit_bias (OpenAI's limit is 300)


@dataclass
class Decoding:
    """A request's decoding fields, checked; None is the server's default."""

    max_tokens: int | None = None  # None: the route's default (chat: --n-predict)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # None: off; else the alternatives per token
    block_size: int | None = None
    steps: int | None = None
    threshold: float | None = None
    cache: bool = True
    stream: bool = False
    include_usage: bool = False


@dataclass
class Sampling:
    cfg: GenerationConfig
    stop: list[str]
    cache: bool
    stream: bool
    include_usage: bool
    logprobs: int | None = None


@dataclass
class Limits:
    """The server's limits a request's numbers are checked against."""

    ctx: int  # the context size
    n_ubatch: int  # the largest block
    default_block: int
    n_predict: int  # --n-predict
    n_vocab: int

    def numbers(self, block_size: int | None = None) -> dict:
        d = {"ctx": self.ctx, "n_ubatch": self.n_ubatch}
        if block_size is not None:
            d["block_size"] = block_size
        return d


def parse_stop(v, param: str = "stop") -> list[str]:
    """`stop` (a string or a list of strings), or Anthropic's `stop_sequences` (a list)."""
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if (
        not isinstance(v, list)
        or len(v) > MAX_STOP
        or not all(isinstance(s, str) and len(s) <= MAX_STOP_CHARS for s in v)
    ):
        raise BadRequest(
            f"'{param}' must be a string or a list of at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters",
            param,
        )
    return v


def parse_clover(ext, d: Decoding, lim: Limits) -> None:
    """The `clover` extension object into d (block size, schedule, cache)."""
    if ext is None:
        return
    if not isinstance(ext, dict):
        raise BadRequest("'clover' must be an object with " + ", ".join(CLOVER_FIELDS), "clover")
    for k in ext:
        if k not in CLOVER_FIELDS:  # our own namespace: a typo here is refused, not ignored
            raise BadRequest(f"unknown field 'clover.{k}'; known: {', '.join(CLOVER_FIELDS)}", f"clover.{k}")
    d.block_size = fields.number(ext, "block_size", lim.numbers(), "clover.block_size")
    block = d.block_size or lim.default_block
    d.steps = fields.number(ext, "steps", lim.numbers(block), "clover.steps")
    d.threshold = fields.number(ext, "threshold", lim.numbers(), "clover.threshold")
    if d.steps is not None and d.threshold is not None:
        raise BadRequest("give 'clover.steps' or 'clover.threshold', not both", "clover.steps")
    d.cache = opt_bool(ext, "cache_prompt", "clover.cache_prompt") is not False


def parse_logit_bias(v, n_vocab: int, param: str = "logit_bias") -> dict[int, float] | None:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]}, ids in the vocabulary."""
    if v is None or v == {}:
        return None
    if not isinstance(v, dict) or len(v) > MAX_LOGIT_BIAS:
        raise BadRequest(f"'{param}' must be an object of at most {MAX_LOGIT_BIAS} token ids to biases", param)
    out = {}
    for k, b in v.items():
        p = f"{param}.{k}"
        try:
            t = int(k)
        except ValueError:
            t = -1
        if not (str(t) == k.strip() and 0 <= t < n_vocab):
            raise BadRequest(f"'{param}' key {json.dumps(k)[:40]} is not a token id in [0, {n_vocab})", p)
        out[t] = fields.number({"b": b}, "b", {}, "logit_bias.*") if b is not None else 0.0
    return out or None


def read_common(body: dict, d: Decoding, lim: Limits, names: dict[str, str] | None = None) -> None:
    """The fields most APIs share, under the route's own names (`names` maps ours to theirs:
    {"max_tokens": "max_output_tokens"})."""
    names = names or {}
    nums = lim.numbers()
    for ours in ("max_tokens", "temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty"):
        theirs = names.get(ours, ours)
        if theirs is None:
            continue
        v = fields.number(body, theirs, nums, ours if theirs == ours else theirs)
        if v is not None:
            setattr(d, ours, v)


def sampling(d: Decoding, n_prompt: int, lim: Limits, default_max: int) -> Sampling:
    """The job's GenerationConfig: max_tokens capped to --n-predict and to the context's room."""
    max_tokens = d.max_tokens if d.max_tokens is not None else default_max
    max_tokens = max(0, min(max_tokens, lim.n_predict, lim.ctx - n_prompt))
    temperature = d.temperature if d.temperature is not None else 0.0
    seed = d.seed
    if seed is None:
        seed = secrets.randbits(32) if temperature > 0 else 0
    cfg = GenerationConfig(
        max_new_tokens=max_tokens,
        block_size=d.block_size or lim.default_block,
        steps=d.steps,
        threshold=d.threshold,
        temperature=temperature,
        top_k=d.top_k or 0,
        top_p=d.top_p if d.top_p is not None else 1.0,
        seed=seed,
    )
    cfg.n_probs = d.logprobs or 0
    cfg.presence_penalty = d.presence_penalty or 0.0
    cfg.frequency_penalty = d.frequency_penalty or 0.0
    cfg.logit_bias = d.logit_bias
    return Sampling(cfg, d.stop, d.cache, d.stream, d.include_usage, d.logprobs)
