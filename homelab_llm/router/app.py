"""The router's HTTP face: OpenAI routes whose `model` names a preset.

- GET /v1/models: every routable preset, by name (and its state);
- POST /v1/...: the body's `model` picks the preset (the settings file's default_preset when a
  request names none); the preset starts if it is not running, then the request is proxied,
  `model` rewritten to the id the server answers to. A stream gets `: loading` SSE comments
  while it waits, so clients and proxies do not time out on a cold start;
- a preset that cannot start: 503 naming it and its reason (an SSE error event once a stream
  has begun); an unknown model: 404 listing the presets;
- GET /health: the router itself; GET /router/status: each preset's state, for the TUI.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from homelab_llm.router.pool import Pool, Slot, StartError, upstream_auth
from homelab_llm.server.errors import APIError, bad_request, model_not_found, unavailable
from homelab_llm.server.sse import SSEResponse, sse_error

KEEPALIVE_S = 2.0
FIRST_WAIT_S = 0.5  # a start that fails this fast still gets a plain 503, not a stream
# Response headers that describe the upstream connection, not the body we pass on.
HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive",
                         "content-encoding", "server", "date"})


def error(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def build_router_app(pool: Pool, *, default_preset: str = "", keepalive_s: float = KEEPALIVE_S,
                     unload_every_s: float = 1.0) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
        reaper = asyncio.create_task(pool.unload_loop(unload_every_s))
        try:
            yield
        finally:
            reaper.cancel()
            await app.state.client.aclose()
            await pool.shutdown()

    app = FastAPI(title="homelab-llm router", lifespan=lifespan)
    app.state.pool = pool

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "homelab-llm",
             "backend": slot.preset.backend, "state": slot.state.value}
            for name, slot in sorted(pool.slots.items())]}

    @app.get("/router/status")
    async def status() -> dict[str, Any]:
        return {name: {"state": s.state.value, "url": s.url, "in_flight": s.in_flight,
                       "claim_bytes": s.claim_bytes, "message": s.manager.status.message}
                for name, s in sorted(pool.slots.items())}

    @app.post("/v1/{path:path}")
    async def route(path: str, request: Request) -> Response:
        try:
            body = json.loads(await request.body() or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error(bad_request("the request body is not JSON"))
        if not isinstance(body, dict):
            return error(bad_request("the request body must be a JSON object"))
        name = body.get("model") or default_preset
        if not name:
            return error(bad_request("give `model`: one of the presets in /v1/models", "model"))
        if name not in pool.slots:
            return error(model_not_found(str(name), sorted(pool.slots)))
        acquiring = asyncio.create_task(pool.acquire(name))
        if body.get("stream"):
            await asyncio.wait({acquiring}, timeout=FIRST_WAIT_S)
            if not (acquiring.done() and acquiring.exception()):
                return stream(request.app.state.client, acquiring, name, f"/v1/{path}", body)
        try:
            slot = await acquiring
        except StartError as err:
            return error(unavailable(str(err)))
        try:
            return await forward(request.app.state.client, slot, f"/v1/{path}", body)
        finally:
            pool.release(slot)

    def upstream_body(slot: Slot, body: dict[str, Any]) -> dict[str, Any]:
        return {**body, "model": slot.upstream_model} if slot.upstream_model else body

    async def forward(client: httpx.AsyncClient, slot: Slot, path: str,
                      body: dict[str, Any]) -> Response:
        try:
            r = await client.post(slot.url + path, json=upstream_body(slot, body),
                                  headers=upstream_auth(slot.preset))
        except httpx.HTTPError as err:
            return error(unavailable(f"preset {slot.preset.name!r} did not answer ({err})"))
        headers = {k: v for k, v in r.headers.items() if k.lower() not in HOP_HEADERS}
        return Response(r.content, status_code=r.status_code, headers=headers)

    def stream(client: httpx.AsyncClient, acquiring: asyncio.Task[Slot], name: str, path: str,
               body: dict[str, Any]) -> SSEResponse:
        async def events() -> AsyncIterator[str | bytes]:
            while not acquiring.done():  # a comment now, then one per keepalive_s
                yield f": loading {name}\n\n"
                await asyncio.wait({acquiring}, timeout=keepalive_s)
            try:
                slot = acquiring.result()
            except StartError as err:
                yield sse_error(unavailable(str(err)))
                return
            try:
                async with client.stream("POST", slot.url + path, json=upstream_body(slot, body),
                                         headers=upstream_auth(slot.preset)) as r:
                    if r.status_code != 200:
                        text = (await r.aread()).decode(errors="replace")
                        yield sse_error(APIError(r.status_code, f"preset {slot.preset.name!r}: {text[:500]}",
                                                 "upstream_error"))
                        return
                    async for chunk in r.aiter_raw():
                        yield chunk
            except httpx.HTTPError as err:
                yield sse_error(unavailable(f"preset {slot.preset.name!r} stopped answering ({err})"))

        def close() -> None:
            if not acquiring.done():
                acquiring.cancel()  # acquire releases its own count when cancelled
            elif not acquiring.cancelled() and acquiring.exception() is None:
                pool.release(acquiring.result())

        return SSEResponse(events(), close)

    return app
