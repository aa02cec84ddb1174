"""The service manager: health, stop with escalation, crash, busy port, and no orphans however
the parent ends. Children are tiny Python processes; every one is reaped by the test."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from homelab_llm.tui.process_group import PortBusyError, free_port, process_group_alive
from homelab_llm.tui.service import ServiceManager, ServiceState, StateChanged
from tui_fakes import crash_preset, tiny_preset

pytestmark = pytest.mark.timeout(60)


def wait_for(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it is dead for our purposes once its parent reaps it
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def manager():
    m = ServiceManager(grace_s=2.0, health_interval_s=0.05)
    yield m
    m.stop(grace_s=0.5)


def test_start_healthy_stop_leaves_no_process(manager: ServiceManager, tmp_path: Path) -> None:
    pidfile = tmp_path / "pids.json"
    events: list[ServiceState] = []
    manager.subscribe(lambda e: events.append(e.status.state) if isinstance(e, StateChanged) else None)
    manager.start(tiny_preset("tiny", free_port(), "--health-delay", "0.3", pidfile=pidfile))
    wait_for(lambda: manager.status.state is ServiceState.HEALTHY, what="healthy")
    assert manager.status.ready_after_s is not None and manager.status.ready_after_s >= 0.3
    pids = json.loads(pidfile.read_text())
    pgid = manager.status.pid
    assert pgid == pids["pid"] and os.getpgid(pids["worker"]) == pgid  # worker shares the group
    assert any("tiny server on" in line for line in manager.logs)
    code = manager.stop()
    assert code == -signal.SIGTERM
    assert not process_group_alive(pgid) and not pid_alive(pids["worker"])
    changes = [s for i, s in enumerate(events) if i == 0 or events[i - 1] is not s]
    assert changes == [ServiceState.STARTING, ServiceState.HEALTHY, ServiceState.STOPPING,
                       ServiceState.STOPPED]  # (load progress repeats STARTING with new figures)


def test_stop_escalates_to_sigkill(manager: ServiceManager, tmp_path: Path) -> None:
    manager.start(tiny_preset("stubborn", free_port(), "--ignore-term", pidfile=tmp_path / "p"))
    wait_for(lambda: manager.status.state is ServiceState.HEALTHY, what="healthy")
    pgid = manager.status.pid
    started = time.monotonic()
    assert manager.stop(grace_s=0.5) == -signal.SIGKILL
    assert 0.5 <= time.monotonic() - started < 5.0
    assert not process_group_alive(pgid)


def test_crash_shows_exit_code_and_last_lines(manager: ServiceManager) -> None:
    manager.start(crash_preset(free_port()))
    wait_for(lambda: manager.status.state is ServiceState.CRASHED, what="crash")
    status = manager.status
    assert status.exit_code == 1 and "exited with code 1" in status.message
    assert status.last_lines[-1] == "INFO:     Finished server process [4242]"
    assert status.reason == "fatal: out of memory"
    assert not status.running


def test_busy_port_is_refused_before_starting(manager: ServiceManager) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(PortBusyError, match=f"port {port} on 127.0.0.1 is already in use"):
            manager.start(tiny_preset("tiny", port))
    assert manager.status.state is ServiceState.STOPPED and manager.status.pid is None


def test_missing_program_is_a_clear_error(manager: ServiceManager) -> None:
    from homelab_llm.presets import Preset
    from homelab_llm.tui.service import ServiceError

    preset = Preset(name="nope", backend="command", command=("/no/such/server",), port=free_port())
    with pytest.raises(ServiceError, match="cannot start '/no/such/server'"):
        manager.start(preset)


def test_second_start_is_refused(manager: ServiceManager) -> None:
    from homelab_llm.tui.service import ServiceError

    manager.start(tiny_preset("tiny", free_port()))
    with pytest.raises(ServiceError, match="already"):
        manager.start(tiny_preset("tiny", free_port()))


def test_health_timeout_stops_the_child(manager: ServiceManager, tmp_path: Path) -> None:
    preset = tiny_preset("slow", free_port(), "--health-delay", "60", pidfile=tmp_path / "p",
                         timeout=0.8)
    manager.start(preset)
    wait_for(lambda: manager.status.state is ServiceState.CRASHED, what="health timeout")
    assert "not healthy after 0.8 s" in manager.status.message
    assert not pid_alive(json.loads((tmp_path / "p").read_text())["pid"])


DRIVER = textwrap.dedent("""
    import sys, time, json
    sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
    from homelab_llm.tui.service import ServiceManager, ServiceState
    from tui_fakes import tiny_preset
    m = ServiceManager(grace_s=1.0)
    m.start(tiny_preset("tiny", {port}, pidfile={pidfile!r}))
    while m.status.state is not ServiceState.HEALTHY:
        time.sleep(0.05)
    print("healthy", flush=True)
    {ending}
""")


@pytest.mark.parametrize("ending", [
    "raise RuntimeError('the app blew up')",  # exception: atexit cleans up
    "sys.exit(0)",  # plain quit without stopping
])
def test_no_orphan_when_the_parent_ends(ending: str, tmp_path: Path) -> None:
    pidfile = tmp_path / "pids.json"
    script = DRIVER.format(root=str(Path(__file__).parents[2]), tests=str(Path(__file__).parent),
                           port=free_port(), pidfile=str(pidfile), ending=ending)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=40)
    assert "healthy" in done.stdout, done.stderr
    pids = json.loads(pidfile.read_text())
    wait_for(lambda: not pid_alive(pids["pid"]) and not pid_alive(pids["worker"]), timeout=5,
             what="children gone")
    assert not process_group_alive(pids["pid"])
