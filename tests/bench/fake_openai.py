"""A scripted OpenAI-compatible server for the bench tests, two ways:

- `FakeTransport`: an httpx transport on a virtual clock. The stream advances the clock by each
  event's delay just before handing the event over, and the client reads the clock right after
  it arrives, so measured times equal the injected ones exactly (the arithmetic test).
- `serve_fake()`: the same script over a real socket on 127.0.0.1 (ephemeral port) with real
  sleeps, for the cancellation and CLI tests.

Prompt tokens are words (the fake /tokenize counts words too), and a toy prefix cache reports
`cached_tokens` for the leading messages it has seen before, as a radix cache would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx


@dataclass
class Script:
    latency: float = 0.0  # before the response headers, every route (the no-work round trip)
    prefill_per_token: float = 0.0  # prefill time = uncached prompt tokens * this
    prefill_fixed: float = 0.0
    first_token_gap: float = 0.0  # role-only chunk -> first text chunk
    itl: float = 0.0  # between text chunks
    usage_gap: float = 0.0  # last text chunk -> usage chunk
    tokens: int | None = None  # output tokens (default: max_tokens)
    send_usage: bool = True
    send_role_chunk: bool = True
    tokenize: bool = True
    fail_status: int | None = None  # answer every chat request with this HTTP status


@dataclass
class FakeOpenAI:
    script: Script = field(default_factory=Script)
    seen: list[list[tuple[str, str]]] = field(default_factory=list)  # message lists, for caching
    requests: list[dict] = field(default_factory=list)
    aborted: int = 0  # streams whose client went away (socket server only)

    def route(self, method: str, path: str, body: bytes) -> tuple[int, list[tuple[float, bytes]]]:
        """(status, [(delay before, bytes)]) for one request."""
        s = self.script
        if method == "GET" and path == "/v1/models":
            return 200, [(s.latency, json.dumps({"object": "list", "data": [
                {"id": "fake-model", "object": "model"}]}).encode())]
        data = json.loads(body or b"{}")
        if method == "POST" and path == "/tokenize" and s.tokenize:
            return 200, [(0.0, json.dumps({"count": len(data["prompt"].split())}).encode())]
        if method == "POST" and path == "/v1/chat/completions":
            self.requests.append(data)
            if s.fail_status:
                return s.fail_status, [(s.latency, json.dumps(
                    {"error": {"message": "scripted failure", "code": s.fail_status}}).encode())]
            return 200, self._stream(data)
        return 404, [(0.0, b'{"detail": "Not Found"}')]

    def _stream(self, data: dict) -> list[tuple[float, bytes]]:
        s = self.script
        msgs = [(m["role"], m["content"]) for m in data["messages"]]
        prompt = sum(len(c.split()) for _, c in msgs)
        cached = self._cached(msgs)
        self.seen.append(msgs)
        n = s.tokens if s.tokens is not None else data.get("max_tokens", 16)
        ev: list[tuple[float, bytes]] = []
        prefill = s.latency + s.prefill_fixed + (prompt - cached) * s.prefill_per_token

        def chunk(delta: dict, finish: str | None = None) -> bytes:
            return _sse({"id": "c1", "object": "chat.completion.chunk", "model": "fake-model",
                         "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

        if s.send_role_chunk:
            ev.append((prefill, chunk({"role": "assistant", "content": ""})))
            first = s.first_token_gap
        else:
            first = prefill + s.first_token_gap
        for i in range(n):
            ev.append((first if i == 0 else s.itl,
                       chunk({"content": f" w{i}"}, "length" if i == n - 1 else None)))
        if s.send_usage:
            ev.append((s.usage_gap, _sse({"id": "c1", "choices": [], "usage": {
                "prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n,
                "prompt_tokens_details": {"cached_tokens": cached}}})))
        ev.append((0.0, b"data: [DONE]\n\n"))
        return ev

    def _cached(self, msgs: list[tuple[str, str]]) -> int:
        """Words of the longest run of leading messages some earlier request started with;
        the last message (the new turn) never counts."""
        best = 0
        for old in self.seen:
            words = 0
            for a, b in zip(old, msgs[:-1]):
                if a != b:
                    break
                words += len(a[1].split())
            best = max(best, words)
        return best


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class _Stream(httpx.AsyncByteStream):
    def __init__(self, events: list[tuple[float, bytes]], clock: VirtualClock) -> None:
        self.events, self.clock = events, clock

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for delay, data in self.events:
            self.clock.advance(delay)
            yield data


class FakeTransport(httpx.AsyncBaseTransport):
    def __init__(self, server: FakeOpenAI, clock: VirtualClock) -> None:
        self.server, self.clock = server, clock

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        status, events = self.server.route(request.method, request.url.path, body)
        if status != 200 or not request.url.path.endswith("/completions"):
            delay, data = events[0]
            self.clock.advance(delay)
            return httpx.Response(status, content=data)
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              stream=_Stream(events, self.clock))


@contextlib.asynccontextmanager
async def serve_fake(server: FakeOpenAI) -> AsyncIterator[str]:
    """Serve `server` on 127.0.0.1:<ephemeral> in this event loop; yields the base URL."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:  # one request per connection ("connection: close") keeps EOF detection simple
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.lower(): v.strip() for k, v in
                       (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
            body = await reader.readexactly(int(headers.get("content-length", 0)))
            status, events = server.route(method, path, body)
            writer.write(f"HTTP/1.1 {status} X\r\ncontent-type: text/event-stream\r\n"
                         "transfer-encoding: chunked\r\nconnection: close\r\n\r\n".encode())
            gone = asyncio.ensure_future(reader.read(1))  # b"" once the client hangs up
            try:
                for delay, data in events:
                    await asyncio.wait({gone}, timeout=delay)
                    if gone.done():  # the client went away: abort, as real servers do
                        server.aborted += 1
                        return
                    writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
                await writer.drain()
            finally:
                gone.cancel()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def watch(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(handle(reader, writer))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    tasks: set[asyncio.Task] = set()
    srv = await asyncio.start_server(watch, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await srv.wait_closed()


class FakeServerThread:
    """`serve_fake` on its own event loop in a thread, for code that calls asyncio.run itself
    (the CLI) or for subprocesses. Use as a context manager; `.url` is the base URL."""

    def __init__(self, server: FakeOpenAI) -> None:
        import threading

        self.server = server
        self.url = ""
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    def _main(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            async with serve_fake(self.server) as url:
                self.url = url
                self._ready.set()
                await self._stop.wait()

        asyncio.run(main())

    def __enter__(self) -> "FakeServerThread":
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fake server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
