"""One HTTP request = a batch of engine requests (n choices, and for /v1/completions several
prompts). `Batch` submits them together, merges their outputs from one shared queue, and aborts
whatever is unfinished when the handler leaves for any reason (client gone, error, shutdown), so
no engine request outlives its HTTP request."""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from homelab_llm.engine.outputs import RequestOutput, TokenLogprob
from homelab_llm.engine.sampling_params import SamplingParams
from homelab_llm.errors import HomelabError
from homelab_llm.server.client_base import EngineNotReady
from homelab_llm.server.errors import (APIError, bad_request, engine_failure, queue_full,
                                       unavailable)
from homelab_llm.server.state import ServerState

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its request was submitted; nobody reads the answer."""


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class ChoiceState:
    """Everything one choice has produced so far."""

    index: int
    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    started: bool = False  # its first chunk went out (streaming)

    def update(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.logprobs.extend(out.logprobs)
        self.num_tokens = max(self.num_tokens + len(out.new_token_ids), out.num_output_tokens)
        self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens or self.num_cached_tokens
        if out.finished:
            self.finish_reason = out.finish_reason or "stop"
            self.stop_reason = out.stop_reason


def output_error(out: RequestOutput) -> APIError | None:
    """An output that ends its request in failure, as the error the client should see."""
    if out.finish_reason == "error":
        return engine_failure(out.error or "unknown error")
    if out.finish_reason == "abort" and out.error:
        return unavailable(out.error)
    return None


class Batch:
    def __init__(self, state: ServerState, base_id: str,
                 items: list[tuple[list[int], SamplingParams]]) -> None:
        self.state = state
        self.base_id = base_id  # the id the client sees; engine ids add "-<choice>"
        self.ids = [f"{base_id}-{i}" for i in range(len(items))]
        self.items = items
        self.sink: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._index = {rid: i for i, rid in enumerate(self.ids)}
        self._open: set[str] = set()

    async def submit(self, request: Request) -> None:
        """Hand every engine request to the engine. A client that hangs up meanwhile (a batch of
        hundreds takes a while) cancels the rest, and what was already added is aborted."""
        client = self.state.client
        limit = self.state.config.max_queue_len
        if limit is not None and client.num_waiting >= limit:
            raise queue_full(limit)
        if not await until_disconnect(request, self._add_all()):
            self.abort()
            raise ClientGone()

    async def _add_all(self) -> bool:
        client = self.state.client
        try:
            for rid, (prompt_ids, params) in zip(self.ids, self.items):
                self._open.add(rid)
                await client.add(rid, prompt_ids, params, self.sink)
            return True
        except EngineNotReady as err:
            self.abort()
            raise unavailable(str(err)) from err
        except HomelabError as err:  # the engine's own checks: prompt too long, bad params
            self.abort()
            raise bad_request(str(err)) from err
        except BaseException:
            self.abort()
            raise

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) until every request has finished."""
        while self._open:
            out = await self.sink.get()
            if out.finished:
                self._open.discard(out.request_id)
            yield self._index[out.request_id], out

    def abort(self) -> None:
        for rid in list(self._open):
            self.state.client.abort(rid)
        self._open.clear()


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work` unless the client goes away first; then cancel it (which aborts its engine
    requests) and return None. Non-streaming requests need this: nothing is sent until the end,
    so nothing else would notice the disconnect."""
    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    job = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({job, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if job in done:
        return job.result()
    job.cancel()
    try:
        await job
    except (asyncio.CancelledError, Exception):
        pass
    return None


def clamp_logprob(value: float) -> float:
    # JSON has no -inf; vLLM reports -9999.0 for tokens the sampler ruled out.
    return value if math.isfinite(value) else -9999.0


def usage(choices: list[ChoiceState], prompt_choice_starts: list[int]) -> dict[str, Any]:
    """Usage counts each prompt once (not once per choice), like OpenAI."""
    prompt = sum(choices[i].num_prompt_tokens for i in prompt_choice_starts)
    cached = sum(choices[i].num_cached_tokens for i in prompt_choice_starts)
    completion = sum(c.num_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
