"""Tool calls and structured output for `clover-gguf serve` (OpenAI's `tools`, `tool_choice`,
`parallel_tool_calls`, `response_format`, and llama-server's `grammar`).

Requests become a grammar for the runtime's constrained decoding (runtime/grammar.py,
docs/CONTRACTS.md); replies are split into content and OpenAI `tool_calls` by reading the
`<tool_call>` sections that Clover's chat template defines (spec section 5).

- `tool_choice` "auto" (the default with tools): the model writes text or calls; once it emits
  `<tool_call>` the call is constrained (a lazy grammar, as llama-server does), so every call it
  makes parses and matches its tool's schema.
- "required" / a named function: the output is one or more calls (one with a named function or
  `parallel_tool_calls: false`) after an optional think block.
- "none": the tools are not rendered; the model answers in text.
- `response_format` json_object / json_schema and `grammar`: the content matches them (after an
  optional think block when thinking is on).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from ..errors import CloverError
from ..runtime.grammar import (
    JSON_OBJECT_SCHEMA,
    GrammarBudget,
    SchemaError,
    check_gbnf,
    json_schema_to_grammar,
    prefix_rules,
    tool_call_grammar,
)
from ..tokenizer import END_TOOL_CALL, TOOL_CALL, tool_call_sections

TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_TOOLS = 128
SERVER_RULES = "clover-"  # the prefix of the rules the server adds around a request's grammar
_RULE_DEF = re.compile(r"^\s*([A-Za-z][A-Za-z0-9_-]*)\s*::=", re.M)


class FieldError(CloverError, ValueError):
    """A request field is wrong; `param` names it (the server answers 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class Constraint:
    """What a chat request asks of the output: the tools to render, a grammar (GBNF) and, for a
    lazy grammar, the token that starts it."""

    tools: list[dict] | None = None
    grammar: str | None = None
    trigger: str | None = None  # the text of the token that starts a lazy grammar
    parse_calls: bool = False  # read <tool_call> sections out of the reply
    kind: str = "text"  # text, tools, json, grammar: what the output is constrained to

    @property
    def kind_field(self) -> str:
        """The request field a failure of this constraint's grammar is blamed on."""
        return {"json": "schema", "tools": "tools"}.get(self.kind, "grammar")


def check_tool(t, p: str) -> dict:
    """One OpenAI function tool, checked and normalised (parameters default to an empty object)."""
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
        raise FieldError(f'\'{p}\' must be {{"type": "function", "function": {{...}}}}', p)
    fn = t["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise FieldError(f"'{p}.function.name' must be 1-64 letters, digits, '_', '.' or '-'", f"{p}.function.name")
    if "description" in fn and not isinstance(fn["description"], str):
        raise FieldError(f"'{p}.function.description' must be a string", f"{p}.function.description")
    params = fn.get("parameters")
    if params is not None and not (isinstance(params, dict) and params.get("type", "object") == "object"):
        # a call's arguments are a JSON object (the template's {"name", "arguments": {...}})
        raise FieldError(
            f"'{p}.function.parameters' must be a JSON schema of an object (type \"object\")",
            f"{p}.function.parameters",
        )
    if "strict" in fn and fn["strict"] is not None and not isinstance(fn["strict"], bool):
        raise FieldError(f"'{p}.function.strict' must be true or false", f"{p}.function.strict")
    out = {"name": name}
    if fn.get("description") is not None:
        out["description"] = fn["description"]
    out["parameters"] = params if params is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": out}


def check_tools(tools, param: str = "tools", at=None) -> list[dict] | None:
    """A list of tools checked one by one (`at(i)` names the i-th; default `tools[i]`); a
    name given twice is refused. None or [] is no tools."""
    if tools is None:
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise FieldError(f"'{param}' must be a list of at most {MAX_TOOLS} function tools", param)
    at = at or (lambda i: f"{param}[{i}]")
    tools = [check_tool(t, at(i)) for i, t in enumerate(tools)] or None
    names = [t["function"]["name"] for t in tools or []]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise FieldError(f"'{param}' names the function '{dup}' twice", param)
    return tools


def check_choice(choice, tools: list[dict] | None, param: str = "tool_choice") -> str | dict:
    """tool_choice in OpenAI chat's form (auto, none, required or a named function), against
    the tools: a named function must be one of them, required needs some."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise FieldError(
                f'\'{param}\' must be auto, none, required or {{"type": "function", "function": {{"name": ...}}}}',
                param,
            )
        if name not in [t["function"]["name"] for t in tools or []]:
            raise FieldError(f"'{param}' names '{name}', which is not one of the tools", param)
    elif choice not in ("auto", "none", "required"):
        raise FieldError(f"'{param}' must be auto, none, required or a function, got {json.dumps(choice)}", param)
    elif choice == "required" and not tools:
        raise FieldError(f"'{param}' requires a tool call but the request has no tools", param)
    return choice


def parse_tools(body: dict) -> tuple[list[dict] | None, str | dict, bool]:
    """(tools, tool_choice, parallel_tool_calls) of an OpenAI chat request, checked."""
    tools = check_tools(body.get("tools"))
    choice = check_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise FieldError("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    return tools, choice, parallel


def response_format_schema(rf, param: str = "response_format") -> dict | None:
    """The JSON schema an OpenAI `response_format` asks for, or None (text)."""
    if rf is None:
        return None
    t = rf.get("type") if isinstance(rf, dict) else None
    if t == "text":
        return None
    if t == "json_object":
        return JSON_OBJECT_SCHEMA
    if t == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise FieldError(f"'{param}.json_schema.schema' must be a JSON schema object", param)
        return schema
    raise FieldError(f"'{param}.type' must be text, json_object or json_schema", param)


def request_constraint(
    tools: list[dict] | None,
    choice: str | dict | None,
    parallel: bool,
    schema: dict | None,
    grammar: str | None,
    thinking: bool,
    token_id,
    names: dict[str, str] | None = None,
) -> Constraint:
    """The Constraint of a chat request (tools and choice checked by check_tools/check_choice).
    `token_id(text)` gives a special token's id (None if the model has none); `thinking`: the
    prompt leaves the model to open a think block, which the grammar then allows before what it
    constrains. `names` maps the fields' names here (tools, tool_choice, schema, grammar) to the
    request's own, for the errors."""
    name = lambda k: (names or {}).get(k, k)
    choice = choice if choice is not None else ("auto" if tools else "none")
    if grammar is not None and not isinstance(grammar, str):
        raise FieldError(f"'{name('grammar')}' must be a GBNF string", name("grammar"))
    if grammar is not None:
        own = next((r for r in _RULE_DEF.findall(grammar) if r.startswith(SERVER_RULES)), None)
        if own:  # the server's rules live in that namespace: a request must not redefine them
            raise FieldError(
                f"'{name('grammar')}' defines the rule {own!r}: names starting with {SERVER_RULES!r} are the server's",
                name("grammar"),
            )
        try:
            check_gbnf(grammar)
        except GrammarBudget as e:
            raise FieldError(f"'{name('grammar')}': {e}", name("grammar")) from None
    if schema is not None and grammar is not None:
        raise FieldError(f"give '{name('schema')}' or '{name('grammar')}', not both", name("grammar"))
    forced = choice == "required" or isinstance(choice, dict)
    if grammar is not None and forced:
        raise FieldError(
            f"'{name('grammar')}' constrains the reply that '{name('tool_choice')}' makes a tool call; give one",
            name("grammar"),
        )
    c = Constraint(tools=tools if choice != "none" else None)
    if c.tools and token_id(TOOL_CALL) is None:
        raise FieldError(f"this model has no {TOOL_CALL} token: it cannot call tools", name("tools"))
    alts: list[tuple[str, str]] = []  # (rule prefix, grammar) of what the reply may be
    try:
        if c.tools:
            chosen = (
                c.tools
                if not isinstance(choice, dict)
                else [t for t in c.tools if t["function"]["name"] == choice["function"]["name"]]
            )
            alts.append(("clover-tools-", tool_call_grammar(chosen, parallel and not isinstance(choice, dict))))
            c.parse_calls, c.kind = True, "tools"
        if not forced and schema is not None:
            alts.append(("clover-json-", json_schema_to_grammar(schema)))
            c.kind = "json"
        elif not forced and grammar is not None:
            alts.append(("clover-grammar-", grammar))
            c.kind = "grammar"
    except SchemaError as e:
        param = name("tools") if forced or schema is None else name("schema")
        raise FieldError(f"the JSON schema cannot be used: {e}", param) from None
    if not alts:
        return c
    if c.tools and not forced and len(alts) == 1:
        # auto: free text, or calls constrained from their first token on (lazy grammar)
        c.grammar, c.trigger, c.kind = alts[0][1], TOOL_CALL, "text"
        _budget(c.grammar, name("tools"))
        return c
    # the request's own grammar keeps its rule names (its errors name them), all but `root`
    rules = [f"clover-body ::= {' | '.join(p + 'root' for p, _ in alts)}"] + [
        prefix_rules(g, p, only="root" if p == "clover-grammar-" else None) for p, g in alts
    ]
    open_, close = token_id("<think>"), token_id("</think>")
    if thinking and open_ is not None and close is not None:
        # a think block the model may open first, then what is constrained
        root = f"root ::= ( <[{open_}]> ( !<[{close}]> )* <[{close}]> [\\n]* )? clover-body"
    else:
        root = "root ::= clover-body"
    c.grammar = "\n".join([root, *rules]) + "\n"
    _budget(c.grammar, name(c.kind_field))
    return c


def _budget(grammar: str, param: str) -> None:
    try:
        check_gbnf(grammar)
    except GrammarBudget as e:
        raise FieldError(f"'{param}': {e}", param) from None


# ----------------------------------------------------------------------------- replies


@dataclass
class Reply:
    content: str
    tool_calls: list[dict] = field(default_factory=list)


_HEAD = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')


def _call(inner: str) -> dict | None:
    """An OpenAI tool call from the JSON inside a <tool_call> section, or None. The arguments
    string is the text the model wrote when it has the template's form (so the call renders
    back to the same tokens), else the arguments re-serialised."""
    try:
        obj = json.loads(inner)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("arguments"), dict):
        return None
    m = _HEAD.match(inner)
    args = inner[m.end() : -1] if m and inner.endswith("}") else None
    try:
        if args is None or json.loads(args) != obj["arguments"]:
            args = json.dumps(obj["arguments"], ensure_ascii=False)
    except ValueError:
        args = json.dumps(obj["arguments"], ensure_ascii=False)
    return {
        "id": "call_" + secrets.token_hex(12),
        "type": "function",
        "function": {"name": obj["name"], "arguments": args},
    }


def split_calls(text: str) -> Reply:
    """Content and tool calls of a reply: the text before the first well-formed <tool_call>
    section is the content; sections that do not hold a call stay in the content as text."""
    calls, keep, pos = [], [], 0
    sections = list(tool_call_sections(text))
    if sections and sections[-1][2] is None:  # a call cut at the length limit: never shown as text
        text = text[: sections[-1][0]].rstrip("\n")
        sections.pop()
    for i, body, j in sections:
        call = _call(text[body:j].strip()) if j is not None else None
        if call is None:
            continue
        keep.append(text[pos:i])
        pos = j + len(END_TOOL_CALL)
        calls.append(call)
    if not calls:
        return Reply(text)
    keep.append(text[pos:])
    content = "".join(keep)
    return Reply(content.strip("\n"), calls)


class CallStreamer:
    """Streamed content with tool calls: text before a <tool_call> section goes out as content
    (a possible start of the tag is held back), each section as one tool-call delta when its
    end tag has arrived."""

    def __init__(self):
        self.buf = ""
        self.n_calls = 0

    def feed(self, delta: str, last: bool = False) -> tuple[str, list[dict]]:
        self.buf += delta
        out, calls, pos = [], [], 0
        for i, body, j in tool_call_sections(self.buf):  # one scan of the buffer, sections in order
            if j is None:  # still open: hold it back, and the newlines before it
                keep = pos + len(self.buf[pos:i].rstrip("\n"))
                out.append(self.buf[pos:keep])
                self.buf = self.buf[keep:]
                return self._content(out), calls
            call = _call(self.buf[body:j].strip())
            end = j + len(END_TOOL_CALL)
            if call is None:
                out.append(self.buf[pos:end])
            else:
                out.append(self.buf[pos:i].rstrip("\n") if not calls and self.n_calls == 0 else "")
                calls.append({"index": self.n_calls, **call})
                self.n_calls += 1
            pos = end
        self.buf = self.buf[pos:]
        if last:
            out.append(self.buf)
            self.buf = ""
        else:
            k = next(
                (
                    k
                    for k in range(min(len(TOOL_CALL) - 1, len(self.buf)), 0, -1)
                    if TOOL_CALL.startswith(self.buf[-k:])
                ),
                0,
            )
            # newlines before a call are not content (split_calls strips them): hold them too
            keep = len(self.buf[: len(self.buf) - k].rstrip("\n"))
            out.append(self.buf[:keep])
            self.buf = self.buf[keep:]
        return self._content(out), calls

    def _content(self, parts: list[str]) -> str:
        s = "".join(parts)
        # between and after calls only newlines are expected: they are not content
        return s.strip("\n") if self.n_calls else s


def assistant_message(content: str, calls: list[dict], reasoning: str | None) -> dict:
    """The assistant message of a reply, as the next turn sends it back (for the state snapshot)."""
    m: dict = {"role": "assistant", "content": content}
    if reasoning is not None:
        m["reasoning_content"] = reasoning
    if calls:
        m["tool_calls"] = [{k: c[k] for k in ("id", "type", "function")} for c in calls]
    return m


def parse_tool_calls(v, p: str) -> list[dict]:
    """An assistant message's `tool_calls`, checked (arguments as a JSON string, as OpenAI sends them)."""
    if not isinstance(v, list):
        raise FieldError(f"'{p}' must be a list of tool calls", p)
    out = []
    for j, tc in enumerate(v):
        q = f"{p}[{j}]"
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise FieldError(f'\'{q}\' must be {{"type": "function", "function": {{"name", "arguments"}}}}', q)
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            raise FieldError(f"'{q}.function.arguments' must be a JSON string", f"{q}.function.arguments")
        try:
            ok = isinstance(json.loads(args), dict)
        except ValueError:
            ok = False
        if not ok:
            raise FieldError(f"'{q}.function.arguments' must be a JSON object in a string", f"{q}.function.arguments")
        out.append(
            {"id": str(tc.get("id", "")), "type": "function", "function": {"name": fn["name"], "arguments": args}}
        )
    return out


def chat_message(text: str, thinking: bool, parse_calls: bool) -> dict:
    """The assistant message of a finished chat reply: reasoning_content (thinking), content and
    tool_calls."""
    from .text import split_reasoning

    r, c = split_reasoning(text) if thinking else (None, text)
    reply = split_calls(c) if parse_calls else Reply(c)
    msg = assistant_message(reply.content, reply.tool_calls, r)
    if reply.tool_calls and not reply.content:
        msg["content"] = None
    return msg


class ChatDeltas:
    """The `delta` of each streamed chat chunk from the final text's deltas: reasoning_content
    (thinking), content, and tool_calls (one delta per complete call)."""

    def __init__(self, thinking: bool, parse_calls: bool):
        from .text import ReasoningSplitter

        self.split = ReasoningSplitter() if thinking else None
        self.calls = CallStreamer() if parse_calls else None
        self.first = True
        self.n_calls = 0

    def feed(self, text: str | None, last: bool = False) -> dict:
        delta: dict = {"role": "assistant"} if self.first else {}
        self.first = False
        dr, dc = self.split.feed(text or "", last=last) if self.split else ("", text)
        if dr:
            delta["reasoning_content"] = dr
        calls = []
        if self.calls is not None and dc is not None:
            dc, calls = self.calls.feed(dc, last=last)
            if calls:
                delta["tool_calls"] = calls
                self.n_calls += len(calls)
        if dc or not (dr or calls) and dc is not None:
            delta["content"] = dc
        return delta
