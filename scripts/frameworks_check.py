#!/usr/bin/env python3
"""Run agent frameworks' own tool loops against `clover-gguf serve`, behind a recording proxy.

Eight Python agent frameworks (the openai SDK, openai-agents, smolagents, langchain/langgraph,
litellm, llm, pydantic-ai, instructor) are installed from PyPI, each into a venv of its own
under a cache folder (reused when present; one venv for all eight cannot hold the newest of
each: instructor pins jiter < 0.15, which newer openai releases exclude). Each framework runs
10 small coding-agent loops ("Read calc.py", "Find where add is defined", ...; two or three of
the tools read_file(path), grep(pattern, path), list_files(dir), whose implementations answer
from canned files), non-streamed and streamed, with the framework's own tool-calling mechanism
(function tools, tool_choice left to the framework, auto; instructor's forced tool call, which
is all it does), temperature 0, and a turn cap (4 model turns by default). A loop ends when the
model answers without a call or at the cap.

One `clover-gguf serve` per framework (-t 1) sits behind a recording reverse proxy; each loop
talks to its own base URL (http://127.0.0.1:PORT/<framework>/<mode>/<loop>/v1) so every
exchange is attributed to its loop. From the exchanges: HTTP statuses, the tool calls the server
returned (and whether each is valid: a tool the request offered, arguments that parse as a
JSON object and validate against that tool's JSON schema, with jsonschema), the tool results
sent back (and whether their ids are ids the server returned), replies whose text shows
tool-call markup (a call the server did not parse), the fields the server ignored
(x-clover-ignored-fields) and error bodies. From the framework's side: whether the loop ran
without an exception, how it ended, which tools it executed.

Written as JSON + Markdown (evaldata/frameworks/frameworks.json, frameworks.md). Usually run
through scripts/frameworks_check.sh:

    scripts/frameworks_check.sh                          # all eight, 10 loops a mode
    scripts/frameworks_check.sh --only litellm,llm --loops 3 --keep out/frameworks
    scripts/frameworks_check.sh --install-only

This file is also the runner that each framework's venv executes (`--runner NAME`): only the
standard library is imported at the top; the frameworks are imported inside their runners and
jsonschema (from the project's venv) inside the checker.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import http.client
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path

from check_common import (
    REPO,
    QuietHandler,
    clover_gguf_bin,
    git_describe,
    parse_sse,
    python_version,
    run_quiet,
)

DEFAULT_MODEL_DIR = REPO / "models" / "clover-tiny-v3-wip"
MODEL_NAME = "clover"  # what every framework is told the model is called (the server answers any name)
MODES = ("non-streamed", "streamed")

# framework: packages installed into its venv, the distributions whose versions are reported
# (the first is the framework's), whether it streams
FRAMEWORKS: dict[str, tuple[list[str], list[str], bool]] = {
    "openai": (["openai"], ["openai"], True),
    "openai-agents": (["openai-agents"], ["openai-agents", "openai"], True),
    "smolagents": (["smolagents[openai]"], ["smolagents", "openai"], True),
    "langgraph": (
        ["langchain", "langgraph", "langchain-openai"],
        ["langchain", "langgraph", "langchain-openai", "langchain-core", "openai"],
        True,
    ),
    "litellm": (["litellm"], ["litellm", "openai"], True),
    "llm": (["llm"], ["llm", "openai"], True),
    "pydantic-ai": (["pydantic-ai-slim[openai]"], ["pydantic-ai-slim", "openai"], True),
    "instructor": (["instructor"], ["instructor", "openai"], True),
}
ORDER = list(FRAMEWORKS)
ALIASES = {"langchain": "langgraph", "pydantic_ai": "pydantic-ai", "agents": "openai-agents", "smol": "smolagents"}
MECHANISM = {
    "openai": "chat.completions.create / .stream() helper (accumulates the streamed calls), the SDK's "
    "pydantic_function_tool (strict) tools, a loop appending the reply message and `tool` results",
    "openai-agents": "Agent + Runner.run / Runner.run_streamed, OpenAIChatCompletionsModel, @function_tool, max_turns",
    "smolagents": "ToolCallingAgent (stream_outputs for streamed), OpenAIServerModel, @tool, max_steps",
    "langgraph": "langchain.agents.create_agent (a langgraph graph) with ChatOpenAI (streaming=True and "
    "stream_mode='messages' for streamed), @tool, recursion_limit",
    "litellm": "litellm.completion(model='openai/...', tools=..., tool_choice='auto'), stream_chunk_builder for "
    "streamed, a loop as litellm's docs write it",
    "llm": "extra-openai-models.yaml (supports_tools, can_stream) + model.chain(tools=[functions], chain_limit)",
    "pydantic-ai": "Agent(OpenAIChatModel, tools=[functions]).run_sync / .run_stream, UsageLimits(request_limit)",
    "instructor": "instructor.from_openai(mode=TOOLS): one forced call of a NextStep model (a union of the "
    "task's tools and an answer) per turn, create_with_completion / create_partial; the loop sends the "
    "call's result back as a `tool` message",
}

# ---------------------------------------------------------------------------------------------
# the tasks and the tools (canned: they answer from these files, never touch the disk)

FILES = {
    "calc.py": '"""A small calculator."""\n\n\ndef add(a, b):\n    """Return the sum of a and b."""\n'
    '    return a - b\n\n\ndef mul(a, b):\n    """Return the product of a and b."""\n    return a * b\n',
    "test_calc.py": "import unittest\n\nfrom calc import add, mul\n\n\nclass CalcTest(unittest.TestCase):\n"
    "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n\n    def test_mul(self):\n"
    "        self.assertEqual(mul(2, 3), 6)\n",
    "text_utils.py": '"""String helpers."""\n\n\ndef slugify(text):\n    # TODO: strip punctuation\n'
    '    return "-".join(text.lower().split())\n',
    "README.md": "# calc\n\nA tiny calculator. Run the tests with `python -m unittest`.\n",
    "src/app.py": "from calc import add\n\nprint(add(1, 2))\n",
}

# (prompt, tools offered)
TASKS = [
    ("Read calc.py", ["read_file", "list_files"]),
    ("Find where add is defined", ["grep", "read_file"]),
    ("List the files", ["list_files", "read_file"]),
    ("Show me the tests in test_calc.py", ["read_file", "grep"]),
    ("Which files mention slugify?", ["grep", "list_files"]),
    ("Read README.md and tell me how to run the tests", ["read_file", "list_files"]),
    ("Find the TODO comments", ["grep", "list_files", "read_file"]),
    ("What does mul return? Look at calc.py", ["read_file", "grep"]),
    ("List the files in src and open the first one", ["list_files", "read_file"]),
    ("Search text_utils.py for function definitions", ["grep", "read_file", "list_files"]),
]

TOOL_DOCS = {
    "read_file": "Read a text file of the project and return its contents.",
    "grep": "Search the project's files for a regular expression; returns matching lines as path:line:text.",
    "list_files": "List the files in a folder of the project.",
}
PARAM_DOCS = {
    "path": "The file's path, relative to the project root.",
    "pattern": "The regular expression to look for.",
    "grep_path": "A file or folder to search; the whole project by default.",
    "dir": "The folder, relative to the project root; the project root by default.",
}
# the same tools as plain JSON schemas, for the frameworks that take schemas (litellm)
SCHEMAS = {
    "read_file": {
        "type": "object",
        "properties": {"path": {"type": "string", "description": PARAM_DOCS["path"]}},
        "required": ["path"],
    },
    "grep": {
        "type": "object",
        "properties": {
            "pattern": {"type": "string", "description": PARAM_DOCS["pattern"]},
            "path": {"type": "string", "description": PARAM_DOCS["grep_path"]},
        },
        "required": ["pattern"],
    },
    "list_files": {
        "type": "object",
        "properties": {"dir": {"type": "string", "description": PARAM_DOCS["dir"]}},
        "required": [],
    },
}

EXECUTED: list[str] = []  # the tools the framework executed in the current loop


def _tool_read_file(path: str) -> str:
    path = str(path).strip().removeprefix("./")
    return FILES[path] if path in FILES else f"error: no file {path!r}"


def _tool_grep(pattern: str, path: str = ".") -> str:
    try:
        rx = re.compile(str(pattern))
    except re.error as e:
        return f"error: bad pattern: {e}"
    where = str(path or ".").strip().removeprefix("./").rstrip("/")
    hits = []
    for name, text in FILES.items():
        if where not in ("", ".") and name != where and not name.startswith(where + "/"):
            continue
        hits += [f"{name}:{i}:{line}" for i, line in enumerate(text.splitlines(), 1) if rx.search(line)]
    return "\n".join(hits) or "no matches"


def _tool_list_files(dir: str = ".") -> str:
    where = str(dir or ".").strip().removeprefix("./").rstrip("/")
    names = [n for n in FILES if where in ("", ".") or n.startswith(where + "/")]
    return "\n".join(names) or f"error: no folder {where!r}"


def run_tool(name: str, args: dict) -> str:
    EXECUTED.append(name)
    fn = {"read_file": _tool_read_file, "grep": _tool_grep, "list_files": _tool_list_files}.get(name)
    if fn is None:
        return f"error: no tool {name!r}"
    try:
        return fn(**args)
    except TypeError as e:
        return f"error: {e}"


# Plain Python functions (type hints, Google docstrings) for the frameworks that build a tool
# from a function (openai-agents, smolagents, langchain, llm, pydantic-ai).


def read_file(path: str) -> str:
    """Read a text file of the project and return its contents.

    Args:
        path: The file's path, relative to the project root.
    """
    return run_tool("read_file", {"path": path})


def grep(pattern: str, path: str = ".") -> str:
    """Search the project's files for a regular expression; returns matching lines as path:line:text.

    Args:
        pattern: The regular expression to look for.
        path: A file or folder to search; the whole project by default.
    """
    return run_tool("grep", {"pattern": pattern, "path": path})


def list_files(dir: str = ".") -> str:
    """List the files in a folder of the project.

    Args:
        dir: The folder, relative to the project root; the project root by default.
    """
    return run_tool("list_files", {"dir": dir})


FUNCTIONS = {"read_file": read_file, "grep": grep, "list_files": list_files}
INSTRUCTIONS = "You are a coding assistant. Use the tools to look at the project, then answer briefly."


# ---------------------------------------------------------------------------------------------
# the runners: executed by `<framework venv>/bin/python frameworks_check.py --runner NAME`.
# Each runs one loop and returns how it ended ("answer" or "turn_cap") and what the framework
# said; an exception is the loop's failure.


class TurnCap(Exception):
    """The framework stopped the loop at its turn cap (its own exception for it)."""


def run_openai(base: str, key: str, stream: bool, prompt: str, names: list[str], turns: int) -> dict:
    import openai
    from pydantic import Field, create_model

    client = openai.OpenAI(base_url=base, api_key=key)
    tools = []
    for n in names:
        fields = {
            p: (str, Field(description=PARAM_DOCS["grep_path" if (n, p) == ("grep", "path") else p]))
            for p in SCHEMAS[n]["properties"]
        }
        tools.append(openai.pydantic_function_tool(create_model(n, **fields), name=n, description=TOOL_DOCS[n]))
    messages: list = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": prompt}]
    kw = {"model": MODEL_NAME, "tools": tools, "tool_choice": "auto", "temperature": 0}
    for _ in range(turns):
        if stream:
            with client.chat.completions.stream(messages=messages, **kw) as s:
                for _event in s:
                    pass
                completion = s.get_final_completion()
        else:
            completion = client.chat.completions.parse(messages=messages, **kw)
        msg = completion.choices[0].message
        messages.append(msg)  # as OpenAI's function-calling guide does
        if not msg.tool_calls:
            return {"ended": "answer", "answer": msg.content}
        for call in msg.tool_calls:
            args = call.function.parsed_arguments  # the SDK parsed and validated them (pydantic)
            out = run_tool(call.function.name, args.model_dump() if args is not None else {})
            messages.append({"role": "tool", "tool_call_id": call.id, "content": out})
    return {"ended": "turn_cap"}


def run_openai_agents(base: str, key: str, stream: bool, prompt: str, names: list[str], turns: int) -> dict:
    import asyncio

    from agents import (
        Agent,
        MaxTurnsExceeded,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no traces to OpenAI's servers (as its docs say for other providers)
    client = AsyncOpenAI(base_url=base, api_key=key)
    agent = Agent(
        name="coder",
        instructions=INSTRUCTIONS,
        model=OpenAIChatCompletionsModel(model=MODEL_NAME, openai_client=client),
        tools=[function_tool(FUNCTIONS[n]) for n in names],
        model_settings=ModelSettings(temperature=0),
    )

    async def go():
        if stream:
            r = Runner.run_streamed(agent, prompt, max_turns=turns)
            async for _ev in r.stream_events():
                pass
            return r.final_output
        return (await Runner.run(agent, prompt, max_turns=turns)).final_output

    try:
        out = asyncio.run(go())
    except MaxTurnsExceeded as e:
        raise TurnCap(str(e)) from e
    return {"ended": "answer", "answer": out}


def run_smolagents(base: str, key: str, stream: bool, prompt: str, names: list[str], turns: int) -> dict:
    from smolagents import LogLevel, OpenAIServerModel, ToolCallingAgent, tool

    model = OpenAIServerModel(model_id=MODEL_NAME, api_base=base, api_key=key, temperature=0)
    agent = ToolCallingAgent(
        tools=[tool(FUNCTIONS[n]) for n in names],
        model=model,
        max_steps=turns,
        stream_outputs=stream,
        verbosity_level=LogLevel.OFF,
    )
    out = agent.run(prompt)
    steps = [s for s in agent.memory.steps if type(s).__name__ == "ActionStep"]
    errors = [f"step {getattr(s, 'step_number', '?')}: {s.error}" for s in steps if getattr(s, "error", None)]
    final = any(getattr(s, "is_final_answer", False) for s in steps)
    return {"ended": "answer" if final else "turn_cap", "answer": out, "framework_step_errors": errors}


def run_langgraph(base: str, key: str, stream: bool, prompt: str, names: list[str], turns: int) -> dict:
    from langchain.agents import create_agent
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.errors import GraphRecursionError

    llm = ChatOpenAI(model=MODEL_NAME, base_url=base, api_key=key, temperature=0, streaming=stream)
    agent = create_agent(llm, tools=[tool(FUNCTIONS[n]) for n in names], system_prompt=INSTRUCTIONS)
    inputs = {"messages": [{"role": "user", "content": prompt}]}
    config = {"recursion_limit": 2 * turns}  # a model step and a tools step per turn
    try:
        if stream:
            last = None
            for chunk, _meta in agent.stream(inputs, config, stream_mode="messages"):
                last = chunk
            answer = getattr(last, "content", None)
        else:
            answer = agent.invoke(inputs, config)["messages"][-1].content
    except GraphRecursionError as e:
        raise TurnCap(str(e)) from e
    return {"ended": "answer", "answer": answer}


def run_litellm(base: str, key: str, stream: bool, prompt: str, names: list[str], turns: int) -> dict:
    import litellm

    tools = [
        {"type": "function", "function": {"name": n, "description": TOOL_DOCS[n], "parameters": SCHEMAS[n]}}
        for n in names
    ]
    messages: list = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": prompt}]
    kw = {
        "model": f"openai/{MODEL_NAME}",
        "api_base": base,
        "api_key": key,
        "tools": tools,
        "tool_choice": "auto",
        "temperature": 0,
    }
    for _ in range(turns):
        if stream:
            chunks = list(litellm.completion(messages=messages, stream=True, **kw))
            response = litellm.stream_chunk_builder(chunks, messages=messages)
        else:
            response = litellm.completion(messages=messages, **kw)
        msg = response.choices[0].message
        messages.append(msg)  # as litellm's function-calling docs do
        if not msg.tool_calls:
            return {"ended": "answer", "answer": msg.content}
        for call in msg.tool_calls:
            out = run_tool(call.function.name, json.loads(call.function.arguments or "{}"))
            messages.append({"tool_call_id": call.id, "role": "tool", "name": call.function.name, "content": out})
    return {"ended": "turn_cap"}


def run_llm(base: str, key: str, stream: bool, prompt: str, names: list[str], turns: int) -> dict:
    # The model is configured as llm's docs say for an OpenAI-compatible server: an entry of
    # extra-openai-models.yaml in llm's user folder (LLM_USER_PATH) and its key in keys.json.
    user = Path(os.environ["LLM_USER_PATH"])
    user.mkdir(parents=True, exist_ok=True)
    model_id = "clover-" + "-".join(base.rstrip("/").split("/")[-4:-1])  # clover-llm-<mode>-<loop>
    (user / "extra-openai-models.yaml").write_text(
        f"- model_id: {model_id}\n  model_name: {MODEL_NAME}\n  api_base: {base}\n  api_key_name: clover\n"
        "  supports_tools: true\n  can_stream: true\n"
    )
    (user / "keys.json").write_text(json.dumps({"clover": key}))
    import llm

    model = llm.get_model(model_id)
    chain = model.conversation().chain(
        prompt,
        system=INSTRUCTIONS,
        tools=[FUNCTIONS[n] for n in names],
        chain_limit=turns,
        stream=stream,
        options={"temperature": 0},
    )
    try:
        answer = "".join(chain)  # iterating runs the chain (streamed: the chunks as they come)
    except ValueError as e:
        if not str(e).startswith("Chain limit of"):
            raise
        # llm raises once chain_limit responses were made, also when the last one made no call
        done = getattr(chain, "_responses", None) or []
        if done and not done[-1].tool_calls():
            return {"ended": "answer", "answer": done[-1].text(), "note": str(e)}
        raise TurnCap(str(e)) from e
    return {"ended": "answer", "answer": answer}


def run_pydantic_ai(base: str, key: str, stream: bool, prompt: str, names: list[str], turns: int) -> dict:
    import asyncio

    from pydantic_ai import Agent, UsageLimitExceeded
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    model = OpenAIChatModel(MODEL_NAME, provider=OpenAIProvider(base_url=base, api_key=key))
    agent = Agent(model, instructions=INSTRUCTIONS, tools=[FUNCTIONS[n] for n in names])
    limits = UsageLimits(request_limit=turns)
    settings = {"temperature": 0}

    async def go():
        if stream:
            async with agent.run_stream(prompt, usage_limits=limits, model_settings=settings) as r:
                async for _text in r.stream_text():
                    pass
                return await r.get_output()
        return (await agent.run(prompt, usage_limits=limits, model_settings=settings)).output

    try:
        out = asyncio.run(go())
    except UsageLimitExceeded as e:
        raise TurnCap(str(e)) from e
    return {"ended": "answer", "answer": out}


def run_instructor(base: str, key: str, stream: bool, prompt: str, names: list[str], turns: int) -> dict:
    from typing import Literal, Union

    import instructor
    import openai
    from pydantic import BaseModel, Field, create_model

    actions = []
    for n in names:
        fields: dict = {"tool": (Literal[n], ...)}
        for p in SCHEMAS[n]["properties"]:
            doc = PARAM_DOCS["grep_path" if (n, p) == ("grep", "path") else p]
            required = p in SCHEMAS[n]["required"]
            fields[p] = (str, Field(description=doc)) if required else (str, Field(".", description=doc))
        actions.append(create_model(n, __doc__=TOOL_DOCS[n], **fields))

    class Answer(BaseModel):
        """Answer the user; ends the task."""

        tool: Literal["answer"]
        text: str

    step_model = create_model(
        "NextStep",
        __doc__="The next step: call one of the tools, or answer.",
        action=(Union[tuple([*actions, Answer])], ...),  # noqa: UP007 - a Union built at run time
    )
    client = instructor.from_openai(openai.OpenAI(base_url=base, api_key=key), mode=instructor.Mode.TOOLS)
    messages: list = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": prompt}]
    kw = {"model": MODEL_NAME, "response_model": step_model, "temperature": 0}
    for turn in range(turns):
        if stream:
            step = None
            for partial in client.chat.completions.create_partial(messages=messages, **kw):
                step = partial
            # a streamed partial carries neither the server's call id nor the tool's name
            call_id, tool_name = f"call_instructor_{turn}", type(step).__name__
        else:
            step, completion = client.chat.completions.create_with_completion(messages=messages, **kw)
            call = completion.choices[0].message.tool_calls[0]
            call_id, tool_name = call.id, call.function.name
        action = step.action
        args = action.model_dump(exclude={"tool"})
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": tool_name, "arguments": step.model_dump_json()},
                    }
                ],
            }
        )
        if action.tool == "answer":
            return {"ended": "answer", "answer": action.text}
        messages.append({"role": "tool", "tool_call_id": call_id, "content": run_tool(action.tool, args)})
    return {"ended": "turn_cap"}


RUNNERS = {
    "openai": run_openai,
    "openai-agents": run_openai_agents,
    "smolagents": run_smolagents,
    "langgraph": run_langgraph,
    "litellm": run_litellm,
    "llm": run_llm,
    "pydantic-ai": run_pydantic_ai,
    "instructor": run_instructor,
}


class LoopTimeout(Exception):
    pass


def runner_main(args: argparse.Namespace) -> int:
    """Run `args.loops` loops of one framework in one mode; one JSON line per loop in args.results."""
    fn = RUNNERS[args.runner]
    stream = args.mode == "streamed"

    def on_alarm(signum, frame):
        raise LoopTimeout(f"the loop ran past {args.loop_timeout:.0f} s")

    signal.signal(signal.SIGALRM, on_alarm)
    for i in range(args.loops):
        prompt, names = TASKS[i % len(TASKS)]
        base = f"{args.base}/{args.runner}/{args.mode}/{i}/v1"
        EXECUTED.clear()
        t0 = time.time()
        rec: dict = {"loop": i, "prompt": prompt, "tools": names}
        signal.alarm(int(args.loop_timeout))
        try:
            out = fn(base, args.key, stream, prompt, names, args.turns)
            rec.update(ok=True, **out)
        except TurnCap as e:
            rec.update(ok=True, ended="turn_cap", cap_message=str(e)[:300])
        except Exception as e:  # a framework's failure is what is recorded
            rec.update(
                ok=False,
                ended="error",
                error=f"{type(e).__module__}.{type(e).__name__}: {e}"[:3000],
                traceback=traceback.format_exc()[-4000:],
            )
        finally:
            signal.alarm(0)
        rec["executed"] = list(EXECUTED)
        rec["seconds"] = round(time.time() - t0, 2)
        if "answer" in rec:
            rec["answer"] = None if rec["answer"] is None else str(rec["answer"])[:300]
        with open(args.results, "a") as f:  # not stdout: some frameworks draw on it
            f.write(json.dumps(rec, default=str) + "\n")
    return 0


# ---------------------------------------------------------------------------------------------
# the recording proxy: /<framework>/<mode>/<loop>/v1/... -> the server's /v1/...


class RecordingProxy(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, upstream_port: int):
        super().__init__(("127.0.0.1", 0), ProxyHandler)
        self.upstream_port = upstream_port
        self.lock = threading.Lock()
        self.exchanges: list[dict] = []

    def record(self, ex: dict) -> None:
        with self.lock:
            ex["n"] = len(self.exchanges) + 1
            self.exchanges.append(ex)


HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer"}
HOP_BY_HOP |= {"trailers", "transfer-encoding", "upgrade"}


class ProxyHandler(QuietHandler):
    server: RecordingProxy

    def _forward(self) -> None:
        t0 = time.time()
        body = self._read_body()
        parts = self.path.split("/")
        fw, mode, loop, path = "?", "?", -1, self.path
        if len(parts) > 4 and parts[1] in FRAMEWORKS and parts[2] in MODES and parts[3].isdigit():
            fw, mode, loop, path = parts[1], parts[2], int(parts[3]), "/" + "/".join(parts[4:])
        hdrs = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP | {"host", "content-length"}}
        hdrs["Accept-Encoding"] = "identity"
        if body or self.command in ("POST", "PUT", "PATCH"):
            hdrs["Content-Length"] = str(len(body))
        ex: dict = {"framework": fw, "mode": mode, "loop": loop, "method": self.command, "path": path}
        ex["user_agent"] = self.headers.get("User-Agent")
        upstream = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=3600)
        data = bytearray()
        try:
            upstream.request(self.command, path, body=body or None, headers=hdrs)
            resp = upstream.getresponse()
        except OSError as e:
            ex.update(status=502, proxy_error=f"upstream: {e!r}")
            msg = json.dumps({"error": {"message": f"frameworks_check proxy: {e}", "type": "proxy"}}).encode()
            self.send_response(502)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(msg)))
            self.end_headers()
            self.wfile.write(msg)
            ex["request"], ex["response"] = body, b""
            self.server.record(ex)
            return
        ex["status"] = resp.status
        ex["content_type"] = resp.getheader("Content-Type", "")
        ex["ignored_fields"] = resp.getheader("x-clover-ignored-fields")
        self.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in HOP_BY_HOP | {"content-length", "server", "date"}:
                self.send_header(k, v)
        length = resp.getheader("Content-Length")
        try:
            if length is not None and resp.getheader("Transfer-Encoding") is None:
                data += resp.read()
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            else:  # SSE: through chunk by chunk, as it comes
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.wfile.flush()
                while chunk := resp.read1(65536):
                    data += chunk
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            ex["client_disconnected"] = True
            self.close_connection = True
        except (OSError, http.client.HTTPException) as e:
            ex["proxy_error"] = f"upstream stream: {e!r}"
            self.close_connection = True
        finally:
            upstream.close()
        ex["seconds"] = round(time.time() - t0, 3)
        ex["request"], ex["response"] = body, bytes(data)
        self.server.record(ex)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _forward


# ---------------------------------------------------------------------------------------------
# reading the exchanges: the calls the server returned, and whether each is valid


def chat_reply(ctype: str, data: bytes) -> dict:
    """content, tool calls [{id, name, arguments}], finish_reason and error of a chat answer
    (a chat.completion, or its SSE chunks accumulated as a client does)."""
    out: dict = {"content": "", "calls": [], "finish_reason": None, "error": None, "sse": "event-stream" in ctype}
    if out["sse"]:
        calls: dict[int, dict] = {}
        for _, ev in parse_sse(data):
            if not isinstance(ev, dict):
                continue
            if ev.get("error"):
                out["error"] = ev["error"]
            for ch in ev.get("choices") or []:
                delta = ch.get("delta") or {}
                out["content"] += delta.get("content") or ""
                for tc in delta.get("tool_calls") or []:
                    c = calls.setdefault(tc.get("index", len(calls)), {"id": None, "name": "", "arguments": ""})
                    c["id"] = tc.get("id") or c["id"]
                    fn = tc.get("function") or {}
                    c["name"] += fn.get("name") or ""
                    c["arguments"] += fn.get("arguments") or ""
                out["finish_reason"] = ch.get("finish_reason") or out["finish_reason"]
        out["calls"] = [calls[k] for k in sorted(calls)]
        return out
    try:
        body = json.loads(data)
    except ValueError:
        out["error"] = data[:500].decode("utf-8", "replace")
        return out
    if not isinstance(body, dict):
        return out
    out["error"] = body.get("error")
    ch = (body.get("choices") or [{}])[0]
    msg = ch.get("message") or {}
    out["content"] = msg.get("content") or ""
    out["finish_reason"] = ch.get("finish_reason")
    for tc in msg.get("tool_calls") or []:
        fn = tc.get("function") or {}
        out["calls"].append({"id": tc.get("id"), "name": fn.get("name"), "arguments": fn.get("arguments")})
    return out


def message_text(m: dict) -> str:
    c = m.get("content")
    if isinstance(c, list):
        return "".join(p.get("text") or "" for p in c if isinstance(p, dict))
    return c if isinstance(c, str) else ""


def request_tools(req: dict) -> tuple[dict, object, list[str], int]:
    """(tool name -> parameters schema, tool_choice, ids of the `tool` results, results sent as
    text: user messages starting "Observation:", smolagents' way) of a chat request."""
    tools = {}
    for t in req.get("tools") or []:
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and fn.get("name"):
            tools[fn["name"]] = fn.get("parameters") or {"type": "object", "properties": {}}
    results = [
        str(m.get("tool_call_id"))
        for m in req.get("messages") or []
        if isinstance(m, dict) and m.get("role") in ("tool", "function")
    ]
    as_text = sum(
        1
        for m in req.get("messages") or []
        if isinstance(m, dict) and m.get("role") == "user" and message_text(m).startswith("Observation:")
    )
    return tools, req.get("tool_choice"), results, as_text


def check_call(call: dict, tools: dict) -> str | None:
    """None if the call is valid, else why not."""
    import jsonschema

    if call.get("name") not in tools:
        return f"tool {call.get('name')!r} was not offered (offered: {sorted(tools)})"
    try:
        args = json.loads(call.get("arguments") or "")
    except ValueError as e:
        return f"arguments are not JSON ({e}): {str(call.get('arguments'))[:200]!r}"
    if not isinstance(args, dict):
        return f"arguments are not a JSON object: {str(call.get('arguments'))[:200]!r}"
    schema = tools[call["name"]]
    try:
        cls = jsonschema.validators.validator_for(schema)
        cls.check_schema(schema)
        err = jsonschema.exceptions.best_match(cls(schema).iter_errors(args))
    except jsonschema.exceptions.SchemaError as e:
        return f"the request's schema does not check: {e.message}"
    return None if err is None else f"{err.message} (at {list(err.absolute_path)})"


MARKUP = re.compile(r"</?tool_call>|<tool_call")


def analyze(exchanges: list[dict]) -> list[dict]:
    """Per exchange: route, status, stream, calls (with validity), results sent back, errors."""
    rows = []
    for ex in exchanges:
        row = {k: ex.get(k) for k in ("n", "loop", "method", "path", "status", "seconds", "ignored_fields")}
        row["route"] = f"{ex['method']} {ex['path'].split('?', 1)[0]}"
        try:
            req = json.loads(ex["request"]) if ex["request"] else None
        except ValueError:
            req = None
        chat = ex["path"].split("?", 1)[0].rstrip("/").endswith("/chat/completions")
        if ex.get("proxy_error"):
            row["error"] = ex["proxy_error"]
        if chat and isinstance(req, dict):
            tools, choice, results, as_text = request_tools(req)
            reply = chat_reply(ex.get("content_type") or "", ex["response"])
            row.update(
                stream=bool(req.get("stream")),
                sse=reply["sse"],
                tools_offered=sorted(tools),
                tool_choice=choice,
                fields=sorted(req),
                tool_results=results,
                tool_results_as_text=as_text,
                finish_reason=reply["finish_reason"],
                content=reply["content"][:200],
                # markup with tools offered: a call the server did not parse; without: plain text
                markup_in_text=bool(MARKUP.search(reply["content"] or "")) and bool(tools) and choice != "none",
                markup_no_tools=bool(MARKUP.search(reply["content"] or "")) and not (tools and choice != "none"),
                think_tag_in_text="</think>" in (reply["content"] or "") and "<think>" not in (reply["content"] or ""),
                calls=[{**c, "invalid": check_call(c, tools)} for c in reply["calls"]],
            )
            if reply["error"] and not row.get("error"):
                row["error"] = reply["error"]
        if (ex.get("status") or 0) >= 400 and not row.get("error"):
            row["error"] = ex["response"][:1000].decode("utf-8", "replace")
        if row.get("error") or (ex.get("status") or 0) >= 400:
            row["request_body"] = ex["request"][:6000].decode("utf-8", "replace")
            row["response_body"] = ex["response"][:3000].decode("utf-8", "replace")
        rows.append(row)
    return rows


def summarize_mode(loops: list[dict], rows: list[dict], n_loops: int) -> dict:
    statuses: dict[str, int] = {}
    routes: dict[str, int] = {}
    for r in rows:
        statuses[str(r.get("status"))] = statuses.get(str(r.get("status")), 0) + 1
        routes[r["route"]] = routes.get(r["route"], 0) + 1
    model_rows = [r for r in rows if "calls" in r]
    calls = [c for r in model_rows for c in r["calls"]]
    invalid = [
        {"loop": r["loop"], "n": r["n"], "name": c.get("name"), "arguments": c.get("arguments"), "why": c["invalid"]}
        for r in model_rows
        for c in r["calls"]
        if c["invalid"]
    ]
    # tool results sent back: distinct ids over each loop's requests (the history is resent)
    sent, matched = 0, 0
    for i in range(n_loops):
        lr = [r for r in model_rows if r["loop"] == i]
        returned = {c.get("id") for r in lr for c in r["calls"]}
        ids = set()
        for r in lr:
            ids |= set(r["tool_results"])
        sent += len(ids) + max((r["tool_results_as_text"] for r in lr), default=0)
        matched += len(ids & returned)
    ended: dict[str, int] = {}
    for lp in loops:
        ended[lp["ended"]] = ended.get(lp["ended"], 0) + 1
    errors = []
    for lp in loops:
        if lp["ok"]:
            continue
        last = next((r for r in reversed(model_rows) if r["loop"] == lp["loop"]), None)
        seen = (
            "no model request was made"
            if last is None
            else f"the last answer: HTTP {last.get('status')}, finish_reason {last.get('finish_reason')}, "
            f"{len(last.get('calls') or [])} calls, text {last.get('content', '')[:80]!r}"
        )
        errors.append(f"loop {lp['loop']} ({lp['prompt']!r}): {lp['error'][:300]} [{seen}]")
    errors += [f"loop {i}: not reported (the runner died or timed out)" for i in range(len(loops), n_loops)]
    http_errors = [
        {
            "loop": r["loop"],
            "n": r["n"],
            "route": r["route"],
            "status": r.get("status"),
            "error": r.get("error"),
            "request_body": r.get("request_body"),
            "response_body": r.get("response_body"),
        }
        for r in rows
        if r.get("error") or (r.get("status") or 0) >= 400
    ]
    ignored = sorted({f.strip() for r in rows if r.get("ignored_fields") for f in r["ignored_fields"].split(",")})
    step_errors: dict[str, int] = {}  # the framework's own step errors (smolagents), by message
    for lp in loops:
        for e in lp.get("framework_step_errors") or []:
            msg = re.sub(r"^step \d+: ", "", e)[:300]
            step_errors[msg] = step_errors.get(msg, 0) + 1
    return {
        "loops": n_loops,
        "loops_reported": len(loops),
        "loops_ok": sum(1 for lp in loops if lp["ok"]),
        "ended": ended,
        "requests": len(rows),
        "model_requests": len(model_rows),
        "streamed_requests": sum(1 for r in model_rows if r.get("stream")),
        "routes": routes,
        "statuses": statuses,
        "tool_calls": len(calls),
        "valid_calls": len(calls) - len(invalid),
        "invalid_calls": invalid,
        "tool_results_sent": sent,
        "tool_results_matching_returned_ids": matched,
        "tools_executed": sum(len(lp.get("executed") or []) for lp in loops),
        "markup_in_text": sum(1 for r in model_rows if r.get("markup_in_text")),
        "markup_in_text_no_tools": sum(1 for r in model_rows if r.get("markup_no_tools")),
        "requests_without_tools": sum(1 for r in model_rows if not r.get("tools_offered")),
        "think_tag_in_text": sum(1 for r in model_rows if r.get("think_tag_in_text")),
        "finish_reasons": _count(r.get("finish_reason") for r in model_rows),
        "tool_choice_sent": sorted({json.dumps(r.get("tool_choice")) for r in model_rows}),
        "fields_sent": sorted({f for r in model_rows for f in r.get("fields") or []}),
        "ignored_fields": ignored,
        "errors": errors,
        "http_errors": http_errors,
        "framework_step_errors": step_errors,
    }


def _count(items) -> dict:
    out: dict = {}
    for x in items:
        out[str(x)] = out.get(str(x), 0) + 1
    return out


# ---------------------------------------------------------------------------------------------
# installing the frameworks


def find_python(explicit: str | None) -> str | None:
    """Python 3.12 or 3.11 (not a venv's): explicit, pyenv's, PATH's, this one's base."""
    cands = [explicit] if explicit else []
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for minor in (12, 11):
        if pyenv.is_dir():
            cands += [str(d / "bin" / "python") for d in sorted(pyenv.glob(f"3.{minor}.*"), reverse=True)]
        cands += [p for p in [shutil.which(f"python3.{minor}")] if p]
    cands.append(getattr(sys, "_base_executable", sys.executable))
    for exe in cands:
        v = python_version(exe) if exe and Path(exe).exists() else None
        if v and ((3, 11) <= v <= (3, 12) or exe == explicit):
            return exe
    return None


@dataclass
class Installed:
    ok: bool
    versions: dict
    python: str = ""
    install: str = ""
    reason: str = ""


def venv_versions(py: Path, dists: list[str]) -> dict | None:
    code = (
        "import importlib.metadata as m, json, sys\n"
        "out = {}\n"
        f"for d in {dists!r}:\n"
        "    try: out[d] = m.version(d)\n"
        "    except m.PackageNotFoundError: out[d] = None\n"
        "out['python'] = '%d.%d.%d' % sys.version_info[:3]\n"
        "print(json.dumps(out))\n"
    )
    try:
        out = run_quiet([str(py), "-c", code], timeout=60)
        v = json.loads(out.stdout) if out.returncode == 0 else None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    return v if v and v.get(dists[0]) else None


def install(fw: str, fdir: Path, args) -> Installed:
    pkgs, dists, _ = FRAMEWORKS[fw]
    venv = fdir / f"venv-{fw}"
    py = venv / "bin" / "python"
    shown = f"python3.12 -m venv {venv} && {venv}/bin/pip install {' '.join(shlex.quote(p) for p in pkgs)}"
    v = venv_versions(py, dists) if py.exists() else None
    if v is None and not args.no_install:
        base = find_python(args.python)
        if base is None:
            return Installed(False, {}, install=shown, reason="no Python 3.11 or 3.12 found")
        shown = shown.replace("python3.12", base, 1)
        log(f"installing {fw}: {shown}")
        out = run_quiet([base, "-m", "venv", "--clear", str(venv)])
        if out.returncode != 0:
            return Installed(False, {}, install=shown, reason=f"venv failed: {out.stderr[-600:]}")
        out = run_quiet([str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *pkgs], 3600)
        if out.returncode != 0:
            return Installed(False, {}, install=shown, reason=f"pip install failed: {out.stderr[-800:]}")
        v = venv_versions(py, dists)
    if v is None:
        return Installed(False, {}, install=shown, reason=f"{venv} has no {dists[0]}")
    python = v.pop("python", "")
    return Installed(True, v, python=python, install=shown.replace(str(Path.home()), "~"))


# ---------------------------------------------------------------------------------------------
# the server


def log(msg: str) -> None:
    print(f"[frameworks_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def default_model() -> Path:
    """models/clover-tiny-v3-wip as Q8_0, the file scripts/agents_check.py makes (reused)."""
    out = Path.home() / ".cache" / "clover-gguf" / "agents" / "clover-tiny-v3-wip-q8_0.gguf"
    src = DEFAULT_MODEL_DIR / "model.safetensors"
    if out.exists() and (not src.exists() or out.stat().st_mtime >= src.stat().st_mtime):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [clover_gguf_bin(), "convert", str(DEFAULT_MODEL_DIR), "-o", str(out), "--experts", "q8_0", "--force", "-q"]
    log("converting the default model: " + shlex.join(cmd))
    subprocess.run(cmd, check=True)
    return out


def server_args(args) -> list[str]:
    return ["--api-key", args.api_key, "-t", str(args.threads), "-c", str(args.ctx), "-n", str(args.n_predict)]


def shown_server_command(model: Path, args) -> str:
    m = str(model)
    with contextlib.suppress(ValueError):
        m = "~/" + str(model.relative_to(Path.home()))
    a = server_args(args)
    a[1] = "$KEY"
    return f"clover-gguf serve {m} " + " ".join(a) + " --host 127.0.0.1 --port $PORT"


def props(url: str, key: str) -> dict | None:
    req = urllib.request.Request(url + "/props", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def server_stats(p: dict | None) -> dict | None:
    stats = p.get("stats") if isinstance(p, dict) else None
    if not isinstance(stats, dict):
        return None
    keys = ("requests", "cancelled", "errors", "server_errors", "queue_timeouts", "completion_tokens")
    out = {k: stats.get(k) for k in keys if k in stats}
    for k in ("ignored_fields",):
        if k in p:
            out[k] = p[k]
        elif k in stats:
            out[k] = stats[k]
    return out


# ---------------------------------------------------------------------------------------------
# running one framework


def run_framework_mode(fw: str, mode: str, fdir: Path, proxy_url: str, args, log_path: Path) -> tuple[list, dict]:
    py = fdir / f"venv-{fw}" / "bin" / "python"
    cmd = [str(py), str(Path(__file__).resolve()), "--runner", fw, "--mode", mode, "--base", proxy_url]
    cmd += ["--key", args.api_key, "--loops", str(args.loops), "--turns", str(args.turns)]
    cmd += ["--loop-timeout", str(args.loop_timeout)]
    home = Path(tempfile.mkdtemp(prefix=f"fwcheck-{fw}-"))
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OPENAI_", "ANTHROPIC_", "LITELLM_", "LLM_", "LANGCHAIN_", "LANGSMITH_", "HF_"))
        and k not in ("VIRTUAL_ENV", "PYTHONPATH", "CLOVER_GGUF_API_KEY")
    }
    env.update(
        HOME=str(home),
        OPENAI_API_KEY=args.api_key,  # some clients insist on one; the server's key
        LLM_USER_PATH=str(home / "llm"),
        LITELLM_LOCAL_MODEL_COST_MAP="True",  # no download of the cost map (no network here)
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    results = home / "loops.jsonl"
    cmd += ["--results", str(results)]
    t0 = time.time()
    timed_out = False
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=home)
        try:
            rc = proc.wait(args.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            rc = proc.wait(30)
    loops = []
    if results.exists():
        for line in results.read_text().splitlines():
            with contextlib.suppress(ValueError):
                loops.append(json.loads(line))
    shutil.rmtree(home, ignore_errors=True)
    info = {"exit_code": rc, "timed_out": timed_out, "seconds": round(time.time() - t0, 1)}
    if rc != 0 or timed_out:
        info["stderr_tail"] = log_path.read_text(errors="replace")[-3000:]
    shown = shlex.join([f"$FRAMEWORKS_DIR/venv-{fw}/bin/python", "scripts/frameworks_check.py", *cmd[2:-2]])
    info["command"] = shown.replace(proxy_url, "http://127.0.0.1:$PROXY").replace(args.api_key, "$KEY")
    return loops, info


def run_framework(fw: str, inst: Installed, model: Path, fdir: Path, work: Path, args) -> dict:
    sys.path.insert(0, str(REPO))
    from clover_gguf.serve.local import LocalServer

    row: dict = {
        "framework": fw,
        "versions": inst.versions,
        "python": inst.python,
        "install": inst.install,
        "mechanism": MECHANISM[fw],
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "load_before": round(os.getloadavg()[0], 2),
        "modes": {},
    }
    modes = [m for m in args.modes if m == "non-streamed" or FRAMEWORKS[fw][2]]
    with LocalServer(model, *server_args(args), log_path=work / f"{fw}-server.log", startup_timeout=300) as srv:
        proxy = RecordingProxy(srv.port)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        proxy_url = f"http://127.0.0.1:{proxy.server_address[1]}"
        try:
            for mode in modes:
                log(f"{fw} {mode}: {args.loops} loops")
                start = len(proxy.exchanges)
                loops, info = run_framework_mode(fw, mode, fdir, proxy_url, args, work / f"{fw}-{mode}.log")
                time.sleep(0.5)
                exchanges = [ex for ex in proxy.exchanges[start:] if ex["mode"] == mode and ex["framework"] == fw]
                stray = [ex for ex in proxy.exchanges[start:] if ex not in exchanges]
                rows = analyze(exchanges)
                summary = summarize_mode(loops, rows, args.loops)
                if stray:
                    summary["stray_requests"] = [f"{ex['method']} {ex['path']} {ex.get('status')}" for ex in stray]
                kept = [{k: v for k, v in r.items() if k not in ("method", "path", "fields")} for r in rows]
                row["modes"][mode] = {"summary": summary, "process": info, "loops": loops, "exchanges": kept}
                if args.keep:
                    with open(work / f"{fw}-{mode}-exchanges.jsonl", "w") as f:
                        for ex in exchanges:
                            f.write(json.dumps({**ex, "request": ex["request"].decode("utf-8", "replace"),
                                                "response": ex["response"].decode("utf-8", "replace")}) + "\n")  # fmt: skip
                s = summary
                log(
                    f"{fw} {mode}: loops ok {s['loops_ok']}/{s['loops']} {s['ended']}, statuses {s['statuses']}, "
                    f"calls {s['valid_calls']}/{s['tool_calls']} valid, results sent {s['tool_results_sent']}, "
                    f"errors {len(s['errors'])}, http errors {len(s['http_errors'])} ({info['seconds']:.0f} s)"
                )
            row["server_stats"] = server_stats(props(srv.url, args.api_key))
        finally:
            proxy.shutdown()
    row["server_exit_code"] = srv.proc.returncode if srv.proc else None
    return row


# ---------------------------------------------------------------------------------------------
# the report


def fmt_counts(d: dict) -> str:
    return ", ".join(f"{k}×{v}" for k, v in sorted(d.items())) or "—"


def version_text(row: dict) -> str:
    v = row.get("versions") or {}
    items = list(v.items())
    if not items:
        return "—"
    main = f"{items[0][0]} {items[0][1]}"
    rest = ", ".join(f"{k} {x}" for k, x in items[1:])
    return f"{main} ({rest})" if rest else main


def write_reports(out_dir: Path, rows: dict, meta: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    ordered = [rows[f] for f in ORDER if f in rows]
    (out_dir / "frameworks.json").write_text(
        json.dumps({"meta": meta, "frameworks": ordered}, indent=1, default=str) + "\n"
    )
    cmds = sorted({r.get("command_line", "") for r in ordered if r.get("command_line")})
    lines = ["# Agent frameworks against `clover-gguf serve`", "", "Made by:", "", "```sh", *cmds, "```", ""]
    lines += [
        f"Server: `{meta.get('server_command', '')}` (a fresh one per framework; git {meta.get('git', '')}); "
        f"model `{meta.get('model', '')}`; {meta.get('machine', '')}. Each framework: {meta.get('loops')} loops "
        f"a mode, the {len(TASKS)} prompts below, each offering 2-3 of read_file(path), grep(pattern, path), "
        f"list_files(dir) (canned answers), temperature 0, a cap of {meta.get('turns')} model turns; through a "
        "recording proxy that validates every tool call the server returns against the schema the request "
        "sent (jsonschema).",
        "",
        "| framework | versions | mode | loops ok | ended (answer / cap / error) | requests | HTTP statuses | "
        "tool calls | valid calls | results sent back | markup in text | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ordered:
        if r.get("skipped"):
            lines.append(f"| {r['framework']} | {version_text(r)} | skipped: {r.get('reason', '')} ||||||||||")
            continue
        for mode, m in r["modes"].items():
            s = m["summary"]
            e = s["ended"]
            nerr = len(s["errors"]) + len(s["http_errors"])
            lines.append(
                f"| {r['framework']} | {version_text(r)} | {mode} | {s['loops_ok']}/{s['loops']} | "
                f"{e.get('answer', 0)} / {e.get('turn_cap', 0)} / {e.get('error', 0)} | {s['requests']} | "
                f"{fmt_counts(s['statuses'])} | {s['tool_calls']} | {s['valid_calls']} | {s['tool_results_sent']} | "
                f"{s['markup_in_text']} | {nerr} |"
            )
    done = [m["summary"] for r in ordered if not r.get("skipped") for m in r["modes"].values()]
    if done:
        statuses: dict[str, int] = {}
        for s in done:
            for k, v in s["statuses"].items():
                statuses[k] = statuses.get(k, 0) + v
        faults = sum(len(s["http_errors"]) + len(s["invalid_calls"]) + s["markup_in_text"] for s in done)
        lines += [
            "",
            f"All together: {sum(s['loops_ok'] for s in done)}/{sum(s['loops'] for s in done)} loops ok, "
            f"{sum(s['requests'] for s in done)} requests answered {fmt_counts(statuses)}, "
            f"{sum(s['valid_calls'] for s in done)}/{sum(s['tool_calls'] for s in done)} tool calls valid, "
            f"{faults} server-side faults (HTTP >= 400 or error events, invalid calls, unparsed call markup with "
            f"tools offered); {sum(len(s['errors']) for s in done)} loops raised (causes below).",
        ]
    lines += [
        "",
        "Columns: *loops ok*: loops that ended without an exception from the framework (at the model's answer "
        "or at the turn cap, which openai-agents (MaxTurnsExceeded), langgraph (GraphRecursionError), pydantic-ai "
        "(UsageLimitExceeded) and llm (ValueError: Chain limit of N exceeded) signal with an exception of their own: "
        "counted as the cap, not as an error; smolagents ends at its max_steps with a final-answer request of its "
        "own, without tools). *ended*: how the loops ended. *requests*: HTTP requests the framework sent. *tool calls*: "
        "calls in the server's answers (streamed: the deltas accumulated as a client does); *valid calls*: of "
        "those, calls of a tool the request offered whose arguments parse as a JSON object and validate "
        "against the tool's JSON schema as the framework sent it. *results sent back*: distinct tool results "
        "(`tool` messages) the framework sent in its later requests (smolagents sends them as text: one user "
        "message `Observation: ...` per step, counted once each). *markup in text*: answers whose text "
        "holds `<tool_call>` markup (a call the server did not parse). *errors*: loops that raised plus HTTP "
        "answers >= 400 or error events.",
        "",
        "Prompts (loop i uses prompt i, with the tools listed):",
        "",
    ]
    lines += [f"{i}. {p!r}: {', '.join(t)}" for i, (p, t) in enumerate(TASKS)]
    lines.append("")
    for r in ordered:
        if r.get("skipped"):
            continue
        lines += [f"## {r['framework']}", ""]
        lines.append(f"- versions: {version_text(r)}; Python {r.get('python')}; installed by `{r.get('install')}`")
        lines.append(f"- mechanism: {r.get('mechanism')}")
        for mode, m in r["modes"].items():
            s, p = m["summary"], m["process"]
            lines.append(
                f"- {mode}: {s['loops_ok']}/{s['loops']} loops ok ({fmt_counts(s['ended'])}), {s['requests']} "
                f"requests ({s['streamed_requests']} with stream: true), routes {fmt_counts(s['routes'])}, "
                f"statuses {fmt_counts(s['statuses'])}; {s['tool_calls']} tool calls returned, {s['valid_calls']} "
                f"valid; {s['tool_results_sent']} tool results sent back "
                f"({s['tool_results_matching_returned_ids']} with an id the server returned), "
                f"{s['tools_executed']} tool executions by the framework; finish reasons "
                f"{fmt_counts(s['finish_reasons'])}; tool_choice sent: {', '.join(s['tool_choice_sent'])}; "
                f"{p['seconds']:.0f} s, exit {p['exit_code']}{' (timed out)' if p['timed_out'] else ''}"
            )
            lines.append(f"  - request fields: {', '.join(s['fields_sent'])}")
            if s.get("requests_without_tools"):
                lines.append(
                    f"  - {s['requests_without_tools']} requests offered no tools (the framework's own final-answer "
                    f"call); {s.get('markup_in_text_no_tools', 0)} of their answers hold tool-call markup as text, "
                    "which is what a request without tools gets"
                )
            if s.get("think_tag_in_text"):
                lines.append(
                    f"  - {s['think_tag_in_text']} answers hold `</think>` in `content` without a `<think>` before "
                    "it (the template does not open one, so by the server's rule this is not reasoning)"
                )
            if s["ignored_fields"]:
                lines.append(
                    f"  - fields the server ignored (x-clover-ignored-fields): {', '.join(s['ignored_fields'])}"
                )
            for e in s["errors"]:
                lines.append(f"  - error: `{e[:600]}`")
            for h in s["http_errors"]:
                err = h["error"] if isinstance(h["error"], str) else json.dumps(h["error"])
                lines.append(f"  - HTTP {h['status']} on {h['route']} (loop {h['loop']}): `{str(err)[:400]}`")
            for c in s["invalid_calls"]:
                lines.append(f"  - invalid call (loop {c['loop']}): {c['name']} {c['arguments']!r}: {c['why']}")
            for e, k in s["framework_step_errors"].items():
                lines.append(f"  - the framework's own step error (logged in its memory, not raised), ×{k}: `{e}`")
            if s.get("stray_requests"):
                lines.append(f"  - requests outside a loop's base URL: {s['stray_requests']}")
        if r.get("server_stats"):
            lines.append(f"- server counters after both modes (/props): {r['server_stats']}")
        lines.append(f"- ran {r.get('date', '')} on git {r.get('git')}, load average before {r.get('load_before')}")
        lines.append("")
    (out_dir / "frameworks.md").write_text("\n".join(lines))


# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog=os.environ.get("FRAMEWORKS_CHECK_ARGV0", "frameworks_check.py"),
        description="Run agent frameworks' tool loops against clover-gguf serve behind a recording proxy.",
    )
    ap.add_argument("--only", default="", help=f"comma-separated frameworks (default all: {','.join(ORDER)})")
    ap.add_argument("--modes", default=",".join(MODES), help="non-streamed,streamed (default both)")
    ap.add_argument("--loops", type=int, default=10, help="loops per framework and mode (default 10)")
    ap.add_argument("--turns", type=int, default=4, help="the turn cap of a loop: model turns (default 4)")
    ap.add_argument("--model", type=Path, help="GGUF to serve (default: models/clover-tiny-v3-wip as Q8_0)")
    ap.add_argument("--threads", type=int, default=1, help="server threads, -t (default 1)")
    ap.add_argument("--ctx", type=int, default=8192, help="server context, -c (default 8192)")
    ap.add_argument("--n-predict", type=int, default=512, help="server -n: most tokens of one reply (default 512)")
    ap.add_argument("--api-key", default="frameworks-check-key", help="the server's API key")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for one framework's mode (default 1800)")
    ap.add_argument("--loop-timeout", type=float, default=600, help="seconds for one loop (default 600)")
    ap.add_argument(
        "--frameworks-dir",
        type=Path,
        default=Path(os.environ.get("FRAMEWORKS_DIR") or "~/.cache/clover-gguf/frameworks"),
        help="where the venvs (venv-NAME) are (default ~/.cache/clover-gguf/frameworks)",
    )
    ap.add_argument("--python", help="Python (3.11 or 3.12) for the venvs (default: searched, pyenv's first)")
    ap.add_argument("--out", type=Path, default=REPO / "evaldata" / "frameworks", help="where the reports go")
    ap.add_argument("--keep", type=Path, help="keep server logs, runner logs and every exchange here")
    ap.add_argument("--no-install", action="store_true", help="use installed frameworks only")
    ap.add_argument("--install-only", action="store_true", help="install the frameworks and exit")
    ap.add_argument("--fresh", action="store_true", help="drop earlier rows of frameworks.json instead of merging")
    ap.add_argument("--report-only", action="store_true", help="rewrite frameworks.md from frameworks.json")
    # the runner, inside a framework's venv
    ap.add_argument("--runner", choices=ORDER, help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--base", help=argparse.SUPPRESS)
    ap.add_argument("--key", help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.runner:
        return args
    args.frameworks_dir = args.frameworks_dir.expanduser()
    names = [ALIASES.get(a.strip(), a.strip()) for a in args.only.split(",") if a.strip()] or ORDER
    bad = [a for a in names if a not in ORDER]
    if bad:
        ap.error(f"unknown framework(s) {bad}; known: {ORDER}")
    args.frameworks = [a for a in ORDER if a in names]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in MODES for m in args.modes):
        ap.error(f"--modes takes {','.join(MODES)}")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.runner:
        return runner_main(args)
    command_line = shlex.join([os.environ.get("FRAMEWORKS_CHECK_ARGV0", "python scripts/frameworks_check.py"), *argv])
    results_path = args.out / "frameworks.json"
    if args.report_only:
        data = json.loads(results_path.read_text())
        write_reports(args.out, {r["framework"]: r for r in data["frameworks"]}, data["meta"])
        return 0
    fdir = args.frameworks_dir
    fdir.mkdir(parents=True, exist_ok=True)
    installed = {}
    for fw in args.frameworks:
        installed[fw] = install(fw, fdir, args)
        i = installed[fw]
        log(f"{fw}: {version_text({'versions': i.versions}) if i.ok else 'NOT AVAILABLE: ' + i.reason}")
    if args.install_only:
        return 0 if all(i.ok for i in installed.values()) else 1

    model = (args.model or default_model()).resolve()
    work = args.keep.resolve() if args.keep else Path(tempfile.mkdtemp(prefix="frameworks-check-"))
    work.mkdir(parents=True, exist_ok=True)
    rows: dict = {}
    if results_path.exists() and not args.fresh:
        with contextlib.suppress(ValueError, KeyError):
            rows = {r["framework"]: r for r in json.loads(results_path.read_text())["frameworks"]}
    meta = {
        "command_line": command_line,
        "server_command": shown_server_command(model, args),
        "model": str(model.relative_to(REPO)) if model.is_relative_to(REPO) else model.name,
        "git": git_describe(),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
        "loops": args.loops,
        "turns": args.turns,
        "tasks": [{"prompt": p, "tools": t} for p, t in TASKS],
        "tool_schemas": SCHEMAS,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    try:
        for fw in args.frameworks:
            inst = installed[fw]
            if not inst.ok:
                rows[fw] = {"framework": fw, "skipped": True, "reason": inst.reason, "install": inst.install}
                rows[fw]["command_line"] = command_line
                continue
            for attempt in (1, 2):
                git = git_describe()  # the server runs the working tree as it is now
                try:
                    row = run_framework(fw, inst, model, fdir, work, args)
                    break
                except Exception as e:  # the server did not start: say so, go on
                    log(f"{fw}: {type(e).__name__}: {e}")
                    row = {"framework": fw, "versions": inst.versions, "skipped": True, "reason": f"{e}"[:1000]}
                    if attempt == 1:  # a tree being edited may not import for a moment: once more
                        log(f"{fw}: trying once more in 30 s")
                        time.sleep(30)
            row["command_line"] = command_line
            row["git"] = git
            rows[fw] = row
            write_reports(args.out, rows, meta)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    write_reports(args.out, rows, meta)
    log(f"wrote {results_path} and {args.out / 'frameworks.md'}")
    bad = [
        f
        for f in args.frameworks
        if rows[f].get("skipped")
        or any(
            m["summary"]["loops_ok"] < m["summary"]["loops"]
            or m["summary"]["http_errors"]
            or m["summary"]["valid_calls"] < m["summary"]["tool_calls"]
            or m["summary"]["markup_in_text"]
            for m in rows[f]["modes"].values()
        )
    ]
    if bad:
        log(f"not clean: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
