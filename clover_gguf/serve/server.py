"""What every front door of `clover-gguf serve` reads: the configuration, the runtime and its
engine, the limits requests are checked against, the HTTP counters, the tool calls the server
generated (state reuse), and the fields it ignored."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse

from . import fields
from . import logprobs as lp
from .chat import CallMemory
from .decoding import Limits
from .engine import Engine
from .http import Pending, read_json
from .prep import Prep, step_budget

DEFAULT_N_PREDICT = 8192  # the server's limit on the tokens of one reply (--n-predict)
DEFAULT_QUEUE_TIMEOUT = 300.0  # seconds a request may wait for a sequence (--queue-timeout)
IGNORED_HEADER = "x-clover-ignored-fields"
MAX_IGNORED_NAMES = 256  # distinct ignored field names /props lists (a client could invent endless ones)


@dataclass
class ServerConfig:
    model_path: str
    model_id: str
    ctx_size: int
    api_key: str | None = None
    parallel: int = 1
    ctx_cache: int = 16
    threads: int | None = None
    n_gpu_layers: int = 0
    experts_on_cpu: bool = False
    host: str = "127.0.0.1"
    port: int = 8080
    rpc: list[str] = field(default_factory=list)
    placement: dict = field(default_factory=dict)  # CloverRuntime.placement: layers and buffers per device
    n_predict: int = DEFAULT_N_PREDICT  # tokens of one reply at most; the default for chat
    queue_timeout: float | None = DEFAULT_QUEUE_TIMEOUT  # None: wait for ever
    extra: dict = field(default_factory=dict)

    def public(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "api_key"}
        d["api_key"] = bool(self.api_key)
        return d


class Server:
    def __init__(self, engine: Engine, config: ServerConfig, log=None):
        self.engine, self.config, self.log = engine, config, log
        self.rt = rt = engine.rt
        rt.tokenize("<|im_start|>")  # the special-token table and the longest token, once, at startup
        assert rt.max_token_bytes > 0
        self.limits = Limits(config.ctx_size, rt.n_ubatch, rt.default_block_size, config.n_predict, rt.n_vocab)
        self.pieces = lp.Pieces(rt)
        self.http = {"queue_timeouts": 0, "server_errors": 0}  # counted here, not by the engine
        self.calls = CallMemory()
        # template rendering and constraint building, in worker processes (serve/prep.py)
        self.prep = Prep(config.model_path, step_budget(rt), n=max(2, config.parallel))
        self.ignored: Counter[str] = Counter()
        self._lock = threading.Lock()

    def pending(self, request: Request) -> Pending:
        return Pending(request, self.engine, self.config.queue_timeout, self.http)

    async def read(self, request: Request, table: dict) -> tuple[dict, list[str]]:
        """A route's body, checked against its field table: (body, the fields ignored)."""
        body = await read_json(request)
        ignored = fields.check_fields(body, table)
        fields.check_model(body)
        return body, ignored

    def ignore(self, names: list[str]) -> dict:
        """Note fields a request sent that no table knows: logged the first time each is seen,
        counted for /props; returns the answer's header naming them ({} when none)."""
        if not names:
            return {}
        new = []
        with self._lock:
            for n in names:
                if n not in self.ignored and len(self.ignored) >= MAX_IGNORED_NAMES:
                    continue
                new += [n] if n not in self.ignored else []
                self.ignored[n] += 1
        if new and self.log is not None:
            self.log(f"clover-gguf serve: ignoring request fields no table knows: {', '.join(new)}")
        return {IGNORED_HEADER: ", ".join(names)[:2000]}

    def headers(self, route: str, ignored: list[str], left_out: list[str], why: str) -> dict:
        """The answer's headers naming the fields ignored and the tools left out of the prompt
        (`why` they were: server tools, not functions), the latter logged."""
        h = self.ignore(ignored)
        if left_out:
            h["x-clover-left-out-tools"] = ", ".join(left_out)[:2000]
            if self.log is not None:
                self.log(f"clover-gguf serve: {route}: tools left out of the prompt ({why}): {', '.join(left_out)}")
        return h

    def json(self, body: dict, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(body, headers=headers or None)
