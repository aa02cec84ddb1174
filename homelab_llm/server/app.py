"""The FastAPI app: the OpenAI routes plus /health, /v1/status and /metrics, the guards of
middleware.py (error ids for our bugs, Host allow-list, API key), and error handlers that keep
every failure in OpenAI's shape (never a bare 500 for client input)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from operator import methodcaller
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from homelab_llm import __version__
from homelab_llm.server.client_base import ClientBase, Engine, EngineNotReady
from homelab_llm.server.engine_client import EngineClient
from homelab_llm.server.errors import APIError, bad_request, error_response, unavailable
from homelab_llm.server.generation import ClientGone
from homelab_llm.server.hosts import allowed_host_names
from homelab_llm.server.metrics import CONTENT_TYPE, render_metrics
from homelab_llm.server.middleware import (APIKeyMiddleware, HostAllowListMiddleware,
                                           InternalErrorMiddleware)
from homelab_llm.server.openai import router, server_state
from homelab_llm.server.state import ServerConfig, ServerState
from homelab_llm.server.stats import ServerStats
from homelab_llm.server.status import build_status
from homelab_llm.load_progress import LOAD


async def engine_status(state: ServerState) -> dict[str, Any]:
    try:
        # methodcaller, not a lambda: it must pickle to reach an engine process.
        return await state.client.call(methodcaller("status"))
    except EngineNotReady as err:
        raise unavailable(str(err)) from err


def build_app(config: ServerConfig, engine_factory: Callable[[], Engine],
              stats: ServerStats | None = None, engine_process: bool = False) -> FastAPI:
    """With engine_process the engine runs in its own process (engine_process.py; the factory
    must pickle), else in a thread of this one."""
    stats = stats or ServerStats()
    client: ClientBase
    if engine_process:
        from homelab_llm.server.engine_process import ProcessEngineClient

        client = ProcessEngineClient(engine_factory, observer=stats.observe)
    else:
        client = EngineClient(engine_factory, observer=stats.observe)
    state = ServerState(config, client, stats)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.client.start()
        yield
        await state.client.shutdown()

    app = FastAPI(title="homelab-llm", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.server = state
    app.include_router(router)
    # Added innermost first: a request meets the error catcher, then the Host check, then the key.
    app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    app.add_middleware(HostAllowListMiddleware,
                       allowed=allowed_host_names(config.host, config.allowed_hosts))
    app.add_middleware(InternalErrorMiddleware)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, err: APIError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, err: HTTPException) -> JSONResponse:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        message = (f"no route {request.method} {request.url.path}"
                   if err.status_code in (404, 405) else str(err.detail))
        return error_response(APIError(err.status_code, message, kind, None, None,
                                       dict(err.headers or {})))

    @app.exception_handler(ClientGone)
    async def on_client_gone(request: Request, err: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        return error_response(bad_request(str(err)))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        client = state.client
        if client.state == "dead":  # before draining: the exit that follows is not a drain
            body, code = {"status": "dead", "reason": client.dead_reason}, 503
        elif state.draining:
            body, code = {"status": "draining"}, 503
        elif client.state == "ready":
            body, code = {"status": "ok"}, 200
        elif client.state == "failed":
            body, code = {"status": "failed", "error": client.load_error}, 503
        else:
            body, code = {"status": "loading", **LOAD.snapshot()}, 503
        return Response(json.dumps(body), status_code=code, media_type="application/json")

    @app.get("/v1/status")
    async def status(request: Request) -> JSONResponse:
        s = server_state(request)
        return JSONResponse(build_status(await engine_status(s), s.stats))

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        s = server_state(request)
        # Scrapers want a 200 even while loading: engine gauges read zero until it is up.
        engine = await engine_status(s) if s.client.state == "ready" else {}
        return Response(render_metrics(engine, s.stats, s.model_name), media_type=CONTENT_TYPE)

    return app
