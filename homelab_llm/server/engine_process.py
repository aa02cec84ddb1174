"""The engine in its own process (the default of `serve`): the server's side of the pipe to
engine_core.py. Same interface as the in-thread client (client_base.py), so routes never know.

Outputs arrive once per engine step, as token ids only, and are read on the event loop itself
(`add_reader` on the pipe: no thread, no GIL hand-off per step); they are decoded here, stop
strings included (detokenize.py: vLLM v1's split, so the engine's loop never waits on text), and a
request a stop string ends is aborted in the engine. Commands leave through a writer thread, so a full pipe
never blocks the event loop and the two sides can never block each other's sends.

Death: if the engine process exits while it should be serving (a fatal fault it reported, a
SIGKILL, the OOM killer), the client turns "dead" at the pipe's EOF: every open request gets an
error output, every waiting add or call is refused, and server/launch.py exits non-zero. An exit
while loading is a load failure, reported as the load error of the in-thread client would be."""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from homelab_llm.engine.outputs import RequestOutput
from homelab_llm.load_progress import LOAD
from homelab_llm.server.client_base import ClientBase, Engine, EngineNotReady
from homelab_llm.server.detokenize import TextOutputs
from homelab_llm.server.engine_core import Readable, engine_core_main
from homelab_llm.server.step_loop import Abort, Add, Call, Command

log = logging.getLogger("homelab_llm.server")

STOP_WAIT_S = 30.0  # an orderly engine shutdown (tensor-parallel ranks included) takes this long at most
DEAD_STOP_WAIT_S = 3.0  # a dead engine may be stuck on its device: kill it sooner
EXIT_STOP_WAIT_S = 3.0  # a forced exit: the engine gets this long to stop by itself


