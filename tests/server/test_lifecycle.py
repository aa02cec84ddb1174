"""Disconnects, the engine thread's manners, /v1/status and /metrics, and SIGTERM draining."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import fake_server, in_thread_engine
from tests.server.fake_engine import FakeEngine
from tests.server.harness import wait_for

REPO = Path(__file__).resolve().parents[2]
USER = [{"role": "user", "content": "hi"}]
# Where `serve` runs the engine: a thread of the server, or its own process (the CLI's default).
MODES = pytest.mark.parametrize("mode", ["thread", "process"])


def status(running) -> dict:
    return httpx.get(f"{running.base_url}/v1/status").json()


@pytest.fixture(scope="module")
def slow():
    with fake_server(lambda: FakeEngine(step_delay=0.01)) as running:
        yield running


def test_stream_disconnect_aborts_within_a_second(slow) -> None:
    body = {"messages": USER, "max_tokens": 900, "stream": True}
    with httpx.stream("POST", f"{slow.base_url}/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()  # keep a reference: a collected iterator closes the stream
        next(lines)
        assert status(slow)["requests"]["running"] == 1
        t0 = time.monotonic()
    wait_for(lambda: status(slow)["requests"] == {"running": 0, "waiting": 0}, 1.0, "abort")
    assert time.monotonic() - t0 < 1.0
    assert status(slow)["kv"]["tokens_used"] == 0  # its pages are free
    assert slow.state.client.num_unfinished == 0


def test_non_stream_disconnect_aborts(slow) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{slow.base_url}/v1/chat/completions",
                   json={"messages": USER, "max_tokens": 900}, timeout=0.3)
    wait_for(lambda: status(slow)["requests"] == {"running": 0, "waiting": 0}, 1.0, "abort")
    assert slow.state.client.num_unfinished == 0


def test_engine_thread_sleeps_when_idle_and_is_the_only_caller(slow) -> None:
    engine = in_thread_engine(slow)
    httpx.post(f"{slow.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 3})
    steps = engine.steps
    time.sleep(0.3)
    assert engine.steps == steps  # no stepping without work
    status(slow)
    assert len(engine.thread_ids) == 1  # status() too ran on the engine thread


def test_status_contract(slow) -> None:
    httpx.post(f"{slow.base_url}/v1/completions", json={"prompt": "abc", "max_tokens": 5})
    s = status(slow)
    assert set(s) == {"config", "devices", "kv", "requests", "prefix_cache", "throughput",
                      "latency", "uptime"}
    assert set(s["devices"][0]) == {"name", "total", "weights", "activations_peak", "graphs",
                                    "kv_cache", "state", "other", "free"}
    assert s["devices"][0]["state"] == 0  # no recurrent state on a plain transformer
    assert set(s["kv"]) >= {"page_size", "dtype", "tokens_capacity", "tokens_used"}
    assert set(s["requests"]) == {"running", "waiting"}
    assert set(s["prefix_cache"]) >= {"query_tokens", "hit_tokens"}
    assert s["throughput"]["generation_tps"] > 0 and s["throughput"]["prompt_tps"] > 0
    assert s["latency"]["ttft_p50"] > 0 and s["latency"]["ttft_p95"] >= s["latency"]["ttft_p50"]
    assert s["latency"]["tpot_p50"] > 0
    assert s["uptime"] > 0


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"homelab_llm:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_prefix_hits_in_status_metrics_and_usage() -> None:
    with fake_server() as running:
        base = "shared context " * 20  # 300 characters = 300 tokens, +BOS
        url = f"{running.base_url}/v1/completions"
        first = httpx.post(url, json={"prompt": base + "tail one", "max_tokens": 2}).json()
        before = status(running)["prefix_cache"]
        second = httpx.post(url, json={"prompt": base + "tail two", "max_tokens": 2}).json()
        after = status(running)["prefix_cache"]
        shared = 1 + len(base) + len("tail ")  # BOS + every common byte token
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == shared
        assert after["hit_tokens"] - before["hit_tokens"] == shared
        assert after["query_tokens"] - before["query_tokens"] == second["usage"]["prompt_tokens"]
        text = httpx.get(f"{running.base_url}/metrics").text
        assert metric(text, "prefix_cache_hits_total") == after["hit_tokens"]
        assert metric(text, "prefix_cache_queries_total") == after["query_tokens"]


def test_metrics_names_and_counts() -> None:
    with fake_server() as running:
        for _ in range(3):
            httpx.post(f"{running.base_url}/v1/completions", json={"prompt": "ab", "max_tokens": 4})
        r = httpx.get(f"{running.base_url}/metrics")
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        text = r.text
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                     "num_preemptions_total"):
            assert metric(text, name) == 0
        assert metric(text, "prompt_tokens_total") == 9
        assert metric(text, "generation_tokens_total") == 12
        for hist in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                     "e2e_request_latency_seconds"):
            assert f"# TYPE homelab_llm:{hist} histogram" in text
            assert metric(text, f"{hist}_count") == 3
            assert f'homelab_llm:{hist}_bucket{{model_name="fake",le="+Inf"}} 3' in text
        assert 'homelab_llm:request_success_total{model_name="fake",finished_reason="length"} 3' in text


# ---- SIGTERM -----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_child(drain_s: float, step_delay: float, mode: str = "thread",
                *flags: str) -> tuple[subprocess.Popen, str]:
    """`serve` over the fake engine in a child process; mode: the engine in a "thread" of it or
    in its own "process"; flags: serve_fake's ("stuck")."""
    port = free_port()
    child = subprocess.Popen([sys.executable, "-m", "tests.server.serve_fake", str(port),
                              str(drain_s), str(step_delay), mode, *flags], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert child.poll() is None, child.stdout.read().decode()
        try:
            return httpx.get(f"{base}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    wait_for(healthy, 20, "the child server")
    return child, base


def stream_in_thread(base: str, max_tokens: int, first_line: threading.Event) -> list[str]:
    lines: list[str] = []

    def run() -> None:
        body = {"messages": USER, "max_tokens": max_tokens, "stream": True}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    first_line.set()

    threading.Thread(target=run, daemon=True).start()
    return lines


def reap(child: subprocess.Popen) -> int:
    """The child's exit status within 15 s; past that it is killed and the failure shows what it
    printed (read without blocking: a grandchild may still hold the pipe open)."""
    try:
        return child.wait(15)
    except subprocess.TimeoutExpired as err:
        child.kill()
        child.wait()
        os.set_blocking(child.stdout.fileno(), False)
        printed = (child.stdout.read() or b"").decode(errors="replace")
        raise AssertionError(f"the child did not exit within 15 s; it printed:\n{printed[-4000:]}") from err
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@MODES
def test_sigterm_drains_in_flight_requests_and_exits_0(mode: str) -> None:
    child, base = start_child(drain_s=20, step_delay=0.01, mode=mode)
    try:
        started = threading.Event()
        lines = stream_in_thread(base, 60, started)
        assert started.wait(10)
        child.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(f"{base}/health").status_code == 503, 5, "draining")
        refused = httpx.post(f"{base}/v1/completions", json={"prompt": "x"})
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        assert reap(child) == 0
    finally:
        reap(child)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["choices"][0]["delta"].get("content", "")) for c in chunks) == 60


