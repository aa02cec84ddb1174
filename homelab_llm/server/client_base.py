"""The event-loop half of every engine client: per-request sinks, the queue-length count, drain,
abort and the engine's lifecycle state. Two transports sit under it: the engine in a thread of this
process (engine_client.py) and the engine in its own process (engine_process.py); the routes only
see this interface, so they never know which one serves them.

Invariants: everything here runs on the event loop's thread; a request id is in `_sinks` from
`add` until its final output is delivered (or it is aborted here), so `num_unfinished` is what the
clients still wait for; an aborted request gets exactly one final output (when asked to notify),
and whatever the engine says about it afterwards is dropped."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from homelab_llm.engine.outputs import RequestOutput
from homelab_llm.engine.sampling_params import SamplingParams
from homelab_llm.server.step_loop import (Abort, Add, Call, Command, Engine, EngineNotReady,
                                          errors_for)

log = logging.getLogger("homelab_llm.server")

__all__ = ["ClientBase", "Engine", "EngineNotReady", "SHUTDOWN_MESSAGE"]

SHUTDOWN_MESSAGE = "the server is shutting down; the request was aborted"


class ClientBase(ABC):
    def __init__(self, observer: Callable[[RequestOutput], None] | None = None) -> None:
        self._observer = observer
        self.engine: Any = None  # what the routes read: tokenizer, max_model_len
        self.state = "loading"  # loading | ready | failed | dead | stopped
        self.load_error: str | None = None
        self.dead_reason: str | None = None  # set with state "dead"
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sinks: dict[str, asyncio.Queue] = {}
        self._waiting: set[str] = set()  # accepted, no output yet
        self._idle = asyncio.Event()
        self._idle.set()

    # ---- what a transport provides ---------------------------------------------------------
    @abstractmethod
    def start(self) -> None:
        """Start loading the engine; /health says 503 until it is ready."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Abort what is left, stop the engine and wait (boundedly) for it to be gone."""

    @abstractmethod
    def _post(self, item: Command) -> None:
        """Hand a command to the engine side; an Add or Call is settled through its future."""

    # ---- lifecycle -------------------------------------------------------------------------
    async def wait_ready(self, timeout: float | None = None) -> bool:
        return await asyncio.to_thread(self._ready.wait, timeout)

    async def drain(self, timeout: float) -> int:
        """Wait up to `timeout` s for in-flight requests to finish, then abort the rest (their
        handlers get a finish_reason 'abort' output). Returns how many were aborted."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return 0
        except asyncio.TimeoutError:
            remaining = list(self._sinks)
            for request_id in remaining:
                self.abort(request_id, notify=True, error=SHUTDOWN_MESSAGE)
            return len(remaining)

    def _abort_all(self) -> None:
        for request_id in list(self._sinks):
            self.abort(request_id, notify=True, error=SHUTDOWN_MESSAGE)

    # ---- requests --------------------------------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        return len(self._sinks)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    async def add(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                  sink: asyncio.Queue) -> None:
        """Queue a request; its outputs go to `sink`. Raises what `engine.add_request` raises."""
        if self.state != "ready":
            raise EngineNotReady(self.unavailable_reason)
        future = asyncio.get_running_loop().create_future()
        self._sinks[request_id] = sink
        self._waiting.add(request_id)
        self._idle.clear()
        self._post(Add(request_id, prompt, params, future))
        try:
            await future
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may still land: abort follows it through the inbox
            raise
        except BaseException:
            self._forget(request_id)
            raise

    def abort(self, request_id: str, notify: bool = False, error: str | None = None) -> None:
        """Abort a request (idempotent). With notify, its handler gets a final output saying why."""
        sink = self._sinks.get(request_id)
        if sink is None:
            return
        final = RequestOutput(request_id, [], "", finished=True, finish_reason="abort",
                              finish_time=time.monotonic(), error=error)
        self._observe(final)
        if notify:
            sink.put_nowait(final)
        self._forget(request_id)
        self._post(Abort(request_id))

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run fn(engine) on the engine side between steps (engine.status() is not thread-safe).
        In a separate engine process fn must pickle (operator.methodcaller does)."""
        if self.state != "ready":
            raise EngineNotReady(self.unavailable_reason)
        future = asyncio.get_running_loop().create_future()
        self._post(Call(fn, future))
        return await future

    @property
    def unavailable_reason(self) -> str:
        """Why requests are refused now (state is not "ready")."""
        if self.state == "dead":
            return f"the engine is dead: {self.dead_reason}"
        if self.state == "failed":
            return f"the engine failed to load: {self.load_error}"
        return self.load_error or "the model is still loading"

    def _forget(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)
        self._waiting.discard(request_id)
        if not self._sinks:
            self._idle.set()

    def _observe(self, output: RequestOutput) -> None:
        if self._observer is None:
            return
        try:
            self._observer(output)
        except Exception:  # statistics must never break serving
            log.exception("stats observer failed")

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if sink is None:  # aborted on our side; its final output was already produced
                continue
            self._waiting.discard(output.request_id)
            self._observe(output)
            sink.put_nowait(output)
            if output.finished:
                self._forget(output.request_id)

    def _fail_all(self, message: str) -> None:
        """The engine is gone without saying goodbye: every request still open ends with an error
        output (a process that died cannot send them itself)."""
        self._deliver(errors_for(set(self._sinks), message))
