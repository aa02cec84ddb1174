"""The engine thread behind the async client, driven directly (no HTTP)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from homelab_llm.engine.sampling_params import SamplingParams
from homelab_llm.errors import HomelabError
from homelab_llm.server.engine_client import EngineClient
from tests.server.fake_engine import FakeEngine


class StuckEngine(FakeEngine):
    """Has work it can never schedule: step() returns nothing, forever."""

    def has_unfinished_requests(self) -> bool:
        return True

    def step(self):
        self.steps += 1
        return []


async def started(engine: FakeEngine) -> EngineClient:
    client = EngineClient(lambda: engine)
    client.start()
    assert await client.wait_ready(10)
    return client


async def test_outputs_arrive_in_order_and_status_runs_on_the_engine_thread() -> None:
    engine = FakeEngine()
    client = await started(engine)
    sink: asyncio.Queue = asyncio.Queue()
    await client.add("r", engine.tokenizer.encode("SAY[[hey]]"), SamplingParams(max_tokens=8), sink)
    text, finished = "", None
    while finished is None:
        out = await sink.get()
        text += out.new_text
        finished = out.finish_reason if out.finished else None
    assert (text, finished) == ("hey", "stop")
    assert client.num_unfinished == 0
    status = await client.call(lambda e: (threading.get_ident(), e.status()))
    assert status[0] != threading.get_ident() and len(engine.thread_ids) == 1
    await client.shutdown()
    assert engine.shut_down


async def test_add_errors_reach_the_caller() -> None:
    engine = FakeEngine(max_model_len=16)
    client = await started(engine)
    with pytest.raises(HomelabError, match="16"):
        await client.add("r", list(range(3, 20)), SamplingParams(max_tokens=4), asyncio.Queue())
    assert client.num_unfinished == 0
    await client.shutdown()


async def test_abort_stops_delivery_and_frees_the_request() -> None:
    engine = FakeEngine(step_delay=0.005)
    client = await started(engine)
    sink: asyncio.Queue = asyncio.Queue()
    await client.add("r", [5, 6, 7], SamplingParams(max_tokens=500), sink)
    await sink.get()
    client.abort("r")
    await asyncio.sleep(0.05)
    assert (await client.call(lambda e: e.status()))["requests"] == {"running": 0, "waiting": 0}
    while not sink.empty():  # at most what was already in flight, never a final output
        assert not sink.get_nowait().finished
    await client.shutdown()


async def test_an_engine_with_unschedulable_work_does_not_spin() -> None:
    engine = StuckEngine()
    client = await started(engine)
    await asyncio.sleep(0.3)
    # ~1 ms back-off per empty step: a few hundred at most in 0.3 s, where a spin makes 10^5.
    assert engine.steps < 600
    await client.shutdown()
