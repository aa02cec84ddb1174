"""Run an app under a real uvicorn on 127.0.0.1 with an ephemeral port, in a thread, and stop it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import uvicorn
from fastapi import FastAPI


@dataclass
class Running:
    app: FastAPI
    base_url: str
    server: uvicorn.Server

    @property
    def state(self):
        return self.app.state.server


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


@contextmanager
def serve_in_thread(app: FastAPI, wait_ready: bool = True, timeout: float = 20.0) -> Iterator[Running]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        if wait_ready:
            while httpx.get(f"{base}/health").status_code != 200:
                if app.state.server.client.state == "failed":
                    raise RuntimeError(f"the engine failed: {app.state.server.client.load_error}")
                if time.monotonic() > deadline:
                    raise RuntimeError("the engine did not become ready")
                time.sleep(0.02)
        yield Running(app, base, server)
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
        assert not thread.is_alive(), "uvicorn thread did not stop"