def exit_description(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class ProcessEngineClient(ClientBase):
    def __init__(self, engine_factory: Callable[[], Engine],
                 observer: Callable[[RequestOutput], None] | None = None,
                 log_level: int = logging.INFO) -> None:
        """`engine_factory` runs in the engine process, so it must pickle (a module-level
        function, a functools.partial of one, a class)."""
        super().__init__(observer)
        self._factory = engine_factory
        self._log_level = log_level
        self._proc: Any = None  # multiprocessing's SpawnProcess
        self._conn: Any = None
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._tickets: dict[int, asyncio.Future] = {}
        self._next_ticket = itertools.count()
        self._gone = False  # the pipe hit EOF: the process has ended or is ending
        self._stopping = False
        self._text: TextOutputs | None = None  # set when the engine (its tokenizer) is ready

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        # Started from the event loop's thread: the child's PR_SET_PDEATHSIG follows the thread
        # that started it, and this one lives as long as the server.
        self._loop = asyncio.get_running_loop()
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=engine_core_main, name="homelab-llm-engine",
                                 args=(self._factory, theirs, os.getpid(), self._log_level))
        self._proc.start()
        theirs.close()
        self._conn = ours
        self._readable = Readable(ours)
        self._loop.add_reader(ours.fileno(), self._on_readable)
        threading.Thread(target=self._write_loop, name="engine-writer", daemon=True).start()
        # A forced exit (a second signal) skips the lifespan shutdown; multiprocessing's own exit
        # hook would then wait forever for a child still serving. This one runs first.
        atexit.register(self._stop_at_exit)
        log.info("engine process started (pid %d)", self._proc.pid)

    def _stop_at_exit(self) -> None:
        proc = self._proc
        if proc is None or proc.exitcode is not None:
            return
        self._stopping = True
        self._outbox.put(None)
        proc.join(EXIT_STOP_WAIT_S)
        if proc.exitcode is None:
            proc.kill()
            proc.join()

    async def shutdown(self) -> None:
        self._abort_all()
        self._stopping = True
        self._outbox.put(None)
        proc = self._proc
        if proc is not None:
            wait = DEAD_STOP_WAIT_S if self.state == "dead" else STOP_WAIT_S
            await asyncio.to_thread(proc.join, wait)
            if proc.exitcode is None:
                log.warning("the engine process did not stop within %.0f s; killing it", wait)
                proc.kill()
                await asyncio.to_thread(proc.join, 5.0)
        atexit.unregister(self._stop_at_exit)
        self._close()
        if self.state not in ("failed", "dead"):
            self.state = "stopped"

    def _close(self) -> None:
        if self._conn is not None and self._loop is not None:
            self._loop.remove_reader(self._conn.fileno())
            self._conn.close()
            self._conn = None

    # ---- commands --------------------------------------------------------------------------
    def _post(self, item: Command) -> None:
        future = item.ticket if isinstance(item, (Add, Call)) else None
        if self._gone or self.state == "dead":
            if future is not None:
                future.set_exception(EngineNotReady(self.unavailable_reason))
            return
        if future is not None:
            ticket = next(self._next_ticket)
            item = replace(item, ticket=ticket)
        try:
            data = pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # e.g. call() with a lambda: the caller's bug, said plainly
            if future is None:
                raise
            future.set_exception(TypeError(f"cannot send this to the engine process: {err}"))
            return
        if future is not None:
            self._tickets[ticket] = future
        if isinstance(item, Add) and self._text is not None:
            self._text.start(item.request_id, item.prompt, item.params)
        self._outbox.put(data)

    def _forget(self, request_id: str) -> None:
        super()._forget(request_id)
        if self._text is not None:
            self._text.forget(request_id)

    def _write_loop(self) -> None:
        while True:
            data = self._outbox.get()
            conn = self._conn
            if conn is None:
                return
            try:
                if data is None:
                    conn.send(None)
                    return
                conn.send_bytes(data)
            except (OSError, ValueError):  # the process is gone: the reader reports it
                return

    # ---- messages (event loop) -------------------------------------------------------------
    def _on_readable(self) -> None:
        conn = self._conn
        try:
            while conn is not None and self._readable():
                self._handle(conn.recv())
        except (EOFError, OSError):
            self._loop.remove_reader(conn.fileno())
            self._gone = True
            asyncio.ensure_future(self._on_exit())

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "out":
            step = self._text.apply(message[1])
            self._deliver(step.outputs)
            for request_id in step.cut:  # ended here by a stop string: free it in the engine
                self._post(Abort(request_id))
        elif kind == "settle":
            _, ticket, result, error = message
            future = self._tickets.pop(ticket, None)
            if future is not None and not future.done():
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)
        elif kind == "load":
            LOAD.mirror(message[1])
        elif kind == "ready":
            self.engine = message[1]
            self._text = TextOutputs(self.engine.tokenizer)
            self.state = "ready"
            self._ready.set()
        elif kind == "failed":
            self.load_error = message[1]
            self.state = "failed"
            self._ready.set()
        elif kind == "dead":
            self.dead_reason = message[1]
            self.state = "dead"

    async def _on_exit(self) -> None:
        """The pipe closed: the engine process ended (or is ending). Unless we stopped it, that is
        a load failure or a dead engine; either way nothing still waiting will be answered."""
        await asyncio.to_thread(self._proc.join, 2.0)
        how = exit_description(self._proc.exitcode)
        if self.state == "loading":
            self.load_error = f"the engine process ended while loading ({how})"
            self.state = "failed"
            self._ready.set()
        elif self.state == "ready" and not self._stopping:
            self.dead_reason = f"the engine process ended ({how})"
            self.state = "dead"
        if self.state == "dead":
            log.error("the engine process ended (%s); the engine is dead: %s", how, self.dead_reason)
            self._fail_all(f"the engine is dead: {self.dead_reason}")
        tickets, self._tickets = self._tickets, {}
        for future in tickets.values():
            if not future.done():
                future.set_exception(EngineNotReady(self.unavailable_reason))
