"""OpenAI-shaped HTTP errors: every failure a client can see has one body shape,
`{"error": {"message", "type", "param", "code"}}`, and a status code that says whose fault it is.
A bug of ours (`internal_error`) shows the client only an error id; the log holds the traceback
under that id, so exception text never leaks into a response."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import JSONResponse

log = logging.getLogger("homelab_llm.server")


@dataclass
class APIError(Exception):
    """Raised anywhere in a handler; the app turns it into a JSON response (or an SSE error event
    once a stream has begun)."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unauthorized() -> APIError:
    return APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    "authentication_error", None, "invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def model_not_found(name: str, served: list[str]) -> APIError:
    return APIError(404, f"the model {name!r} does not exist; this server serves {served}",
                    "invalid_request_error", "model", "model_not_found")


def queue_full(limit: int, retry_after_s: int = 1) -> APIError:
    return APIError(429, f"the request queue is full ({limit} waiting); retry shortly",
                    "rate_limit_error", None, "queue_full",
                    headers={"Retry-After": str(retry_after_s)})


def unavailable(message: str, retry_after_s: int = 5) -> APIError:
    return APIError(503, message, "service_unavailable", None, "service_unavailable",
                    headers={"Retry-After": str(retry_after_s)})


def engine_failure(message: str) -> APIError:
    # The engine failed while serving a valid request: our fault, not the client's.
    return APIError(500, f"the engine failed: {message}", "server_error", None, "engine_error")


def payload_too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body has {size} bytes or more, above this server's limit of "
                         f"{limit} bytes (--max-request-body-bytes)", "invalid_request_error",
                    None, "request_too_large")


def unsupported_media_type(given: str) -> APIError:
    return APIError(415, f"send the body as JSON with 'Content-Type: application/json' "
                         f"(got {given or 'no content type'!r})", "invalid_request_error", None,
                    "unsupported_media_type")


def internal_error(err: BaseException, where: str) -> APIError:
    """Log `err` with its traceback under a fresh id and return the 500 the client sees."""
    error_id = f"err-{uuid.uuid4().hex[:12]}"
    log.error("internal error %s on %s", error_id, where, exc_info=err)
    return APIError(500, f"internal server error (id {error_id}; the server log has the details)",
                    "server_error", None, "internal_error")
