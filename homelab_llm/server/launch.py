"""Run the app under uvicorn with our shutdown: the first SIGTERM/SIGINT stops admitting requests
(503 + /health 'draining'), lets in-flight requests finish for up to the drain timeout, aborts the
rest (their clients get an error, not a cut connection), then exits 0. A second signal aborts
everything at once: streams still get an error event and [DONE], and the exit status is
128 + the signal number. A model that fails to load stops the server with a one-line error. An
engine that dies while serving (a device fault, a lost rank) ends the process with status 1
within DEAD_EXIT_DEADLINE_S: its requests got their error events, /health said "dead" meanwhile.

The port is bound (`bind_socket`) before the model loads, so a busy port costs a second, not a
model load."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import sys
import threading
import time
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
        self._abort_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self._signals = 0  # counted in the handler itself: two quick signals must both count
        self.exit_code = 0

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._watch_task = asyncio.ensure_future(self.watch_engine())
        try:
            await super().serve(sockets)
        finally:
            self._watch_task.cancel()

    async def watch_engine(self) -> None:
        """From serve's start: a failed load stops the server; a dead engine ends it (status 1)."""
        client = self.state.client
        while client.state == "loading" and not self.should_exit:
            await asyncio.sleep(0.05)
        if client.state == "failed":
            self.should_exit = True
            return
        if client.state == "ready":
            log.info("ready: serving %s", ", ".join(self.state.config.served_model_names))
        # Also when the engine died between two looks (ready, a request, dead within one poll):
        # it must still end the server.
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
        self._signals += 1
        if self._loop is None:
            self.should_exit = True
            self.force_exit = sig == signal.SIGINT
        elif self._signals == 1:
            self._loop.call_soon_threadsafe(self._start_drain)
        else:
            self.exit_code = 128 + sig
            self._loop.call_soon_threadsafe(self._start_abort)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self.drain())

    def _start_abort(self) -> None:
        if self._abort_task is None:
            self._abort_task = asyncio.ensure_future(self.abort_now())

    async def abort_now(self) -> None:
        """The second signal: abort every request now, give their handlers a moment to send the
        error event and [DONE], then stop without waiting for anything else."""
        self.state.draining = True
        aborted = await self.state.client.drain(0)
        log.warning("second signal: aborted %d request(s); exiting now", aborted)
        deadline = time.monotonic() + 1.0
        while self.server_state.tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.should_exit = True
        self.force_exit = True

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
    exit_without_teardown(1)


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (uvicorn listens on it later); a busy port is a one-line
    ServeError at once."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as err:
        raise ServeError(f"cannot resolve --host {host!r}: {err.strerror}") from err
    sock = socket.socket(family, kind, proto)
    # As uvicorn does: a port left in TIME_WAIT by our previous run is free; a listening one is not.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise ServeError(f"port {port} on {host} is in use") from err
        raise ServeError(f"cannot listen on {host}:{port}: {err.strerror or err}") from err
    return sock


def serve(app: FastAPI, host: str, port: int, log_level: str = "info",
          sock: socket.socket | None = None) -> int:
    """Serve until a signal on `sock` (bound here if not given); returns the exit status (raises
    ServeError if the port is busy or the model fails to load). A dead engine ends the process
    here with status 1 (exit_without_teardown)."""
    state: ServerState = app.state.server
    sock = sock or bind_socket(host, port)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=5, access_log=log_level == "debug")
    server = DrainingServer(config, state)
    try:
        server.run(sockets=[sock])
    except OSError as err:
        raise ServeError(f"cannot listen on {host}:{port}: {err.strerror or err}") from err
    finally:
        sock.close()
    if state.client.state == "failed":
        raise ServeError(f"the model failed to load: {state.client.load_error}")
    if not server.started:
        raise ServeError(f"the server did not start on {host}:{port} (see the log above)")
    if state.client.state == "dead":
        print(f"homelab-llm serve: the engine is dead: {state.client.dead_reason}",
              file=sys.stderr, flush=True)
        exit_without_teardown(1)
    return server.exit_code


def exit_without_teardown(status: int) -> None:
    """End the process now, logs and stdio flushed, skipping the interpreter's teardown: after a
    dead engine nothing is left to stop (its process is gone, its helpers die with the server),
    and teardown is where a thread stuck behind the dead engine would hold the exit, past the
    point where the watchdog's daemon thread can still run."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)
