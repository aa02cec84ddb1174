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
                **config: Any) -> Iterator[Running]:
    names = config.pop("served_model_names", ("fake", "fake-alias"))
    app = build_app(ServerConfig(served_model_names=names, model_path="/models/fake.gguf", **config),
                    engine_factory or (lambda: FakeEngine()))
    with serve_in_thread(app, wait_ready=wait_ready) as running:
        yield running


def openai_client(running: Running, api_key: str = "unused") -> openai.OpenAI:
    # No retries: a 429 or 503 must reach the test, not be retried away.
    return openai.OpenAI(base_url=f"{running.base_url}/v1", api_key=api_key, max_retries=0,
                         timeout=30)


@pytest.fixture(scope="module")
def smollm2_server(smollm2_path) -> Iterator[Running]:
    """The real engine (SmolLM2-135M on the CPU) behind the app, served as "smollm2"."""
    from homelab_llm.engine.args import EngineArgs
    from homelab_llm.engine.core import LLMEngine

    # fp32 KV on the CPU is 45 KiB/token for this model: 128 MiB holds ~2900 tokens.
    args = EngineArgs(model=str(smollm2_path), device="cpu", max_model_len=2048,
                      kv_cache_memory_bytes=128 << 20, max_num_seqs=32)
    app = build_app(ServerConfig(("smollm2",), model_path=str(smollm2_path)), lambda: LLMEngine(args))
    with serve_in_thread(app, timeout=240) as running:
        yield running


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
