"""The request fields of `clover-gguf serve`: what each does here, the numeric ones' ranges in
one table, and the checks every JSON body goes through before anything else (nesting depth,
lone surrogates).

Every field of every route's table is one of: implemented; accepted only at the value that
asks for what the server does anyway (`n: 1`, `echo: false`, ...), any other value refused;
accepted without effect (metadata and ids that clients send by default); refused (its meaning
would change the answer and the server cannot honour it). A field that no table knows is
accepted and ignored: agents add fields with every release, and one unknown field must not stop
a user's agent; the server names it in its log (once), in the `x-clover-ignored-fields` header
of the answer and in /props. `null` is the field's default, as with OpenAI. docs/serving.md
"Request fields" is this table in words (tests/serve/test_fields.py compares).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import CloverError
from .logprobs import MAX_TOP_CHAT, MAX_TOP_COMPLETIONS

IMPLEMENTED = "implemented"
NEUTRAL = "refused, but for the value that changes nothing"
NO_EFFECT = "accepted, no effect"
REFUSED = "refused"

MAX_JSON_DEPTH = 64  # nesting of objects and arrays in a request body
MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 1024  # characters per stop string (held-back text is checked against each)
INT32_MAX = 2**31 - 1
SEED_MAX = 2**32 - 1  # the runtime's seed is 32 bits


class FieldProblem(CloverError, ValueError):
    """A request field is wrong: `param` names it; `code` is OpenAI's error code, if any."""

    def __init__(self, message: str, param: str | None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class Field:
    status: str
    # NEUTRAL: the values accepted (what the server does anyway), and how to say them
    neutral: Callable[[object], bool] | None = None
    neutral_text: str = ""
    note: str = ""
    # NO_EFFECT: what its value must be even so (bounded: a 15 MB `user` was accepted), and how to say it
    check: Callable[[object], bool] | None = None
    check_text: str = ""


def _string(n: int) -> tuple[Callable[[object], bool], str]:
    return (lambda v: isinstance(v, str) and len(v) <= n), f"a string of at most {n} characters"


def _tags(keys: int = 64, chars: int = 16384) -> tuple[Callable[[object], bool], str]:
    """A small object of scalars; values up to `chars` long (Codex's client_metadata carries its
    turn's metadata as a JSON string of about 1,000 characters, and more with more workspaces)."""

    def ok(v):
        return (
            isinstance(v, dict)
            and len(v) <= keys
            and all(isinstance(k, str) and len(k) <= 512 for k in v)
            and all(isinstance(x, str | int | float | bool) or x is None for x in v.values())
            and all(len(x) <= chars for x in v.values() if isinstance(x, str))
        )

    return ok, f"an object of at most {keys} keys of at most 512 characters, with scalar values of at most {chars}"


def _no_effect(note: str, bound: tuple[Callable[[object], bool], str]) -> Field:
    return Field(NO_EFFECT, note=note, check=bound[0], check_text=bound[1])


def _num_is(x: float) -> Callable[[object], bool]:
    return lambda v: isinstance(v, int | float) and not isinstance(v, bool) and v == x


def _neutral(test, text: str, note: str) -> Field:
    return Field(NEUTRAL, test, text, note)


_I = Field(IMPLEMENTED)
# implemented by the tool-call / constrained-decoding / logprobs work (clover_gguf/serve/tools.py, logprobs.py)
_T = Field(IMPLEMENTED, note="tool calls, constrained decoding and logprobs")

_META = "metadata or an id for the provider's own use; no answer depends on it"

COMMON: dict[str, Field] = {
    "model": Field(IMPLEMENTED, note="any name: the server has one model"),
    "max_tokens": _I,
    "temperature": _I,
    "top_p": _I,
    "top_k": Field(IMPLEMENTED, note="extension (llama-server, vLLM)"),
    "seed": _I,
    "stop": _I,
    "stream": _I,
    "stream_options": _I,
    "clover": Field(IMPLEMENTED, note="extension: Clover's decoding options"),
    "logprobs": _T,
    "n": _neutral(_num_is(1), "1", "one choice per request"),
    "frequency_penalty": Field(IMPLEMENTED, note="llama.cpp's penalties sampler (docs/CONTRACTS.md)"),
    "presence_penalty": Field(IMPLEMENTED, note="llama.cpp's penalties sampler (docs/CONTRACTS.md)"),
    "logit_bias": Field(IMPLEMENTED, note="llama.cpp's logit-bias sampler"),
    "user": _no_effect(
        "an end-user id for the provider's abuse monitoring; LibreChat sends it on every request", _string(1024)
    ),
}

CHAT: dict[str, Field] = COMMON | {
    "messages": _I,
    "max_completion_tokens": _I,
    "top_logprobs": _T,
    "tools": _T,
    "tool_choice": _T,
    "parallel_tool_calls": _T,
    "response_format": _T,
    "grammar": Field(IMPLEMENTED, note="extension (llama-server); tool calls, constrained decoding and logprobs"),
    "chat_template_kwargs": Field(IMPLEMENTED, note="extension (vLLM, llama-server)"),
    "store": _no_effect("this server stores no chat completion", ((lambda v: isinstance(v, bool)), "true or false")),
    "service_tier": _no_effect("the server has one tier", _string(64)),
    "modalities": _neutral(lambda v: v == ["text"], '["text"]', "text only"),
    "metadata": _no_effect(_META, _tags()),
    "reasoning_effort": Field(IMPLEMENTED, note="thinking: none and minimal turn it off, the others on"),
    "verbosity": _no_effect("the model has no verbosity control; agents send it by default", _string(64)),
    "audio": Field(REFUSED, note="text only"),
    "prediction": Field(REFUSED, note="no predicted outputs"),
    "web_search_options": Field(REFUSED, note="no web search"),
    "functions": Field(REFUSED, note="deprecated by OpenAI: use tools"),
    "function_call": Field(REFUSED, note="deprecated by OpenAI: use tool_choice"),
    "prompt_cache_key": _no_effect("the state cache is keyed by the prompt's tokens, which says more", _string(1024)),
    "safety_identifier": _no_effect(_META, _string(1024)),
}

COMPLETIONS: dict[str, Field] = COMMON | {
    "prompt": _I,
    "echo": _neutral(lambda v: v is False, "false", "the prompt is not repeated"),
    "best_of": _neutral(_num_is(1), "1", "one candidate per request"),
    "suffix": Field(REFUSED, note="use POST /infill (input_prefix, input_suffix)"),
    "grammar": Field(REFUSED, note="constrained output is on /v1/chat/completions"),
    "response_format": Field(REFUSED, note="constrained output is on /v1/chat/completions"),
}

# POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens
ANTHROPIC: dict[str, Field] = {
    "model": COMMON["model"],
    "max_tokens": _I,
    "messages": Field(IMPLEMENTED, note="text, tool_use, tool_result and thinking blocks"),
    "system": Field(IMPLEMENTED, note="a string or text blocks"),
    "stop_sequences": _I,
    "stream": _I,
    "temperature": _I,
    "top_p": _I,
    "top_k": _I,
    "tools": Field(IMPLEMENTED, note="custom tools (input_schema); server tools are left out of the prompt"),
    "tool_choice": _T,
    "thinking": Field(IMPLEMENTED, note="enabled or adaptive: Clover's thinking mode; budget_tokens is not enforced"),
    "metadata": _no_effect(_META, _tags()),
    "service_tier": _no_effect("the server has one tier", _string(64)),
    "output_format": Field(IMPLEMENTED, note="json_schema: the text matches the schema (constrained decoding)"),
    "output_config": Field(IMPLEMENTED, note="format as output_format; effort accepted with no effect"),
    "clover": COMMON["clover"],
    "mcp_servers": Field(REFUSED, note="no MCP connector: the server calls no remote tools"),
    "container": Field(REFUSED, note="no code execution container"),
}
ANTHROPIC_COUNT: dict[str, Field] = {
    k: ANTHROPIC[k]
    for k in ("model", "messages", "system", "tools", "tool_choice", "thinking", "output_format", "output_config")
}
# the keys of a message and of a content block (cache_control: there is no cache to steer; state
# reuse is automatic; citations: no documents are cited)
ANTHROPIC_MESSAGE: dict[str, Field] = {"role": _I, "content": _I}
ANTHROPIC_BLOCK: dict[str, Field] = {
    k: _I for k in ("type", "text", "id", "name", "input", "tool_use_id", "content", "is_error", "thinking")
} | {
    "signature": _no_effect("a thinking block's signature is not checked", _string(1 << 20)),
    "data": _no_effect("a redacted thinking block is left out", _string(1 << 20)),
    "cache_control": _no_effect("state reuse is automatic", _tags(8, 512)),
    "citations": Field(NO_EFFECT, note="no document is cited"),
}

# POST /v1/responses (OpenAI's Responses API)
RESPONSES: dict[str, Field] = {
    "model": COMMON["model"],
    "input": Field(IMPLEMENTED, note="a string, or message, function_call, function_call_output and reasoning items"),
    "instructions": Field(IMPLEMENTED, note="the system message"),
    "tools": Field(IMPLEMENTED, note="function tools; other types are left out of the prompt"),
    "tool_choice": _T,
    "parallel_tool_calls": _T,
    "text": Field(IMPLEMENTED, note="format: text, json_object, json_schema (constrained decoding)"),
    "reasoning": Field(IMPLEMENTED, note="effort: none and minimal turn thinking off, the others on"),
    "max_output_tokens": _I,
    "temperature": _I,
    "top_p": _I,
    "top_k": COMMON["top_k"],
    "seed": _I,
    "stream": _I,
    "stream_options": _I,
    "previous_response_id": Field(IMPLEMENTED, note="from the server's memory of recent responses"),
    "store": Field(IMPLEMENTED, note="false: the response is not kept for previous_response_id"),
    "include": Field(IMPLEMENTED, note="reasoning.encrypted_content: the reasoning, encoded (not encrypted)"),
    "metadata": _no_effect(_META, _tags()),
    "prompt_cache_key": _no_effect("the state cache is keyed by the prompt's tokens, which says more", _string(1024)),
    "client_metadata": _no_effect(_META, _tags()),
    "safety_identifier": _no_effect(_META, _string(1024)),
    "user": COMMON["user"],
    "service_tier": _no_effect("the server has one tier", _string(64)),
    "truncation": _neutral(
        lambda v: v in ("disabled", "auto"), '"disabled" or "auto"', "a prompt that does not fit is refused"
    ),
    "clover": COMMON["clover"],
    "background": _neutral(lambda v: v is False, "false", "responses are not run in the background"),
    "conversation": Field(REFUSED, note="no conversations are stored: use previous_response_id or send the input"),
    "prompt": Field(REFUSED, note="no stored prompt templates"),
    "max_tool_calls": Field(REFUSED, note="the number of calls is not limited across a response"),
    "top_logprobs": Field(REFUSED, note="logprobs are on /v1/chat/completions"),
}

# llama-server's /infill (its fill-in-the-middle fields; llama.vscode's extras refused by name)
INFILL: dict[str, Field] = {
    k: COMMON[k] for k in ("model", "temperature", "top_p", "top_k", "seed", "stop", "clover", "user")
} | {
    "input_prefix": _I,
    "input_suffix": _I,
    "prompt": Field(IMPLEMENTED, note="appended to input_prefix"),
    "n_predict": _I,
    "max_tokens": Field(IMPLEMENTED, note="n_predict's other name"),
    "cache_prompt": Field(IMPLEMENTED, note="llama-server's name for clover.cache_prompt"),
    "input_extra": _neutral(lambda v: v == [], "[]", "other files' context: put it in input_prefix"),
    "stream": _neutral(lambda v: v is False, "false", "the middle is one block, decoded at once"),
    "n_indent": Field(REFUSED, note="no indentation limit"),
    "t_max_prompt_ms": Field(REFUSED, note="no time limits"),
    "t_max_predict_ms": Field(REFUSED, note="no time limits"),
    "samplers": Field(REFUSED, note="the sampler is fixed (temperature, top-k, top-p)"),
    "response_fields": Field(REFUSED),
}

# llama-server's /tokenize and /detokenize
TOKENIZE: dict[str, Field] = {
    "model": COMMON["model"],
    "content": _I,
    "add_special": _I,
    "parse_special": _I,
    "with_pieces": _I,
}
DETOKENIZE: dict[str, Field] = {"model": COMMON["model"], "tokens": _I}

# stream_options' own fields
STREAM_OPTIONS: dict[str, Field] = {
    "include_usage": _I,
    "include_obfuscation": _neutral(lambda v: v is False, "false", "chunks are not padded"),
}

# the keys of one chat message (OpenAI refuses others too); `name` is accepted because agent
# frameworks (AutoGen) send it on every message; the rest are what the openai client sends back
# when a reply's message object is appended to the history
MESSAGE: dict[str, Field] = {
    "role": _I,
    "content": _I,
    "tool_calls": _T,
    "tool_call_id": _T,
    "reasoning_content": Field(IMPLEMENTED, note="a thinking reply's reasoning, rendered as the template does"),
    "name": _no_effect("Clover's template has no place for it; AutoGen sends it on every message", _string(256)),
    "refusal": _neutral(lambda v: v is None, "null", "the openai client sends it back with a reply"),
    "annotations": _neutral(lambda v: v == [], "[]", "the openai client sends it back with a reply"),
    "audio": _neutral(lambda v: v is None, "null", "the openai client sends it back with a reply"),
    "function_call": _neutral(lambda v: v is None, "null", "the openai client sends it back with a reply"),
}


def check_fields(body: dict, table: dict[str, Field], prefix: str = "") -> list[str]:
    """Refuse a refused field, or a NEUTRAL one at another value (null is absent). Returns the
    fields no table knows (`prefix` + name), which are ignored."""
    unknown = []
    for k, v in body.items():
        p = f"{prefix}{k}"
        f = table.get(k)
        if f is None:
            unknown.append(p)
            continue
        if v is None or f.status == IMPLEMENTED:
            continue
        if f.status == NO_EFFECT:
            if f.check is not None and not f.check(v):
                raise FieldProblem(f"'{p}' must be {f.check_text}; got {_short(v)}", p, "invalid_value")
            continue
        if f.status == NEUTRAL and f.neutral(v):
            continue
        why = f": {f.note}" if f.note else ""
        if f.status == NEUTRAL:
            msg = f"'{p}' must be {f.neutral_text} (or absent) with this server{why}; got {_short(v)}"
        else:
            msg = f"'{p}' is not supported by this server{why}"
        raise FieldProblem(msg, p, "unsupported_parameter")
    return unknown


def _short(v) -> str:
    s = json.dumps(v)
    return s if len(s) <= 60 else s[:57] + "..."


# ----------------------------------------------------------------------------- numbers


@dataclass(frozen=True)
class Num:
    """A numeric field's range; a bound given as a string is a limit of the server or request
    (ctx: the context size, n_ubatch, block_size: the request's block size)."""

    integer: bool
    lo: float | str
    hi: float | str
    lo_open: bool = False
    why: str = ""  # what the upper bound is, for the message


NUMERIC: dict[str, Num] = {
    # a reply's limit: larger asks are capped to --n-predict and the context (finish_reason length)
    "max_tokens": Num(True, 0, math.inf),
    "max_completion_tokens": Num(True, 0, math.inf),
    "max_output_tokens": Num(True, 1, math.inf),  # responses
    "presence_penalty": Num(False, -2, 2),
    "frequency_penalty": Num(False, -2, 2),
    "logit_bias.*": Num(False, -100, 100),
    "n_predict": Num(True, 1, "n_ubatch", why="one block"),  # /infill
    "temperature": Num(False, 0, 2),
    "top_p": Num(False, 0, 1, lo_open=True),
    "top_k": Num(True, 0, INT32_MAX),
    "seed": Num(True, 0, SEED_MAX, why="the runtime's seed is 32 bits"),
    "top_logprobs": Num(True, 0, MAX_TOP_CHAT),  # chat
    "logprobs": Num(True, 0, MAX_TOP_COMPLETIONS),  # completions
    "clover.block_size": Num(True, 1, "n_ubatch", why="the context's n_ubatch"),
    "clover.steps": Num(True, 1, "block_size", why="the block size"),
    "clover.threshold": Num(False, 0, 1, lo_open=True),
}


def _bound(b, limits: dict) -> float:
    return limits[b] if isinstance(b, str) else b


def describe(param: str, limits: dict) -> str:
    n = NUMERIC[param]
    lo, hi = _bound(n.lo, limits), _bound(n.hi, limits)
    fmt = (lambda x: str(int(x))) if n.integer else (lambda x: f"{x:g}")
    what = "an integer" if n.integer else "a number"
    why = f" ({n.why})" if n.why else ""
    if math.isinf(hi):
        return f"{what} >= {fmt(lo)}{why}"
    return f"{what} in {'(' if n.lo_open else '['}{fmt(lo)}, {fmt(hi)}]{why}"


def number(d: dict, key: str, limits: dict, param: str | None = None):
    """d[key] checked against NUMERIC[param or key]: None when absent, an int or a float."""
    v = d.get(key)
    if v is None:
        return None
    p = param or key
    n = NUMERIC[p]
    ok = isinstance(v, int | float) and not isinstance(v, bool) and (not n.integer or isinstance(v, int))
    if ok:
        lo, hi = _bound(n.lo, limits), _bound(n.hi, limits)
        # an int is compared as it is (10**400 has no float); a float must be finite
        ok = (isinstance(v, int) or math.isfinite(v)) and (v > lo if n.lo_open else v >= lo) and v <= hi
    if not ok:
        raise FieldProblem(f"'{p}' must be {describe(p, limits)}, got {_short(v)}", p, "invalid_value")
    return v if n.integer else float(v)


# ----------------------------------------------------------------------------- the whole body


def check_json(body, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Refuse a body nested deeper than max_depth, or holding a string (or key) that is not
    valid Unicode (a lone surrogate from a \\ud800 escape), naming where."""
    stack: list[tuple[object, int, tuple]] = [(body, 1, ())]
    while stack:
        v, depth, path = stack.pop()
        if depth > max_depth:  # named by its top-level field (the full path is as long as the nesting)
            p = _path(path[:1])
            raise FieldProblem(f"'{p}' is nested deeper than {max_depth} levels", p, "invalid_json")
        items = v.items() if isinstance(v, dict) else enumerate(v)
        for k, x in items:
            if isinstance(k, str):
                _unicode(k, path + (k,))
            if isinstance(x, str):
                _unicode(x, path + (k,))
            elif isinstance(x, dict | list):
                stack.append((x, depth + 1, path + (k,)))


def _unicode(s: str, path: tuple) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        p = _path(path)
        raise FieldProblem(
            f"'{p}' is not valid Unicode: a lone surrogate (\\u{ord(s[e.start]):04x}) at character {e.start}",
            p,
            "invalid_encoding",
        ) from None


def _path(path: tuple) -> str:
    out = ""
    for k in path:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out


def check_model(body: dict) -> None:
    """Any model name: the server has one model (as llama-server); replies name its id."""
    m = body.get("model")
    if m is not None and not isinstance(m, str):
        raise FieldProblem(f"'model' must be a string, got {_short(m)}", "model")
