"""The engine in its own process (`serve`'s default): it dies with the server (even a SIGKILL of
the server leaves no orphan), the server notices its death (dead-engine semantics, exit 1), an
abort frees the request in the engine, and load errors cross as the same one line."""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from operator import methodcaller
from pathlib import Path

import httpx
import pytest

from homelab_llm.errors import HomelabError
from homelab_llm.server.engine_process import ProcessEngineClient
from tests.server.conftest import fake_server
from tests.server.fake_engine import FakeEngine
from tests.server.harness import wait_for
from tests.server.test_lifecycle import reap, running_stream, start_child


def children_of(pid: int) -> list[int]:
    """Every live (non-zombie) descendant of pid, from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(entry.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        found += kids
        frontier += kids
    return found


def engine_pid(server_pid: int) -> int:
    """The engine process among the server's children (multiprocessing's resource tracker may
    be one too)."""
    for pid in children_of(server_pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"spawn_main" in cmdline:
            return pid
    raise AssertionError(f"no engine process under {server_pid}")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigkill_of_the_server_leaves_no_orphan() -> None:
    child, base = start_child(drain_s=20, step_delay=0.01, mode="process")
    try:
        descendants = children_of(child.pid)
        engine = engine_pid(child.pid)
        body = {"prompt": "x", "max_tokens": 900, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)  # the engine is busy stepping, not waiting on the pipe
            child.send_signal(signal.SIGKILL)
            reap(child)
        wait_for(lambda: not any(alive(p) for p in descendants), 5,
                 "the engine process (and any helper) to die with the server")
        assert not alive(engine)
    finally:
        reap(child)


def test_killing_the_engine_process_makes_the_server_dead_and_exit_1() -> None:
    child, base = start_child(drain_s=20, step_delay=0.01, mode="process")
    try:
        lines = running_stream(base, 900)
        os.kill(engine_pid(child.pid), signal.SIGKILL)
        wait_for(lambda: lines and lines[-1] == "data: [DONE]", 5, "the stream's end")
        error = json.loads(lines[-2][len("data: "):])["error"]
        assert "the engine is dead" in error["message"] and "SIGKILL" in error["message"]
        assert reap(child) == 1
        output = child.stdout.read().decode()
        assert "the engine process ended (killed by SIGKILL)" in output, output
    finally:
        reap(child)


def test_a_dead_engine_exits_past_a_stuck_thread_at_once() -> None:
    """After a dead engine the server ends without the interpreter's teardown, so a thread that
    would never end (one stuck behind the dead device, say) cannot hold the exit: status 1 in
    well under the watchdog's DEAD_EXIT_DEADLINE_S (9 s), the normal path's ~1 s."""
    child, base = start_child(20, 0.01, "process", "stuck")
    try:
        lines = running_stream(base, 900)
        os.kill(engine_pid(child.pid), signal.SIGKILL)
        wait_for(lambda: lines and lines[-1] == "data: [DONE]", 5, "the stream's end")
        assert child.wait(6) == 1
        assert "the engine is dead" in child.stdout.read().decode()
    finally:
        reap(child)


def test_abort_mid_stream_frees_the_request_in_the_engine() -> None:
    with fake_server(functools.partial(FakeEngine, step_delay=0.01), engine_process=True) as running:
        base = running.base_url
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 900, "stream": True}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()  # keep a reference: a collected iterator closes the stream
            next(lines)
            running_now = httpx.get(f"{base}/v1/status").json()["requests"]["running"]
            assert running_now == 1
        wait_for(lambda: httpx.get(f"{base}/v1/status").json()["requests"]["running"] == 0, 5,
                 "the engine to drop the aborted request")
        assert running.state.client.num_unfinished == 0


def test_status_and_metrics_come_from_the_engine_process() -> None:
    with fake_server(engine_process=True) as running:
        status = httpx.get(f"{running.base_url}/v1/status").json()
        assert status["config"]["model"] == "fake" and status["requests"]["running"] == 0
        metrics = httpx.get(f"{running.base_url}/metrics").text
        assert 'homelab_llm:num_requests_running{model_name="fake"} 0' in metrics
        assert running.state.client.engine.max_model_len == FakeEngine().max_model_len


def refuse_to_load() -> FakeEngine:
    raise HomelabError("--max-model-len 99 is too large; lower --max-model-len")


def test_a_load_error_crosses_as_the_same_line() -> None:
    with fake_server(refuse_to_load, wait_ready=False, engine_process=True) as running:
        client = running.state.client
        wait_for(lambda: client.state == "failed", 30, "the load failure")
        assert client.load_error == ("HomelabError: --max-model-len 99 is too large; lower "
                                     "--max-model-len")
        health = httpx.get(f"{running.base_url}/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"


async def test_a_call_that_cannot_pickle_is_a_clear_error() -> None:
    client = ProcessEngineClient(FakeEngine)
    client.start()
    try:
        assert await client.wait_ready(30) and client.state == "ready"
        with pytest.raises(TypeError, match="cannot send this to the engine process"):
            await client.call(lambda engine: engine.status())
        assert (await client.call(methodcaller("status")))["requests"]["running"] == 0
    finally:
        await client.shutdown()
    assert client.state == "stopped" and not alive(client.pid)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_the_engine_process_ignores_terminal_signals(signum: int) -> None:
    # Ctrl-C reaches the whole process group: the server drains, the engine keeps serving.
    with fake_server(engine_process=True) as running:
        pid = running.state.client.pid
        os.kill(pid, signum)
        time.sleep(0.3)
        assert alive(pid)
        r = httpx.post(f"{running.base_url}/v1/completions",
                       json={"prompt": "SAY[[ok]]", "max_tokens": 4}, timeout=10)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"


def test_errors_that_do_not_pickle_cross_as_their_family() -> None:
    from homelab_llm.engine.faults import SequenceFault
    from homelab_llm.server.engine_core import portable_error

    fault = portable_error(SequenceFault("r1", "position 9 is past the page table"))
    assert type(fault) is HomelabError and "position 9" in str(fault)
    plain = ValueError("bad")
    assert portable_error(plain) is plain

    class Local(RuntimeError):  # a class pickle cannot find by name
        pass

    other = portable_error(Local("it broke"))
    assert type(other) is RuntimeError and str(other) == "Local: it broke"