def running_stream(base: str, max_tokens: int) -> list[str]:
    started = threading.Event()
    lines = stream_in_thread(base, max_tokens, started)
    assert started.wait(10)
    return lines


def final_error(lines: list[str]) -> dict:
    """The error event just before the stream's [DONE]."""
    wait_for(lambda: lines and lines[-1] == "data: [DONE]", 5, "[DONE]")
    return json.loads(lines[-2][6:])["error"]


@MODES
def test_sigterm_aborts_after_the_drain_timeout_with_an_error_event(mode: str) -> None:
    child, base = start_child(drain_s=0.3, step_delay=0.01, mode=mode)
    try:
        lines = running_stream(base, 900)
        t0 = time.monotonic()
        child.send_signal(signal.SIGTERM)
        assert reap(child) == 0
        assert time.monotonic() - t0 < 5
    finally:
        reap(child)
    error = final_error(lines)
    assert "shutting down" in error["message"] and error["code"] == "service_unavailable"


@MODES
def test_second_sigterm_ends_streams_with_an_error_and_exits_non_zero(mode: str) -> None:
    child, base = start_child(drain_s=20, step_delay=0.01, mode=mode)
    try:
        lines = running_stream(base, 900)
        child.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(f"{base}/health").status_code == 503, 5, "draining")
        assert lines[-1] != "data: [DONE]"  # the first signal drains: the stream goes on
        child.send_signal(signal.SIGTERM)
        assert reap(child) == 128 + signal.SIGTERM
    finally:
        reap(child)
    assert "shutting down" in final_error(lines)["message"]


@pytest.mark.parametrize("tp", ["1", "2"])
def test_busy_port_is_one_line_and_exit_2_before_loading(tp) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        # A model path that does not exist: had the server tried to load it first, the error
        # would be about the model, not the port.
        child = subprocess.Popen(
            [sys.executable, "-m", "homelab_llm", "serve", "/nonexistent/model.gguf", "--host",
             "127.0.0.1", "--port", str(port), "--tensor-parallel-size", tp, "--device", "cpu"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = child.communicate(timeout=60)
        finally:
            reap(child)
    assert child.returncode == 2
    assert err.splitlines() == [f"homelab-llm serve: error: port {port} on 127.0.0.1 is in use"]
    assert out == ""
