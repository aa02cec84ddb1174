"""Server-sent events for streaming completions: `data: {json}\\n\\n` frames ending in
`data: [DONE]`, and a response that always runs its cleanup, even if the client left before the
first byte (a never-started async generator would skip its own `finally`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from homelab_llm.server.errors import APIError

DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_error(err: APIError) -> str:
    return sse(err.body())


class SSEResponse(StreamingResponse):
    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close  # public: a response that wraps this stream passes it on

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
