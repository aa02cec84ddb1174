"""The dashboard's chat box: send a prompt to /v1/chat/completions, watch the tokens stream in,
and see this request's time to first token and generation speed."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Input, Static

from homelab_llm.tui.widgets.format import rate, seconds


@dataclass
class ChatTiming:
    sent_at: float
    first_token_at: float | None = None
    finished_at: float | None = None
    tokens: int = 0  # content chunks until the server reports usage, then its count

    def describe(self) -> str:
        ttft = None if self.first_token_at is None else self.first_token_at - self.sent_at
        speed = None
        if self.first_token_at is not None and self.finished_at is not None and self.tokens > 1:
            span = self.finished_at - self.first_token_at
            speed = (self.tokens - 1) / span if span > 0 else None
        return f"TTFT {seconds(ttft)} · {rate(speed)} tok/s · {self.tokens} tokens"


class ChatBox(Vertical):
    """base_url() is asked at send time, so the box follows whichever server the app watches."""

    DEFAULT_CSS = """
    ChatBox { height: auto; }
    ChatBox #chat-log { height: auto; max-height: 12; }
    """

    def __init__(self, base_url: Callable[[], str | None], *, api_key: str | None = None,
                 clock: Callable[[], float] = time.monotonic, id: str | None = None) -> None:
        super().__init__(id=id)
        self._base_url = base_url
        self._api_key = api_key
        self._clock = clock
        self.messages: list[dict[str, str]] = []
        self.last_timing: ChatTiming | None = None

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="chat-log"):
            yield Static(id="chat-transcript")
        yield Static("", id="chat-stats")
        yield Input(placeholder="Ask the model… (Enter sends, Ctrl+L clears)", id="chat-input")

    def clear(self) -> None:
        self.messages.clear()
        self.query_one("#chat-transcript", Static).update("")
        self.query_one("#chat-stats", Static).update("")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        prompt = event.value.strip()
        if not prompt:
            return
        url = self._base_url()
        if not url:
            self.query_one("#chat-stats", Static).update(
                Text("no server to talk to: start a preset (s) or run with --url", style="red"))
            return
        event.input.value = ""
        self.messages.append({"role": "user", "content": prompt})
        self.send(url)

    def _show_transcript(self, reply: str, *, error: str = "") -> None:
        text = Text()
        for message in self.messages:
            who, style = ("you", "bold cyan") if message["role"] == "user" else ("model", "bold green")
            text.append(f"{who}: ", style=style)
            text.append(message["content"] + "\n")
        if reply or error:
            text.append("model: ", style="bold green")
            text.append(reply)
            if error:
                text.append(f"\n{error}", style="red")
        self.query_one("#chat-transcript", Static).update(text)
        self.query_one("#chat-log", VerticalScroll).scroll_end(animate=False)

    @work(exclusive=True, group="chat")
    async def send(self, url: str) -> None:
        timing = ChatTiming(sent_at=self._clock())
        self.last_timing = timing
        reply = ""
        stats = self.query_one("#chat-stats", Static)
        stats.update(Text("waiting for the first token…", style="dim"))
        self._show_transcript("")
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        body = {"model": await self._model(url, headers), "messages": self.messages, "stream": True,
                "max_tokens": 256, "stream_options": {"include_usage": True}}
        try:
            async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120, connect=5),
                                         headers=headers) as client:
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    if response.status_code != 200:
                        detail = (await response.aread()).decode("utf-8", "replace")[:300]
                        raise httpx.HTTPStatusError(f"HTTP {response.status_code}: {detail}",
                                                    request=response.request, response=response)
                    async for delta, usage in _sse_chunks(response):
                        if delta:
                            if timing.first_token_at is None:
                                timing.first_token_at = self._clock()
                            timing.tokens += 1
                            reply += delta
                            self._show_transcript(reply)
                            stats.update(Text(timing.describe(), style="dim"))
                        if usage is not None:
                            timing.tokens = usage
        except (httpx.HTTPError, ValueError) as err:
            timing.finished_at = self._clock()
            self._show_transcript(reply, error=f"request failed: {err}")
            stats.update(Text(timing.describe(), style="red"))
            self.messages.pop()  # the turn did not happen; let the user resend it
            return
        timing.finished_at = self._clock()
        self.messages.append({"role": "assistant", "content": reply})
        self._show_transcript("")
        stats.update(Text(timing.describe()))

    async def _model(self, url: str, headers: dict[str, str]) -> str:
        """The first served model name: our server and vLLM check it, llama.cpp ignores it."""
        try:
            async with httpx.AsyncClient(base_url=url, timeout=5, headers=headers) as client:
                data = (await client.get("/v1/models")).json()
            return str(data["data"][0]["id"])
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            return "default"


async def _sse_chunks(response: httpx.Response):  # -> AsyncIterator[tuple[str, int | None]]
    """(content delta, completion_tokens or None) per `data:` event until [DONE]."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            raise ValueError(chunk["error"].get("message", chunk["error"]))
        usage = chunk.get("usage") or {}
        delta = "".join((c.get("delta") or {}).get("content") or "" for c in chunk.get("choices") or [])
        yield delta, usage.get("completion_tokens")
