"""The ASGI guards around every route, outermost first:

- `InternalErrorMiddleware`: an exception no handler took becomes a 500 with an error id (the log
  has the traceback), sent as a normal response, so the keep-alive connection survives. Starlette's
  own last-resort handler re-raises after answering, and uvicorn then drops the connection.
- `HostAllowListMiddleware`: on a loopback bind only loopback names (and the bound host, and
  `--allowed-hosts`) may appear in the Host header. A web page that rebinds its own DNS name to
  127.0.0.1 still sends its own name, so it gets a 421 instead of our API (DNS rebinding).
- `APIKeyMiddleware`: `Authorization: Bearer KEY` (scheme case-insensitive, as RFC 7235 says).

All are pure ASGI (not BaseHTTPMiddleware) so streaming and disconnect detection pass through."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from homelab_llm.server.errors import (APIError, error_response, internal_error,
                                       unauthorized)
from homelab_llm.server.hosts import host_name

# /health answers load balancers and the TUI before a key is known; /metrics stays open for
# Prometheus scrapers, as in vLLM. Everything else needs the key when one is set.
OPEN_PATHS = frozenset({"/health", "/metrics"})


async def _send_error(err: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    await error_response(err)(scope, receive, send)


class InternalErrorMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as err:  # noqa: BLE001 - the last line of defence, logged with an id
            api_error = internal_error(err, f"{scope['method']} {scope['path']}")
            if not started:  # once a response began, its status line is gone: only the log has it
                await _send_error(api_error, scope, receive, send)


class HostAllowListMiddleware:
    def __init__(self, app: ASGIApp, allowed: frozenset[str] | None) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.allowed is None or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = dict(scope["headers"]).get(b"host")
        # No Host header at all is an HTTP/1.0 tool, not a browser: browsers always send one.
        if raw is None or host_name(raw.decode("latin-1")) in self.allowed:
            await self.app(scope, receive, send)
            return
        name = raw.decode("latin-1")[:200]
        await _send_error(APIError(421, f"the Host header {name!r} is not allowed on this "
                                        f"loopback server; add it with --allowed-hosts",
                                   "invalid_request_error", None, "host_not_allowed"),
                          scope, receive, send)


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            await self.app(scope, receive, send)
            return
        await _send_error(unauthorized(), scope, receive, send)
