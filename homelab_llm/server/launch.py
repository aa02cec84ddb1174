"""Run the app under uvicorn with our shutdown: the first SIGTERM/SIGINT stops admitting requests
(503 + /health 'draining'), lets in-flight requests finish for up to the drain timeout, aborts the
rest (their clients get an error, not a cut connection), then exits 0. A second signal exits at
once. A model that fails to load stops the server with a one-line error. An engine that dies
while serving (a device fault, a lost rank) ends the process with status 1 within
DEAD_EXIT_DEADLINE_S: its requests got their error events, /health said "dead" meanwhile."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading
from types import FrameType

import uvicorn
from fastapi import FastAPI

from homelab_llm.errors import HomelabError
from homelab_llm.server.state import ServerState

log = logging.getLogger("homelab_llm.server")

DEAD_EXIT_DEADLINE_S = 9.0  # after the engine died, the process is gone by then, stuck or not
DEAD_FLUSH_S = 0.5  # time for the handlers to send their final error events


class ServeError(HomelabError):
    """The server could not start or the engine could not load."""


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._watch_task = asyncio.ensure_future(self._watch_load())
        try:
            await super().serve(sockets)
        finally:
            self._watch_task.cancel()

    async def _watch_load(self) -> None:
        client = self.state.client
        while client.state == "loading" and not self.should_exit:
            await asyncio.sleep(0.05)
        if client.state == "failed":
            self.should_exit = True
        elif client.state == "ready":
            log.info("ready: serving %s", ", ".join(self.state.config.served_model_names))
            await self._watch_dead()

    async def _watch_dead(self) -> None:
        """A dead engine ends the server. A watchdog makes sure of it even if the engine thread
        (or uvicorn's graceful close) is stuck behind a broken device."""
        client = self.state.client
        while client.state != "dead" and not self.should_exit:
            await asyncio.sleep(0.1)
        if client.state != "dead":
            return
        log.error("the engine is dead (%s); exiting", client.dead_reason)
        watchdog = threading.Timer(DEAD_EXIT_DEADLINE_S, _exit_now, args=(client.dead_reason,))
        watchdog.daemon = True
        watchdog.start()
        await asyncio.sleep(DEAD_FLUSH_S)
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after exit, and a drained
        # shutdown should end with status 0.
        if self._drain_task is not None or self._loop is None:
            self.should_exit = True
            self.force_exit = sig == signal.SIGINT
            return
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        state = self.state
        state.draining = True
        timeout = state.config.drain_timeout_s
        log.info("shutting down: draining %d request(s) for up to %.0f s",
                 state.client.num_unfinished, timeout)
        aborted = await state.client.drain(timeout)
        if aborted:
            log.warning("aborted %d request(s) still running after %.0f s", aborted, timeout)
            await asyncio.sleep(0.2)  # let their handlers send the final error frames
        self.should_exit = True


def _exit_now(reason: str | None) -> None:
    print(f"homelab-llm serve: the engine is dead ({reason}); exiting without a clean shutdown",
          file=sys.stderr, flush=True)
    os._exit(1)


def serve(app: FastAPI, host: str, port: int, log_level: str = "info") -> int:
    """Serve until a signal; returns the exit status (raises ServeError if the model fails)."""
    state: ServerState = app.state.server
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=5, access_log=log_level == "debug")
    server = DrainingServer(config, state)
    try:
        server.run()
    except OSError as err:
        raise ServeError(f"cannot listen on {host}:{port}: {err.strerror or err}") from err
    if state.client.state == "failed":
        raise ServeError(f"the model failed to load: {state.client.load_error}")
    if not server.started:
        raise ServeError(f"the server did not start on {host}:{port} (see the log above)")
    if state.client.state == "dead":
        print(f"homelab-llm serve: the engine is dead: {state.client.dead_reason}",
              file=sys.stderr, flush=True)
        return 1
    return 0
