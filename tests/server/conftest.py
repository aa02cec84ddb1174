"""Servers for the server tests: the real app under a real uvicorn on 127.0.0.1, ephemeral port,
over the fake engine (tests/server/fake_engine.py) unless a test says otherwise."""

from __future__ import annotations

import os
import pickle
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import openai
import pytest

from homelab_llm.server.app import build_app
from homelab_llm.server.state import ServerConfig
from tests.server.fake_engine import FakeEngine
from tests.server.harness import Running, serve_in_thread

ENGINE_PROCESS = os.environ.get("HOMELAB_LLM_TEST_ENGINE_PROCESS") == "1"


@contextmanager
def fake_server(engine_factory: Callable[[], Any] | None = None, wait_ready: bool = True,
                engine_process: bool | None = None, **config: Any) -> Iterator[Running]:
    """engine_process: the engine in its own process (the factory must pickle); by default in a
    thread, or in a process when $HOMELAB_LLM_TEST_ENGINE_PROCESS=1 (to run the server tests
    against serve's default mode; tests that inspect the fake engine's object skip then)."""
    factory = engine_factory or FakeEngine
    if engine_process is None:  # a local closure cannot reach another process: in-thread then
        engine_process = ENGINE_PROCESS and picklable(factory)
    names = config.pop("served_model_names", ("fake", "fake-alias"))
    app = build_app(ServerConfig(served_model_names=names, model_path="/models/fake.gguf", **config),
                    factory, engine_process=engine_process)
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
    # As `serve` runs it by default: the engine (and its grammar matching) in its own process.
    app = build_app(ServerConfig(("smollm2",), model_path=str(smollm2_path)),
                    functools.partial(LLMEngine, args), engine_process=True)
    with serve_in_thread(app, timeout=240) as running:
        yield running


@pytest.fixture(scope="module")
def server() -> Iterator[Running]:
    with fake_server() as running:
        yield running


@pytest.fixture
def client(server: Running) -> openai.OpenAI:
    return openai_client(server)


def picklable(obj: Any) -> bool:
    try:
        pickle.dumps(obj)
        return True
    except Exception:
        return False


def in_thread_engine(running: Running) -> FakeEngine:
    """The fake engine object itself, for tests that inspect or patch it; skips the test when
    the engine runs in its own process."""
    engine = running.state.client.engine
    if not isinstance(engine, FakeEngine):
        pytest.skip("inspects the fake engine's object: only with the engine in-thread")
    return engine


@pytest.fixture
def engine(server: Running) -> FakeEngine:
    return in_thread_engine(server)
