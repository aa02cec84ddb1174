"""Servers for the server tests: the real app under a real uvicorn on 127.0.0.1, ephemeral port,
over the fake engine (tests/server/fake_engine.py) unless a test says otherwise."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import openai
import pytest

from homelab_llm.server.app import build_app
from homelab_llm.server.state import ServerConfig
from tests.server.fake_engine import FakeEngine
from tests.server.harness import Running, serve_in_thread


@contextmanager
def fake_server(engine_factory: Callable[[], Any] | None = None, wait_ready: bool = True,
                engine_process: bool = False, **config: Any) -> Iterator[Running]:
    """engine_process: the engine in its own process (the factory must pickle)."""
    names = config.pop("served_model_names", ("fake", "fake-alias"))
    app = build_app(ServerConfig(served_model_names=names, model_path="/models/fake.gguf", **config),
                    engine_factory or FakeEngine, engine_process=engine_process)
    with serve_in_thread(app, wait_ready=wait_ready) as running:
        yield running


def openai_client(running: Running, api_key: str = "unused") -> openai.OpenAI:
    # No retries: a 429 or 503 must reach the test, not be retried away.
    return openai.OpenAI(base_url=f"{running.base_url}/v1", api_key=api_key, max_retries=0,
                         timeout=30)


@pytest.fixture(scope="module")
def server() -> Iterator[Running]:
    with fake_server() as running:
        yield running


@pytest.fixture
def client(server: Running) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture
def engine(server: Running) -> FakeEngine:
    return server.state.client.engine
