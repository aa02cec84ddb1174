"""The async face of the engine. `LLMEngine` is not thread-safe and `step()` blocks, so one thread
owns it: the HTTP event loop never waits on a forward pass, and the engine never waits on HTTP.

Requests and aborts cross into the engine thread through an inbox it drains between steps; outputs
come back in one `call_soon_threadsafe` per step to per-request asyncio queues ("sinks"). The
thread sleeps on a condition when there is nothing to do. An exception in `step()` fails every
request in flight with an error output, so no client is left hanging. A fatal one (the engine
says it is dead: a device fault, a lost tensor-parallel rank; engine/faults.py) also ends the
loop: state "dead", new requests are refused, and the server exits (server/launch.py). An idle
engine is polled for death every DEAD_POLL_S, so a rank that dies between requests is noticed."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from homelab_llm.engine.faults import FaultKind, classify, describe
from homelab_llm.engine.outputs import RequestOutput
from homelab_llm.engine.sampling_params import SamplingParams
from homelab_llm.engine.tokenizer import Tokenizer

log = logging.getLogger("homelab_llm.server")


class Engine(Protocol):
    """The slice of `LLMEngine` (engine/core.py) the server uses."""

    tokenizer: Tokenizer
    max_model_len: int

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> list[int]: ...
    def abort_request(self, request_id: str) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def status(self) -> dict[str, Any]: ...
    def shutdown(self) -> None: ...

    @property
    def dead_reason(self) -> str | None: ...


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    future: asyncio.Future


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[Engine], Any]
    future: asyncio.Future


SHUTDOWN_MESSAGE = "the server is shutting down; the request was aborted"
DEAD_POLL_S = 0.5  # how often an idle engine thread asks whether the engine died


class EngineNotReady(RuntimeError):
    pass


class EngineClient:
    def __init__(self, engine_factory: Callable[[], Engine],
                 observer: Callable[[RequestOutput], None] | None = None) -> None:
        self._factory = engine_factory
        self._observer = observer
        self.engine: Engine | None = None
        self.state = "loading"  # loading | ready | failed | dead | stopped
        self.load_error: str | None = None
        self.dead_reason: str | None = None  # set with state "dead"
        self._ready = threading.Event()
        self._cond = threading.Condition()
        self._inbox: list[_Add | _Abort | _Call] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Event-loop side bookkeeping (touched only on the loop thread).
        self._sinks: dict[str, asyncio.Queue] = {}
        self._waiting: set[str] = set()  # accepted, no output yet
        self._idle = asyncio.Event()
        self._idle.set()

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; it loads the model, so /health says 503 until ready."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

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

    async def shutdown(self) -> None:
        for request_id in list(self._sinks):
            self.abort(request_id, notify=True, error=SHUTDOWN_MESSAGE)
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            # A dead engine's shutdown may itself be stuck on the device: do not wait long.
            await asyncio.to_thread(self._thread.join, 3.0 if self.state == "dead" else 30.0)
        if self.state not in ("failed", "dead"):  # keep the failure visible to whoever started us
            self.state = "stopped"

    # ---- requests (event loop side) --------------------------------------------------------
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
        self._post(_Add(request_id, prompt, params, future))
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
        self._post(_Abort(request_id))

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps (engine.status() is not thread-safe)."""
        if self.state != "ready":
            raise EngineNotReady(self.unavailable_reason)
        future = asyncio.get_running_loop().create_future()
        self._post(_Call(fn, future))
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

    # ---- engine thread ---------------------------------------------------------------------
    def _post(self, item: _Add | _Abort | _Call) -> None:
        with self._cond:
            dead = self.state == "dead"  # the engine thread has stopped reading its inbox
            if not dead:
                self._inbox.append(item)
                self._cond.notify()
        if dead and isinstance(item, (_Add, _Call)):
            self._resolve(item.future, error=EngineNotReady(self.unavailable_reason))

    def _resolve(self, future: asyncio.Future, result: Any = None,
                 error: BaseException | None = None) -> None:
        def settle() -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        assert self._loop is not None
        self._loop.call_soon_threadsafe(settle)

    def _run(self) -> None:
        try:
            engine = self._factory()
        except BaseException as err:  # noqa: BLE001 - reported through /health and the CLI
            self.load_error = f"{type(err).__name__}: {err}"
            self.state = "failed"
            log.error("engine failed to load: %s", self.load_error)
            self._ready.set()
            self._fail_inbox(self.load_error)
            return
        self.engine = engine
        self.state = "ready"
        self._ready.set()
        live: set[str] = set()  # request ids the engine holds
        try:
            while True:
                with self._cond:
                    while (not self._inbox and not self._stopping and engine.dead_reason is None
                           and not engine.has_unfinished_requests()):
                        self._cond.wait(DEAD_POLL_S)
                    inbox, self._inbox = self._inbox, []
                    stopping = self._stopping
                if engine.dead_reason is not None:
                    self._die(engine.dead_reason, live, inbox)
                    break
                for item in inbox:
                    self._apply(engine, item, live)
                if stopping:
                    break
                if engine.has_unfinished_requests():
                    started = time.monotonic()
                    progressed = self._step(engine, live)
                    if self.state == "dead":
                        break
                    if not progressed and time.monotonic() - started < 1e-3:
                        # Work exists but nothing could run (e.g. waiting for pages): back off a
                        # millisecond instead of spinning, waking early for new commands.
                        with self._cond:
                            if not self._inbox:
                                self._cond.wait(1e-3)
        finally:
            try:
                engine.shutdown()
            except Exception:
                log.exception("engine shutdown failed")

    def _apply(self, engine: Engine, item: _Add | _Abort | _Call, live: set[str]) -> None:
        if isinstance(item, _Add):
            try:
                engine.add_request(item.request_id, item.prompt, item.params)
                live.add(item.request_id)
                self._resolve(item.future)
            except BaseException as err:  # noqa: BLE001 - handed to the waiting handler
                self._resolve(item.future, error=err)
        elif isinstance(item, _Abort):
            if item.request_id in live:
                live.discard(item.request_id)
                try:
                    engine.abort_request(item.request_id)
                except Exception:
                    log.exception("abort of %s failed", item.request_id)
        else:
            try:
                self._resolve(item.future, item.fn(engine))
            except BaseException as err:  # noqa: BLE001
                self._resolve(item.future, error=err)

    def _step(self, engine: Engine, live: set[str]) -> bool:
        """One engine step; returns whether it produced any output."""
        try:
            outputs = engine.step()
        except Exception as err:
            if engine.dead_reason is not None or classify(err) is FaultKind.FATAL:
                self._die(engine.dead_reason or describe(err), live, [])
                return False
            log.error("engine step failed; failing %d request(s):\n%s", len(live), traceback.format_exc())
            message = f"{type(err).__name__}: {err}"
            now = time.monotonic()
            outputs = [RequestOutput(rid, [], "", finished=True, finish_reason="error",
                                     finish_time=now, error=message) for rid in live]
            for rid in list(live):
                try:
                    engine.abort_request(rid)
                except Exception:
                    pass
            live.clear()
        for output in outputs:
            if output.finished:
                live.discard(output.request_id)
        if outputs:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._deliver, outputs)
        return bool(outputs)

    def _die(self, reason: str, live: set[str], inbox: list[_Add | _Abort | _Call]) -> None:
        """The engine is dead: every request in flight ends with an error output, queued adds
        and calls are refused; the loop ends after this."""
        with self._cond:  # no add or call is queued after this (see _post)
            self.dead_reason = reason
            self.state = "dead"
        log.error("the engine is dead (%s); failing %d request(s)", reason, len(live))
        message = f"the engine is dead: {reason}"
        now = time.monotonic()
        outputs = [RequestOutput(rid, [], "", finished=True, finish_reason="error",
                                 finish_time=now, error=message) for rid in sorted(live)]
        live.clear()
        if outputs:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._deliver, outputs)
        for item in inbox:
            if isinstance(item, (_Add, _Call)):
                self._resolve(item.future, error=EngineNotReady(message))
        self._fail_inbox(message)

    def _fail_inbox(self, message: str) -> None:
        with self._cond:
            inbox, self._inbox = self._inbox, []
        for item in inbox:
            if isinstance(item, (_Add, _Call)):
                self._resolve(item.future, error=EngineNotReady(message))
