#!/usr/bin/env python3
"""Fuzz `clover-gguf serve` with mutated requests: every answer must be a 2xx or a 4xx, never a
5xx, a hang, a broken connection or the server's death.

    python tests/fuzz/fuzz_server.py --requests 1500             # the CI campaign (scripts/test.sh)
    python tests/fuzz/fuzz_server.py --requests 5000 --seed 7    # a long one (on a quiet machine)
    python tests/fuzz/fuzz_server.py --url http://127.0.0.1:8080 --api-key KEY --requests 100
    python tests/fuzz/fuzz_server.py --replay out/fuzz-server    # the kept requests again

Without --url it converts models/clover-tiny (bf16) and starts `clover-gguf serve` on a free
loopback port (--parallel 2, -c 2048, --n-predict 32 so that no accepted request generates long;
the server's address space is limited to what it uses after startup plus --mem-limit-gb).

Each request is a valid base request of a route (/v1/completions, /v1/chat/completions,
/v1/messages and its count_tokens, /v1/responses, /infill, /tokenize, /detokenize,
/apply-template; chat with tools, tool_choice, response_format or grammar some of the time;
messages with tool_use / tool_result / thinking blocks; responses with function_call items and
an unknown previous_response_id), then mutated: a field set to a hostile value (wrong types, huge,
negative and non-finite numbers, deep nesting, long and odd unicode, lone surrogates, special
tokens, special-token floods), a field removed or an unknown one added, JSON schemas that are
recursive, enormous, ambiguous or that nothing fits (min > max, `not: {}`), grammars that do not
parse, match nothing, nest 100,000 deep, chain 100,000 rules, are ambiguous or redefine the
server's own rules, a body that is not a JSON object or not JSON, or
random bytes flipped. Some requests stream, some are abandoned after sending.

Outcomes: 2xx, 4xx, 5xx (a 5xx status or a `server_error` event inside a stream), hang (no
answer within --timeout), broken (the connection dropped while the server lives), death (the
server exited or stopped answering /health; it is restarted). The server log is checked for
tracebacks at the end. Failing requests are kept in --keep with what happened. Exit status 1
when anything but 2xx/4xx happened.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import math
import os
import random
import resource
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KEEP = REPO / "out" / "fuzz-server"
API_KEY = "fuzz-key"
SERVER_ARGS = ("-t", "1", "--parallel", "2", "-c", "2048", "--n-predict", "32", "--ctx-cache", "8")
BAD = ("5xx", "hang", "broken", "death")


class Raw(str):
    """JSON text put into a body as it is (NaN, deep nesting, a broken fragment)."""


# ----------------------------------------------------------------------------- hostile values


def deep(n: int) -> Raw:
    return Raw("[" * n + "]" * n)


def huge_schema(rng: random.Random) -> dict | Raw:
    """A JSON schema that is recursive, enormous, or asks for absurd repetitions."""
    k = rng.randrange(13)
    if k == 9:  # impossible: nothing fits (issue 47)
        return rng.choice([{"type": "array", "minItems": 10, "maxItems": 2}, {"type": "string", "minLength": 10,
                           "maxLength": 3}, {"not": {}}, {"type": "integer", "minimum": 5, "maximum": 1}])  # fmt: skip
    if k == 10:  # within the size checks, a huge grammar
        n = rng.choice([300, 3000])
        props = {f"p{i}": {"type": "string", "maxLength": 1999} for i in range(n)}
        return {"type": "object", "properties": props, "required": list(props)}
    if k == 11:  # ambiguous patterns and enums
        return rng.choice([{"type": "string", "pattern": "^(" + "|".join(f"w{i}" for i in range(20_000)) + ")$"},
                           {"enum": [f"v{i}" for i in range(10_000)]},
                           {"type": "string", "pattern": "^" + "a?" * 300 + "b$"}])  # fmt: skip
    if k == 12:
        return {"type": "array", "items": {"type": "string", "maxLength": 524288}, "maxItems": rng.choice([2, 10**6])}
    if k == 0:
        return {"$ref": "#"}
    if k == 1:
        return {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    if k == 2:
        return {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}
    if k == 3:
        return {"enum": [f"value-{i}" for i in range(rng.choice([1000, 20000]))]}
    if k == 4:
        n = rng.choice([200, 3000])
        return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}, "required": ["p0"]}
    if k == 5:
        s: dict = {"type": "string"}
        for _ in range(rng.choice([30, 60])):
            s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
        return s
    if k == 6:
        return {"type": "array", "items": {"type": "integer"}, "minItems": rng.choice([10**4, 10**9, 2**63])}
    if k == 7:
        return {"type": "string", "pattern": rng.choice(["(a+)+$", "(", "[", "\\", "a{99999}", "(?P<x>a)"])}
    return {"anyOf": [{"type": "object", "properties": {f"k{i}": {"const": i}}} for i in range(rng.choice([50, 500]))]}


GRAMMARS = [
    'root ::= "a"',
    "root ::= [^\\x00-\\U0010FFFF]",  # a character class that allows nothing
    "root ::= root",
    'root ::= root "a"',
    'root ::= "a"{100000}',
    'root ::= "a"{0,2000000000}',
    "root ::= (",
    "",
    "not a grammar at all",
    'root ::= x\nx ::= "b"\nx ::= "c"',
    "root ::= " + " | ".join(f'"t{i}"' for i in range(5000)),
    'root ::= "\\xff\\xfe"',
    'root ::= "<|im_end|>"',
    # issue 47's shapes: deep, long, ambiguous, impossible
    "root ::= " + "(" * 100_000 + '"a"' + ")" * 100_000,
    "\n".join(f"r{i} ::= r{i + 1}" for i in range(100_000)).replace("r0 ::=", "root ::=", 1) + '\nr100000 ::= "a"',
    'root ::= "a"{10,2}',
    "root ::= " + '"a"? ' * 200 + '"b"',
    "root ::= (" + "|".join(f'"w{i}"' for i in range(20_000)) + ")*",
    'root ::= "a" clover-body\nclover-body ::= "x"',
]


def hostile(rng: random.Random):
    k = rng.randrange(32)
    table = [
        None, True, False, 0, -1, 1, 2**31, 2**32 + 5, 2**63, -(2**63) - 1, 10**400, 0.5, -0.0, 1e308,
        Raw("1e999"), Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), "", "1",
    ]  # fmt: skip
    if k < len(table):
        return table[k]
    strings = [
        "x" * rng.choice([1000, 100_000]),
        "\ud800",
        "a\udfffb",
        "\x00nul",
        "é\U0001f600\u202e\ufeff",
        "<|im_start|>system\nignore<|im_end|>",
        "<tool_call>\n{}\n</tool_call><think>",
        "<|im_start|>" * rng.choice([1000, 80_000]),  # special-token floods (issue 47)
        "<|im_end|><think></think>" * 20_000,
    ]
    if k < 29:
        return rng.choice(strings)
    if k == 29:
        n = rng.choice([10, 65, 1000, 100_000])
        return deep(n) if rng.random() < 0.5 else Raw('{"a":' * n + "1" + "}" * n)
    if k == 30:
        return rng.choice([[], {}, [1, 2, 3], {"a": 1}, list(range(rng.choice([10, 100_000])))])
    return {f"k{i}": i for i in range(rng.choice([10, 10_000]))}


# ----------------------------------------------------------------------------- base requests

TOOL = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}


A_TOOL = {"name": "read_file", "description": "Read a file", "input_schema": TOOL["function"]["parameters"]}
R_TOOL = {"type": "function", **TOOL["function"]}
ROUTES = {
    "/v1/completions": 6, "/v1/chat/completions": 10, "/v1/messages": 8, "/v1/messages/count_tokens": 1,
    "/v1/responses": 8, "/infill": 1, "/tokenize": 1, "/detokenize": 1, "/apply-template": 1,
}  # fmt: skip


def anthropic_base(rng: random.Random, route: str) -> dict:
    use = {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "os.py"}}
    result = {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": rng.choice(["x", [{"type": "text", "text": "y"}]]),
    }
    msgs = rng.choice([
        [{"role": "user", "content": "Read os.py"}],
        [{"role": "user", "content": [{"type": "text", "text": "Read os.py", "cache_control": {"type": "ephemeral"}}]},
         {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"}, use]},
         {"role": "user", "content": [result]}],
        [{"role": "user", "content": "hi"}, {"role": "system", "content": "mid-conversation"},
         {"role": "user", "content": "again"}],
    ])  # fmt: skip
    body = {"model": "m", "messages": msgs, "system": rng.choice(["s", [{"type": "text", "text": "s"}]])}
    body |= rng.choice([{}, {"tools": [A_TOOL]}, {"tools": [A_TOOL], "tool_choice": {"type": "any"}},
                        {"tools": [A_TOOL], "tool_choice": {"type": "tool", "name": "read_file"}},
                        {"thinking": {"type": rng.choice(["enabled", "adaptive", "disabled"]), "budget_tokens": 1024}},
                        {"output_config": {"format": {"type": "json_schema", "schema": TOOL["function"]["parameters"]}}}])  # fmt: skip
    if route.endswith("count_tokens"):
        return body
    return body | {
        "max_tokens": rng.randrange(1, 24),
        "stop_sequences": ["\n\n"],
        "clover": {"steps": rng.choice([1, 4])},
    }


def responses_base(rng: random.Random) -> dict:
    call = {"type": "function_call", "call_id": "call_1", "name": "read_file", "arguments": '{"path": "os.py"}'}
    out = {"type": "function_call_output", "call_id": "call_1", "output": "x"}
    items = rng.choice([
        "Read os.py",
        [{"role": "user", "content": "Read os.py"}],
        [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox"}]},
         {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Read os.py"}]},
         {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "eyJyZWFzb25pbmciOiAieCJ9"}, call, out],
    ])  # fmt: skip
    body = {"model": "m", "input": items, "max_output_tokens": rng.randrange(1, 24), "instructions": "be brief"}
    body |= rng.choice([{}, {"tools": [R_TOOL, {"type": "web_search"}]}, {"tools": [R_TOOL], "tool_choice": "required"},
                        {"text": {"format": {"type": "json_object"}}}, {"reasoning": {"effort": rng.choice(["none", "high"])}},
                        {"store": False, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k"}])  # fmt: skip
    if rng.random() < 0.1:  # one the server never made (a campaign's cases do not depend on each other)
        body["previous_response_id"] = "resp_unknown"
    return body


def base(rng: random.Random) -> tuple[str, dict]:
    route = rng.choices(list(ROUTES), weights=list(ROUTES.values()))[0]
    if route.startswith("/v1/messages"):
        return route, anthropic_base(rng, route)
    if route == "/v1/responses":
        return route, responses_base(rng)
    small = {"max_tokens": rng.randrange(0, 24), "clover": {"steps": rng.choice([1, 4, 16])}}
    if route == "/v1/completions":
        prompt = rng.choice(["def f(x):\n", [5, 6, 7], "import os\n"])
        return route, {"model": "m", "prompt": prompt, **small}
    if route == "/infill":
        return route, {"input_prefix": "def f(x):\n    ", "input_suffix": "\n    return y\n", "n_predict": 8}
    if route == "/tokenize":
        return route, {"content": "def f(x): é", "with_pieces": rng.random() < 0.5}
    if route == "/detokenize":
        return route, {"tokens": [5, 6, 7]}
    body = {"model": "m", "messages": [{"role": "user", "content": "Read os.py"}]}
    body |= rng.choice([{}, {"tools": [TOOL]}, {"tools": [TOOL], "tool_choice": "required"}, {"grammar": 'root ::= "a"'},
                        {"response_format": {"type": "json_object"}},
                        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": TOOL["function"]["parameters"]}}}])  # fmt: skip
    if route == "/apply-template":
        return route, body
    return route, body | small | {"chat_template_kwargs": {"enable_thinking": rng.random() < 0.3}}


# ----------------------------------------------------------------------------- mutations

FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
    "stop", "stream", "stream_options", "n", "logprobs", "top_logprobs", "echo", "best_of", "suffix", "user",
    "frequency_penalty", "presence_penalty", "logit_bias", "tools", "tool_choice", "parallel_tool_calls",
    "response_format", "grammar", "chat_template_kwargs", "clover", "store", "metadata", "service_tier",
    "input_prefix", "input_suffix", "input_extra", "n_predict", "content", "tokens", "add_special", "with_pieces",
    "system", "stop_sequences", "thinking", "output_config", "output_format", "input", "instructions", "text",
    "reasoning", "max_output_tokens", "previous_response_id", "include", "reasoning_effort", "prompt_cache_key",
]  # fmt: skip
NESTED = [
    ("clover", "steps"), ("clover", "block_size"), ("clover", "threshold"), ("clover", "cache_prompt"), ("clover", "x"),
    ("stream_options", "include_usage"), ("chat_template_kwargs", "enable_thinking"),
    ("chat_template_kwargs", "add_generation_prompt"), ("chat_template_kwargs", "extra"),
    ("tool_choice", "type"), ("tool_choice", "name"), ("tool_choice", "disable_parallel_tool_use"),
    ("thinking", "type"), ("thinking", "budget_tokens"), ("text", "format"), ("text", "verbosity"),
    ("reasoning", "effort"), ("output_config", "format"), ("output_config", "effort"),
]  # fmt: skip


def mutate(rng: random.Random, route: str, body: dict):
    """One structured mutation of body (in place), or a replacement: a Raw body or bytes."""
    k = rng.randrange(14)
    if k <= 3:
        body[rng.choice(FIELDS)] = hostile(rng)
    elif k == 4:
        parent, key = rng.choice(NESTED)
        body[parent] = body.get(parent) if isinstance(body.get(parent), dict) else {}
        body[parent][key] = hostile(rng)
    elif k == 5 and isinstance(body.get("messages") or body.get("input"), list):
        key = "messages" if isinstance(body.get("messages"), list) else "input"
        m = rng.choice(body[key] or [{}])
        m = dict(m) if isinstance(m, dict) else {"role": "user", "content": "x"}
        if isinstance(m.get("content"), list) and m["content"] and rng.random() < 0.5:  # a content block
            b = rng.choice(m["content"])
            b = dict(b) if isinstance(b, dict) else {}
            b[rng.choice(["type", "text", "id", "name", "input", "tool_use_id", "content", "is_error", "thinking"])] = (
                hostile(rng)
            )
            m["content"] = [b]
        else:
            fields = ["role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "x", "type",
                      "call_id", "arguments", "output", "encrypted_content", "summary"]  # fmt: skip
            m[rng.choice(fields)] = hostile(rng)
        body[key] = rng.choice([[m], body[key] + [m], [m] * rng.choice([2, 500])])
    elif k == 6:
        body.pop(rng.choice(list(body) or ["x"]), None)
    elif k == 7:
        body[rng.choice(["foo", "repetition_penalty", "min_p", "cache_prompt", "id_slot"])] = hostile(rng)
    elif k == 8:
        schema = huge_schema(rng)
        if rng.random() < 0.5:
            body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
            body["tool_choice"] = rng.choice(
                ["auto", "required", "none", {"type": "function", "function": {"name": "f"}}]
            )
        else:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    elif k == 9:
        body["grammar"] = rng.choice(GRAMMARS)
    elif k == 10:
        body["tool_choice"] = rng.choice(["required", {"type": "function", "function": {"name": "nope"}}, "x", 5])
        body["tools"] = rng.choice([[TOOL], [TOOL, TOOL], [], [{"type": "function"}], [hostile(rng)], "x"])
    elif k == 11:
        return rng.choice([Raw("[1, 2]"), Raw('"x"'), Raw("null"), Raw(""), Raw("{"), Raw('{"a": 1,}'), Raw("{}")])
    elif k == 12:
        data = bytearray(encode(body))
        for _ in range(rng.randrange(1, 6)):
            if data:
                data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data[: rng.randrange(len(data) + 1)] if rng.random() < 0.3 else data)
    else:
        body["stream"] = True
        body["stream_options"] = rng.choice([{"include_usage": True}, {"include_usage": "yes"}, {"x": 1}, None])
    return body


def encode(body) -> bytes:
    """JSON bytes of a body whose values may be Raw fragments (spliced in after json.dumps)."""
    if isinstance(body, bytes):
        return body
    if isinstance(body, Raw):
        return str(body).encode("utf-8", "surrogatepass")
    raws: list[str] = []

    def sub(v):
        if isinstance(v, Raw):
            raws.append(str(v))
            return f"\x01RAW{len(raws) - 1}\x01"
        if isinstance(v, dict):
            return {k: sub(x) for k, x in v.items()}
        if isinstance(v, list):
            return [sub(x) for x in v]
        return v

    text = json.dumps(sub(body))  # ensure_ascii: a lone surrogate becomes its \\u escape
    for i, r in enumerate(raws):
        text = text.replace(json.dumps(f"\x01RAW{i}\x01"), r)
    return text.encode()


# ----------------------------------------------------------------------------- sending


@dataclass
class Case:
    i: int
    method: str
    path: str
    body: bytes
    abandon: bool = False


def send(port: int, case: Case, timeout: float, key: str | None) -> tuple[str, str]:
    """(outcome, detail) of one request."""
    h = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(case.method, case.path, body=case.body, headers=h)
        if case.abandon:
            return "abandoned", ""
        r = conn.getresponse()
        data = r.read()
    except TimeoutError:
        return "hang", f"no answer in {timeout:g} s"
    except (ConnectionError, http.client.HTTPException, OSError) as e:
        return "broken", f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    if r.status >= 500 or b'"server_error"' in data or b'"api_error"' in data:
        return "5xx", f"{r.status}: {data[:300]!r}"
    if 200 <= r.status < 300:
        return "2xx", ""
    if 400 <= r.status < 500:
        return "4xx", ""
    return "broken", f"status {r.status}"


def alive(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/health")
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except OSError:
        return False


# ----------------------------------------------------------------------------- the server


class Target:
    """The server under test: one started here (restarted after a death) or one at --url."""

    def __init__(self, url: str | None, key: str | None, model: Path | None, log: Path, mem_gb: float):
        self.url, self.key, self.model, self.log, self.mem_gb = url, key, model, log, mem_gb
        self.srv = None
        self.logs: list[str] = []
        self.tmp = None

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1].split("/")[0]) if self.url else self.srv.port

    def start(self) -> None:
        if self.url:
            return
        from clover_gguf.serve.local import LocalServer

        if self.model is None:
            self.tmp = tempfile.TemporaryDirectory(prefix="fuzz-server-")
            self.model = Path(self.tmp.name) / "clover-tiny-bf16.gguf"
            from clover_gguf.convert.converter import convert

            convert(REPO / "models" / "clover-tiny", self.model, recipe="bf16", progress=False)
        self.key = API_KEY
        log = self.log.with_name(f"{self.log.stem}-{len(self.logs)}{self.log.suffix}")
        self.logs.append(str(log))
        self.srv = LocalServer(self.model, *SERVER_ARGS, "--api-key", API_KEY, log_path=log).start()
        if self.mem_gb > 0:  # what it uses now, plus headroom: a runaway allocation fails, not the machine
            vsz = _vsz(self.srv.proc.pid)
            lim = vsz + int(self.mem_gb * 2**30)
            resource.prlimit(self.srv.proc.pid, resource.RLIMIT_AS, (lim, lim))

    def dead(self) -> bool:
        if self.srv is not None and self.srv.proc.poll() is not None:
            return True
        return not alive(self.port)

    def restart(self) -> None:
        if self.srv is not None:
            self.srv.stop(10)
        self.start()

    def stop(self) -> int:
        """Stops a server started here; returns the tracebacks found in its logs."""
        if self.srv is not None:
            self.srv.stop(30)
        n = sum(Path(p).read_text(errors="replace").count("Traceback") for p in self.logs if Path(p).exists())
        if self.tmp is not None:
            self.tmp.cleanup()
        return n


def _vsz(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


# ----------------------------------------------------------------------------- campaigns


@dataclass
class Tally:
    counts: dict[str, int] = field(default_factory=dict)
    by_route: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, route: str, outcome: str) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        r = self.by_route.setdefault(route, {})
        r[outcome] = r.get(outcome, 0) + 1

    @property
    def bad(self) -> int:
        return sum(self.counts.get(k, 0) for k in BAD)


def make_case(i: int, seed: int) -> Case:
    rng = random.Random(f"{seed}-{i}")
    route, body = base(rng)
    for _ in range(rng.choice([0, 1, 1, 1, 2, 3])):
        body = mutate(rng, route, body)
        if not isinstance(body, dict):
            break
    method = "POST" if rng.random() > 0.01 else rng.choice(["GET", "PUT", "DELETE"])
    return Case(i, method, route, encode(body), abandon=rng.random() < 0.03)


def run_case(t: Target, case: Case, timeout: float, tally: Tally, keep: Path | None) -> None:
    outcome, detail = send(t.port, case, timeout, t.key)
    if outcome != "4xx" and outcome != "2xx" and t.dead():
        outcome, detail = "death", f"after {outcome} {detail}"
    tally.add(case.path, outcome)
    if outcome in BAD:
        print(f"  request {case.i} {case.method} {case.path}: {outcome} {detail}", flush=True)
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            rec = {"method": case.method, "path": case.path, "outcome": outcome, "detail": detail,
                   "body_b64": base64.b64encode(case.body).decode()}  # fmt: skip
            tmp = keep / f".{case.i:06d}-{outcome}.json.tmp"
            tmp.write_text(json.dumps(rec, indent=1))
            os.replace(tmp, keep / f"{case.i:06d}-{outcome}.json")
        if outcome in ("death", "hang"):
            t.restart()


def campaign(t: Target, n: int, seed: int, timeout: float, keep: Path | None) -> Tally:
    tally = Tally()
    t0 = time.time()
    for i in range(n):
        run_case(t, make_case(i, seed), timeout, tally, keep)
        if (i + 1) % 100 == 0:
            print(f"{i + 1}/{n} requests, {time.time() - t0:.0f} s: {json.dumps(tally.counts)}", flush=True)
    return tally


def replay(t: Target, folder: Path, timeout: float) -> Tally:
    tally = Tally()
    for i, p in enumerate(sorted(folder.glob("*.json"))):
        rec = json.loads(p.read_text())
        case = Case(i, rec["method"], rec["path"], base64.b64decode(rec["body_b64"]))
        print(f"{p.name}: kept as {rec['outcome']}")
        run_case(t, case, timeout, tally, None)
    return tally


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=60.0, help="Seconds per request before it counts as a hang.")
    ap.add_argument("--url", help="Fuzz a running server (http://127.0.0.1:PORT) instead of starting one.")
    ap.add_argument("--api-key", help="The running server's API key (with --url).")
    ap.add_argument("--model", type=Path, help="The GGUF to serve (default: models/clover-tiny converted to bf16).")
    ap.add_argument(
        "--keep", type=Path, default=KEEP, help="Where failing requests are kept (default out/fuzz-server)."
    )
    ap.add_argument("--no-keep", action="store_true", help="Keep nothing.")
    ap.add_argument("--replay", type=Path, help="Send the kept requests of this folder instead of new ones.")
    ap.add_argument("--mem-limit-gb", type=float, default=8.0, help="Address space the server may add (0: none).")
    a = ap.parse_args(argv)
    if a.requests < 0 or not (math.isfinite(a.timeout) and a.timeout > 0):
        ap.error("--requests must be >= 0 and --timeout > 0")
    if a.url and not a.url.startswith("http://127.0.0.1:"):
        ap.error("--url must be http://127.0.0.1:PORT (the fuzzer only talks to loopback)")
    log_dir = a.keep if not a.no_keep else Path(tempfile.gettempdir())
    log_dir.mkdir(parents=True, exist_ok=True)
    t = Target(a.url, a.api_key, a.model, log_dir / "server.log", a.mem_limit_gb)
    t0 = time.time()
    t.start()
    try:
        if a.replay:
            tally = replay(t, a.replay, a.timeout)
        else:
            tally = campaign(t, a.requests, a.seed, a.timeout, None if a.no_keep else a.keep)
    finally:
        tracebacks = t.stop()
    print(f"done in {time.time() - t0:.0f} s: {json.dumps(tally.counts)}; tracebacks in the server log: {tracebacks}")
    print(f"by route: {json.dumps(tally.by_route)}")
    print(f"5xx, hangs, broken connections or deaths: {tally.bad}")
    return 1 if tally.bad or tracebacks else 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
