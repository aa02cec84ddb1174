"""The engine in a thread of the server process (`--engine-in-process`; the tests' fake engines).
`LLMEngine` is not thread-safe and `step()` blocks, so one thread owns it and runs the step loop
(step_loop.py): the HTTP event loop never waits on a forward pass, and the engine never waits on
HTTP. The price is the GIL: the step loop's host work and the HTTP work share one interpreter
(engine_process.py moves the loop into its own process).

Commands cross into the engine thread through an inbox it drains between steps; outputs come back
in one `call_soon_threadsafe` per step to per-request asyncio queues (client_base.py). The thread
sleeps on a condition when there is nothing to do. A dead engine ends the loop: state "dead", new
requests are refused, and the server exits (server/launch.py)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from homelab_llm.engine.outputs import RequestOutput
from homelab_llm.server.client_base import SHUTDOWN_MESSAGE, ClientBase, Engine, EngineNotReady
from homelab_llm.server.step_loop import Add, Call, Command, StepLoop

log = logging.getLogger("homelab_llm.server")

__all__ = ["Engine", "EngineClient", "EngineNotReady", "SHUTDOWN_MESSAGE"]


class EngineClient(ClientBase):
    def __init__(self, engine_factory: Callable[[], Engine],
                 observer: Callable[[RequestOutput], None] | None = None) -> None:
        super().__init__(observer)
        self._factory = engine_factory
        self._cond = threading.Condition()
        self._inbox: list[Command] = []
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; it loads the model, so /health says 503 until ready."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._abort_all()
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            # A dead engine's shutdown may itself be stuck on the device: do not wait long.
            await asyncio.to_thread(self._thread.join, 3.0 if self.state == "dead" else 30.0)
        if self.state not in ("failed", "dead"):  # keep the failure visible to whoever started us
            self.state = "stopped"

    # ---- event loop side -------------------------------------------------------------------
    def _post(self, item: Command) -> None:
        with self._cond:
            dead = self.state == "dead"  # the engine thread has stopped reading its inbox
            if not dead:
                self._inbox.append(item)
                self._cond.notify()
        if dead and isinstance(item, (Add, Call)):
            self.settle(item.ticket, error=EngineNotReady(self.unavailable_reason))

    # ---- engine thread (the step loop's host) ----------------------------------------------
    def settle(self, ticket: Any, result: Any = None, error: BaseException | None = None) -> None:
        future: asyncio.Future = ticket

        def settle_now() -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        assert self._loop is not None
        self._loop.call_soon_threadsafe(settle_now)

    def take(self, timeout: float) -> tuple[list[Command], bool]:
        with self._cond:
            if not self._inbox and not self._stopping and timeout > 0:
                self._cond.wait(timeout)
            inbox, self._inbox = self._inbox, []
            return inbox, self._stopping

    def emit(self, outputs: list[RequestOutput]) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._deliver, outputs)

    def mark_dead(self, reason: str) -> list[Command]:
        with self._cond:  # no add or call is queued after this (see _post)
            self.dead_reason = reason
            self.state = "dead"
            inbox, self._inbox = self._inbox, []
        return inbox

    def _run(self) -> None:
        try:
            engine = self._factory()
        except BaseException as err:  # noqa: BLE001 - reported through /health and the CLI
            self.load_error = f"{type(err).__name__}: {err}"
            self.state = "failed"
            log.error("engine failed to load: %s", self.load_error)
            self._ready.set()
            with self._cond:
                inbox, self._inbox = self._inbox, []
            for item in inbox:
                if isinstance(item, (Add, Call)):
                    self.settle(item.ticket, error=EngineNotReady(self.load_error))
            return
        self.engine = engine
        self.state = "ready"
        self._ready.set()
        StepLoop(engine, self).run()
