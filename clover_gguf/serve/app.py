"""The HTTP app of `clover-gguf serve` (FastAPI): the route table of serve/api/, authentication,
errors in each API's shape, and the server's own routes: GET /health, GET /v1/models, GET /props
(configuration and counters, as llama-server), GET /metrics (Prometheus text, llama-server's
names)."""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .api import ERROR_SHAPES, ROUTES
from .decoding import CLOVER_FIELDS
from .engine import Engine
from .fields import FieldProblem
from .http import ApiKey, BadRequest, error_response
from .server import DEFAULT_N_PREDICT, DEFAULT_QUEUE_TIMEOUT, Server, ServerConfig
from .tools import FieldError

__all__ = ["DEFAULT_N_PREDICT", "DEFAULT_QUEUE_TIMEOUT", "ServerConfig", "create_app"]


def _shape(path: str):
    """The error response maker of the API that serves `path`."""
    return next((f for prefix, f in ERROR_SHAPES.items() if path.startswith(prefix)), error_response)


def _endpoint(srv: Server, handler):
    async def endpoint(request: Request):
        return await handler(srv, request)

    return endpoint


def create_app(engine: Engine, config: ServerConfig, log=None) -> FastAPI:
    """The app; `log(line)` gets one line of counters at shutdown and the ignored fields."""
    from contextlib import asynccontextmanager

    from .metrics import prometheus_text

    srv = Server(engine, config, log)
    rt = engine.rt

    @asynccontextmanager
    async def lifespan(app):
        await asyncio.to_thread(srv.prep.wait_ready)
        engine.start()
        yield
        await asyncio.to_thread(engine.close)
        srv.prep.close()
        if log is not None:
            st = engine.stats()
            log(
                f"clover-gguf serve: stopped after {st['requests']} requests ({st['cancelled']} cancelled, "
                f"{st['errors']} errors), {st['sequence_steps']} denoising steps, "
                f"{st['completion_tokens']} tokens returned"
            )

    app = FastAPI(title="clover-gguf", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = srv

    def refuse(request: Request, e: BadRequest):
        if e.status == 500:
            srv.http["server_errors"] += 1
        return _shape(request.url.path)(e)

    @app.exception_handler(BadRequest)
    async def _bad(request, e: BadRequest):
        return refuse(request, e)

    @app.exception_handler(FieldError)
    async def _field(request, e: FieldError):
        return refuse(request, BadRequest(str(e), e.param))

    @app.exception_handler(FieldProblem)
    async def _problem(request, e: FieldProblem):
        return refuse(request, BadRequest(str(e), e.param, e.code))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e):
        return refuse(request, BadRequest(str(e.detail), code=str(e.status_code), status=e.status_code))

    @app.exception_handler(Exception)
    async def _bug(request, e: Exception):  # a bug: said as JSON (uvicorn logs the traceback)
        return refuse(request, BadRequest(f"{type(e).__name__}: {e}", code="server_error", status=500))

    if config.api_key:
        app.add_middleware(ApiKey, key=config.api_key, refuse=lambda path, e: _shape(path)(e))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        meta = {"n_vocab": rt.n_vocab, "n_layer": rt.n_layer, "block_size": rt.default_block_size}
        model = {"id": config.model_id, "object": "model", "created": int(time.time()), "owned_by": "clover-gguf"}
        return {"object": "list", "data": [model | {"meta": meta | {"n_ctx": config.ctx_size}}]}

    @app.get("/props")
    async def props():
        return {
            "config": config.public(),
            "model": {"block_size": rt.default_block_size, "n_ubatch": rt.n_ubatch, "threads": rt.n_threads},
            "clover_fields": CLOVER_FIELDS,
            "ignored_fields": dict(srv.ignored),
            "stats": engine.stats() | srv.http | srv.prep.stats(),
        }

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(engine.stats() | srv.http), media_type="text/plain; version=0.0.4")

    for method, path, handler in ROUTES:
        app.add_api_route(path, _endpoint(srv, handler), methods=[method])
    return app
