"""The FastAPI app: the OpenAI routes plus /health, /v1/status and /metrics, API-key checks, and
error handlers that keep every failure in OpenAI's shape (never a bare 500 for client input)."""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from homelab_llm import __version__
from homelab_llm.server.engine_client import EngineClient, EngineNotReady
from homelab_llm.server.errors import APIError, bad_request, unauthorized, unavailable
from homelab_llm.server.metrics import CONTENT_TYPE, render_metrics
from homelab_llm.server.openai import router, server_state
from homelab_llm.server.state import ServerConfig, ServerState
from homelab_llm.server.stats import ServerStats
from homelab_llm.server.status import build_status
from homelab_llm.load_progress import LOAD

log = logging.getLogger("homelab_llm.server")

# /health answers load balancers and the TUI before a key is known; /metrics stays open for
# Prometheus scrapers, as in vLLM. Everything else needs the key when one is set.
OPEN_PATHS = frozenset({"/health", "/metrics"})


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class APIKeyMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware) so streaming and disconnect detection pass through."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        await error_response(unauthorized())(scope, receive, send)


async def engine_status(state: ServerState) -> dict[str, Any]:
    try:
        return await state.client.call(lambda engine: engine.status())
    except EngineNotReady as err:
        raise unavailable(str(err)) from err


def build_app(config: ServerConfig, engine_factory: Callable[[], Any],
              stats: ServerStats | None = None) -> FastAPI:
    stats = stats or ServerStats()
    state = ServerState(config, EngineClient(engine_factory, observer=stats.observe), stats)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.client.start()
        yield
        await state.client.shutdown()

    app = FastAPI(title="homelab-llm", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.server = state
    app.include_router(router)
    app.add_middleware(APIKeyMiddleware, api_key=config.api_key)

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

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        return error_response(bad_request(str(err)))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, err: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, f"internal error: {type(err).__name__}: {err}",
                                       "server_error", None, "internal_error"))

    @app.get("/health")
    async def health() -> Response:
        client = state.client
        if state.draining:
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
