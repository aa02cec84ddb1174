"""A dead engine says so: in-flight requests get an error event and [DONE], new requests 503,
/health 503 {"status": "dead", "reason"}, and the `serve` process exits non-zero."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import httpx
import uvicorn

from homelab_llm.server import launch
from tests.server.conftest import fake_server, in_thread_engine
from tests.server.fake_engine import FakeEngine
from tests.server.test_lifecycle import MODES, reap, start_child, stream_in_thread, wait_for

USER = [{"role": "user", "content": "hi"}]
DIE = [{"role": "user", "content": "DIE-STEP"}]


def stream_lines(base: str, messages: list[dict], max_tokens: int) -> list[str]:
    body = {"messages": messages, "max_tokens": max_tokens, "stream": True}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line]


def assert_error_then_done(lines: list[str], text: str) -> None:
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert text in error["message"], error


def test_a_fatal_step_fails_every_stream_and_the_engine_reports_dead() -> None:
    with fake_server(lambda: FakeEngine(step_delay=0.01)) as running:
        base = running.base_url
        started = threading.Event()
        other = stream_in_thread(base, 900, started)
        assert started.wait(10)
        dying = stream_lines(base, DIE, 8)
        assert_error_then_done(dying, "the engine is dead")
        assert_error_then_done(dying, "illegal memory access")
        wait_for(lambda: other and other[-1] == "data: [DONE]", 5, "the other stream's end")
        assert_error_then_done(other, "the engine is dead")

        health = httpx.get(f"{base}/health")
        assert health.status_code == 503
        assert health.json() == {"status": "dead", "reason": "RuntimeError: CUDA error: an illegal "
                                                             "memory access was encountered"}
        refused = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and "dead" in refused.json()["error"]["message"]
        assert running.state.client.num_unfinished == 0


def test_an_idle_engine_that_dies_is_noticed() -> None:
    with fake_server() as running:
        engine = in_thread_engine(running)
        engine.dead_reason = "tensor parallelism stopped: rank 1 exited with code -9"
        wait_for(lambda: httpx.get(f"{running.base_url}/health").status_code == 503, 5,
                 "/health to say dead")
        body = httpx.get(f"{running.base_url}/health").json()
        assert body == {"status": "dead", "reason": engine.dead_reason}
        refused = httpx.post(f"{running.base_url}/v1/chat/completions",
                             json={"messages": USER, "max_tokens": 2})
        assert refused.status_code == 503 and "rank 1 exited" in refused.json()["error"]["message"]


@MODES
def test_serve_exits_non_zero_soon_after_the_engine_dies(mode: str) -> None:
    child, base = start_child(drain_s=20, step_delay=0.01, mode=mode)
    try:
        started = threading.Event()
        other = stream_in_thread(base, 900, started)
        assert started.wait(10)
        dying = stream_lines(base, DIE, 8)
        died_at = time.monotonic()
        assert_error_then_done(dying, "the engine is dead")
        code = child.wait(10)  # the contract: gone within 10 s of the fault
        assert code == 1, child.stdout.read().decode()
        assert time.monotonic() - died_at < 10
        output = child.stdout.read().decode()
        assert "the engine is dead" in output
    finally:
        reap(child)
    wait_for(lambda: other and other[-1] == "data: [DONE]", 5, "the other stream's end")
    assert_error_then_done(other, "the engine is dead")


def test_an_engine_dead_between_two_looks_of_the_load_watch_still_ends_the_server(monkeypatch) -> None:
    """The engine turned ready and died within one poll of the load watch (a request can finish
    its first token and the engine be killed in ~30 ms): the server must still exit, watchdog
    armed. It used to stay up for good, 'dead' on /health (CI saw it as a 15 s timeout)."""
    armed: list[float] = []  # the watchdog's threading.Timer, recorded and never fired
    monkeypatch.setattr(launch.threading, "Timer", lambda interval, function, args=(): SimpleNamespace(
        daemon=False, start=lambda: armed.append(interval)))
    monkeypatch.setattr(launch, "DEAD_FLUSH_S", 0.0)
    client = SimpleNamespace(state="loading", dead_reason="killed by SIGKILL")
    state = SimpleNamespace(client=client, config=SimpleNamespace(served_model_names=("fake",)))
    server = launch.DrainingServer(uvicorn.Config(app=None), state)

    async def scenario() -> None:
        watch = asyncio.ensure_future(server.watch_engine())
        await asyncio.sleep(0.01)  # the watch is inside its poll's sleep
        client.state = "ready"
        client.state = "dead"
        await asyncio.wait_for(watch, 5)

    asyncio.run(scenario())
    assert server.should_exit
    assert armed == [launch.DEAD_EXIT_DEADLINE_S]
