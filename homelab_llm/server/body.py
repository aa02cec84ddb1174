"""Reading a request's JSON body so that nothing a client sends can become a 500 or stall the
server: the content type must be JSON (a `text/plain` body is what a web page can send without a
CORS preflight, so it is never parsed), the size is capped while reading (413), and every way
JSON decoding can fail is a 400: syntax, bad UTF-8, NaN/Infinity (not JSON), a 5,000-digit
number (Python's int conversion limit), or nesting deep enough to exhaust the recursion limit.
Decoding stays on the event loop: the C decoder holds the GIL, so a thread would not let the loop
run meanwhile; the size cap is what bounds it (a 10 MB prompt string decodes in milliseconds)."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from homelab_llm.server.errors import bad_request, payload_too_large, unsupported_media_type


def check_json_content_type(request: Request) -> None:
    given = request.headers.get("content-type", "")
    media = given.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/")
                                            and media.endswith("+json")):
        raise unsupported_media_type(given)


async def read_capped(request: Request, limit: int) -> bytes:
    """The whole body, or a 413 as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise payload_too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise payload_too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def decode_json(raw: bytes) -> Any:
    try:
        return json.loads(raw, parse_constant=_not_json)
    except RecursionError as err:
        raise bad_request("the request body is not valid JSON: it nests too deeply") from err
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, int digit limit, NaN
        raise bad_request(f"the request body is not valid JSON: {str(err)[:200]}") from err


async def read_json(request: Request, limit: int) -> Any:
    check_json_content_type(request)
    return decode_json(await read_capped(request, limit))
