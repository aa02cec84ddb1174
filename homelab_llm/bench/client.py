"""An async client for any OpenAI-compatible server that times every streamed event.

Talks to ours, vLLM, SGLang and llama.cpp's server alike: only `/v1/chat/completions` (stream),
`/v1/models`, and optionally `/tokenize`. The clock and the httpx transport are injectable so the
timing arithmetic can be tested exactly against a fake server on a virtual clock.

Cancelling a `stream_chat` task closes its connection; every server we target aborts the request
when its client goes away, which is how Ctrl+C frees the engine at once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx

from homelab_llm.bench.metrics import RequestTiming
from homelab_llm.errors import HomelabError

Clock = Callable[[], float]
Message = dict[str, str]


class BenchError(HomelabError):
    """The server cannot be benchmarked as asked (unreachable, unknown model, bad flags)."""


def normalize_base_url(url: str) -> str:
    """'http://h:8000', 'http://h:8000/', 'http://h:8000/v1' -> 'http://h:8000' (the server root)."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise BenchError(f"--base-url must start with http:// or https://, got {url!r}")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class BenchClient:
    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None, *,
                 timeout: float = 3600.0, transport: httpx.AsyncBaseTransport | None = None,
                 clock: Clock = time.perf_counter) -> None:
        self.root = normalize_base_url(base_url)
        self.model = model
        self.clock = clock
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # A long read timeout: a 120K-token cold prefill on a consumer GPU takes minutes.
        self._http = httpx.AsyncClient(
            base_url=self.root, headers=headers, transport=transport,
            timeout=httpx.Timeout(timeout, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self._has_tokenize: bool | None = None

    async def __aenter__(self) -> "BenchClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # --- discovery -------------------------------------------------------------------------

    async def models(self) -> list[str]:
        try:
            resp = await self._http.get("/v1/models")
        except httpx.HTTPError as err:
            raise BenchError(f"cannot reach {self.root}: {err or type(err).__name__}") from err
        if resp.status_code == 401:
            raise BenchError(f"{self.root} wants an API key: pass --api-key")
        if resp.status_code != 200:
            raise BenchError(f"GET {self.root}/v1/models answered HTTP {resp.status_code}")
        try:
            return [m["id"] for m in resp.json().get("data", [])]
        except (ValueError, KeyError, TypeError) as err:
            raise BenchError(f"{self.root}/v1/models did not return an OpenAI model list") from err

    async def resolve_model(self) -> str:
        """Check the server is up; take its first model when --model was not given."""
        served = await self.models()
        if self.model is None:
            if not served:
                raise BenchError(f"{self.root} serves no models; pass --model")
            self.model = served[0]
        return self.model

    async def latency(self, probes: int = 3) -> float:
        """Median round trip of GET /v1/models: network + HTTP overhead, no model work
        (llama-benchy's 'api' latency mode). Subtracted from TTFR to estimate prefill time."""
        samples = []
        for _ in range(probes):
            t0 = self.clock()
            try:
                resp = await self._http.get("/v1/models")
                await resp.aread()
            except httpx.HTTPError as err:
                raise BenchError(f"cannot reach {self.root}: {err or type(err).__name__}") from err
            samples.append(self.clock() - t0)
        samples.sort()
        return samples[len(samples) // 2]

    async def tokenize(self, text: str) -> int | None:
        """Exact token count from the server's /tokenize (vLLM, SGLang or llama.cpp shape), or
        None when the server has none. Special tokens are left out: we count the text alone."""
        if self._has_tokenize is False:
            return None
        body = {"model": self.model, "prompt": text, "content": text, "add_special_tokens": False}
        try:
            resp = await self._http.post("/tokenize", json=body)
        except httpx.HTTPError:
            self._has_tokenize = False
            return None
        try:
            data = resp.json() if resp.status_code == 200 else None
        except ValueError:
            data = None
        if not isinstance(data, dict):
            self._has_tokenize = False
            return None
        self._has_tokenize = True
        if isinstance(data.get("count"), int):  # vLLM
            return data["count"]
        if isinstance(data.get("tokens"), list):  # llama.cpp, SGLang
            return len(data["tokens"])
        self._has_tokenize = False
        return None

    # --- the timed request -----------------------------------------------------------------

    async def stream_chat(self, messages: list[Message], max_tokens: int, *,
                          ignore_eos: bool = True, no_cache: bool = False,
                          extra: dict[str, Any] | None = None) -> RequestTiming:
        """One streamed chat completion, timed per event. Errors land in `timing.error`."""
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.0,
        }
        if ignore_eos:  # exact TG lengths: vLLM, SGLang, llama.cpp and ours all read ignore_eos
            body["ignore_eos"] = True
        if no_cache:  # llama.cpp's per-request switch; others ignore it
            body["cache_prompt"] = False
        body.update(extra or {})
        timing = RequestTiming(start=self.clock())
        try:
            async with self._http.stream("POST", "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode("utf-8", "replace")
                    timing.error = f"HTTP {resp.status_code}: {_error_message(detail)}"
                    timing.end = self.clock()
                    return timing
                async for line in resp.aiter_lines():
                    now = self.clock()
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, event: lines
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    _apply_event(timing, payload, now)
                    if timing.error:
                        break
        except httpx.HTTPError as err:
            timing.error = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            timing.end = self.clock()
        if timing.error is None and timing.first_token is None:
            timing.error = "the stream ended without any generated text"
        return timing


def _apply_event(timing: RequestTiming, payload: str, now: float) -> None:
    try:
        event = json.loads(payload)
    except ValueError:
        timing.error = f"bad SSE event: {payload[:120]!r}"
        return
    if timing.first_response is None:
        timing.first_response = now
    timing.end = now
    if "error" in event:
        timing.error = _error_message(json.dumps(event))
        return
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        # Reasoning models stream thinking separately; those are generated tokens too.
        text = (delta.get("content") or "") + (delta.get("reasoning_content") or "") \
            + (delta.get("reasoning") or "")
        if text:
            if timing.first_token is None:
                timing.first_token = now
            timing.token_times.append(now)
            timing.text += text
        if choice.get("finish_reason"):
            timing.finish_reason = choice["finish_reason"]
    usage = event.get("usage")
    if usage:
        timing.prompt_tokens = usage.get("prompt_tokens", timing.prompt_tokens)
        timing.completion_tokens = usage.get("completion_tokens", timing.completion_tokens)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            timing.cached_tokens = details["cached_tokens"]


def _error_message(body: str) -> str:
    """The human part of an OpenAI-style error body, else the body itself, one line."""
    try:
        data = json.loads(body)
        err = data.get("error", data)
        msg = err.get("message") if isinstance(err, dict) else err
        if msg is None and isinstance(data, dict):
            msg = data.get("detail") or data.get("message")
        body = str(msg if msg is not None else data)
    except (ValueError, AttributeError):
        pass
    return " ".join(body.split())[:300]
