"""The engine's step loop, wherever it runs (a thread of the server, or its own process): take the
commands queued since the last step (add, abort, call), apply them in order, step, hand the
outputs on. `LLMEngine` is not thread-safe and `step()` blocks, so this loop is its only caller.

An exception in `step()` fails every request in flight with an error output, so no client is
left hanging. A fatal one (the engine says it is dead: a device fault, a lost tensor-parallel
rank; engine/faults.py) also ends the loop: every request gets an error output and queued adds
and calls are refused. An idle engine is polled for death every DEAD_POLL_S, so a rank that dies
between requests is noticed. The transport (`LoopHost`) decides how commands arrive and where
outputs and results go; `ticket` is its handle on the caller waiting for an add or a call."""

from __future__ import annotations

import logging
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

DEAD_POLL_S = 0.5  # how often an idle loop asks whether the engine died
BACKOFF_S = 1e-3  # work that cannot run yet (waiting for pages): wait this long, not spin


class Engine(Protocol):
    """The slice of `LLMEngine` (engine/core.py) the server uses."""

    tokenizer: Tokenizer
    max_model_len: int

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> list[int]: ...
    def abort_request(self, request_id: str) -> None: ...
    def set_detokenize(self, enabled: bool) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def status(self) -> dict[str, Any]: ...
    def shutdown(self) -> None: ...

    @property
    def dead_reason(self) -> str | None: ...


class EngineNotReady(RuntimeError):
    """The engine cannot take requests (loading, failed, dead); the message says which."""


@dataclass
class Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    ticket: Any


@dataclass
class Abort:
    request_id: str


@dataclass
class Call:
    fn: Callable[[Engine], Any]
    ticket: Any


Command = Add | Abort | Call


class LoopHost(Protocol):
    def take(self, timeout: float) -> tuple[list[Command], bool]:
        """The commands queued now, waiting up to `timeout` s for one if there are none; and
        whether the loop should stop."""
        ...

    def emit(self, outputs: list[RequestOutput]) -> None: ...

    def settle(self, ticket: Any, result: Any = None, error: BaseException | None = None) -> None: ...

    def mark_dead(self, reason: str) -> list[Command]:
        """The engine died: accept no more commands; return the ones queued meanwhile."""
        ...


class StepLoop:
    def __init__(self, engine: Engine, host: LoopHost) -> None:
        self.engine = engine
        self.host = host
        self.live: set[str] = set()  # request ids the engine holds
        self.dead_reason: str | None = None

    def run(self) -> None:
        """Until the host says stop or the engine dies; the engine is shut down either way."""
        engine = self.engine
        backoff = False
        try:
            while True:
                timeout = (BACKOFF_S if backoff else
                           0.0 if engine.has_unfinished_requests() else DEAD_POLL_S)
                items, stopping = self.host.take(timeout)
                if engine.dead_reason is not None:
                    self._die(engine.dead_reason, items)
                    return
                for item in items:
                    self._apply(item)
                if stopping:
                    return
                backoff = False
                if engine.has_unfinished_requests():
                    started = time.monotonic()
                    progressed = self._step()
                    if self.dead_reason is not None:
                        return
                    # Work exists but nothing could run: back off instead of spinning.
                    backoff = not progressed and time.monotonic() - started < BACKOFF_S
        finally:
            try:
                engine.shutdown()
            except Exception:
                log.exception("engine shutdown failed")

    def _apply(self, item: Command) -> None:
        engine = self.engine
        if isinstance(item, Add):
            try:
                engine.add_request(item.request_id, item.prompt, item.params)
                self.live.add(item.request_id)
                self.host.settle(item.ticket)
            except BaseException as err:  # noqa: BLE001 - handed to the waiting handler
                self.host.settle(item.ticket, error=err)
        elif isinstance(item, Abort):
            if item.request_id in self.live:
                self.live.discard(item.request_id)
                try:
                    engine.abort_request(item.request_id)
                except Exception:
                    log.exception("abort of %s failed", item.request_id)
        else:
            try:
                self.host.settle(item.ticket, item.fn(engine))
            except BaseException as err:  # noqa: BLE001
                self.host.settle(item.ticket, error=err)

    def _step(self) -> bool:
        """One engine step; returns whether it produced any output."""
        engine, live = self.engine, self.live
        try:
            outputs = engine.step()
        except Exception as err:
            if engine.dead_reason is not None or classify(err) is FaultKind.FATAL:
                self._die(engine.dead_reason or describe(err), [])
                return False
            log.error("engine step failed; failing %d request(s):\n%s", len(live), traceback.format_exc())
            outputs = errors_for(live, f"{type(err).__name__}: {err}")
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
            self.host.emit(outputs)
        return bool(outputs)

    def _die(self, reason: str, items: list[Command]) -> None:
        """Every request in flight ends with an error output, queued adds and calls are refused;
        the loop ends after this."""
        self.dead_reason = reason
        queued = self.host.mark_dead(reason)  # no add or call is queued after this
        log.error("the engine is dead (%s); failing %d request(s)", reason, len(self.live))
        message = f"the engine is dead: {reason}"
        outputs = errors_for(self.live, message)
        self.live.clear()
        if outputs:
            self.host.emit(outputs)
        for item in [*items, *queued]:
            if isinstance(item, (Add, Call)):
                self.host.settle(item.ticket, error=EngineNotReady(message))


def errors_for(request_ids: set[str], message: str) -> list[RequestOutput]:
    """A final error output for each request."""
    now = time.monotonic()
    return [RequestOutput(rid, [], "", finished=True, finish_reason="error", finish_time=now,
                          error=message) for rid in sorted(request_ids)]
