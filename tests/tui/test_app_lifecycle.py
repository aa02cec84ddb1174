"""No orphans and a bounded exit, with real processes: the child's parent watch, adopting or
stopping what a SIGKILLed app left behind, and SIGHUP ending a stuck app within 5 s."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from homelab_llm.parent_watch import PARENT_PID_ENV
from homelab_llm.presets import save_preset
from homelab_llm.tui.pidfiles import STATE_DIR_ENV, PidFiles
from homelab_llm.tui.screens.adopt import AdoptScreen
from homelab_llm.tui.process_group import free_port, process_group_alive
from homelab_llm.tui.service import ServiceManager, ServiceState
from test_app import make_app
from tui_fakes import FakeProbe, load_status, tiny_preset

pytestmark = pytest.mark.timeout(90)
HERE = Path(__file__).parent

# A headless app that starts the `tiny` preset; extra lines go before it runs.
APP_SCRIPT = """
import sys, threading
sys.path.insert(0, {here!r})
from homelab_llm.tui.app import HomelabApp
from homelab_llm.tui.pidfiles import PidFiles
from homelab_llm.tui.service import ServiceManager
from homelab_llm.tui.snapshot import HardwareReport
from tui_fakes import FakeTelemetry
{extra}
app = HomelabApp(service=ServiceManager(pidfiles=PidFiles(), grace_s=1.0), watch_url=None,
                 initial_preset="tiny", autostart=True, handle_signals=True,
                 hardware_source=HardwareReport, telemetry=FakeTelemetry())
app.run(headless=True)
"""


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def wait_until(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> PidFiles:
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "state"))
    save_preset(tiny_preset("tiny", free_port()))
    return PidFiles()


def start_app(extra: str = "") -> subprocess.Popen[bytes]:
    script = APP_SCRIPT.format(here=str(HERE), extra=textwrap.dedent(extra))
    return subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_child_ends_when_its_parent_is_killed() -> None:
    code = ("import time; from homelab_llm.parent_watch import start_from_env; start_from_env(); "
            "time.sleep(60)")
    parent = subprocess.Popen(
        [sys.executable, "-c", "import os, subprocess, sys, time; "
         f"p = subprocess.Popen([sys.executable, '-c', {code!r}], start_new_session=True, "
         f"env=dict(os.environ, {PARENT_PID_ENV}=str(os.getpid()))); print(p.pid, flush=True); "
         "time.sleep(60)"], stdout=subprocess.PIPE)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert not gone(child)
    parent.kill()
    parent.wait()
    wait_until(lambda: gone(child), timeout=10)


@pytest.mark.parametrize("answer", ["a", "x"])
async def test_orphan_of_a_killed_app_is_adopted_or_stopped(state: PidFiles, answer: str) -> None:
    app_proc = start_app()
    try:
        wait_until(lambda: state.path("tiny").is_file())
        record = PidFiles().orphans() or None  # the app still lives: not an orphan yet
        assert record is None
    finally:
        app_proc.kill()
        app_proc.wait()
    [orphan] = state.orphans()
    assert not gone(orphan.pid)
    service = ServiceManager(grace_s=1.0, health_interval_s=0.05, pidfiles=state)
    app = make_app(service=service, watch_url=None, clock=time.monotonic, initial_preset="tiny",
                   probe_factory=FakeProbe([load_status("status_cpu.json")]))
    async with app.run_test(size=(100, 30)) as pilot:
        for _ in range(100):
            await pilot.pause(0.05)
            if isinstance(app.screen, AdoptScreen):
                break
        assert isinstance(app.screen, AdoptScreen) and app.screen.record.pid == orphan.pid
        await pilot.press(answer)
        if answer == "a":
            for _ in range(100):
                await pilot.pause(0.05)
                if app.service_status.state is ServiceState.HEALTHY:
                    break
            assert app.service_status.pid == orphan.pid
            assert app.service_status.state is ServiceState.HEALTHY
        else:
            for _ in range(100):
                await pilot.pause(0.05)
                if gone(orphan.pid):
                    break
            assert not service.status.running
    wait_until(lambda: gone(orphan.pid) and not process_group_alive(orphan.pid), timeout=10)
    # stop_orphan's worker removes the pid file once its wait on the group returns: just after
    wait_until(lambda: not state.path("tiny").exists(), timeout=10)


def test_sighup_ends_a_stuck_app_within_5s(state: PidFiles) -> None:
    # A thread that never ends would keep a plain Python process alive for ever at exit.
    app_proc = start_app("threading.Thread(target=threading.Event().wait).start()")
    try:
        wait_until(lambda: state.path("tiny").is_file())
        pid = json.loads(state.path("tiny").read_text())["pid"]
        time.sleep(0.5)
        sent = time.monotonic()
        app_proc.send_signal(signal.SIGHUP)
        app_proc.wait(timeout=8)
        took = time.monotonic() - sent
    finally:
        if app_proc.poll() is None:
            app_proc.kill()
            app_proc.wait()
    assert took < 5.5, f"the app took {took:.1f} s to exit"
    wait_until(lambda: not process_group_alive(pid), timeout=5)


async def test_loading_progress_is_shown_while_starting() -> None:
    """The child's /health says 503 loading with a phase and progress: the bar shows both."""
    from textual.widgets import Static

    save_preset(tiny_preset("slow", free_port(), "--health-delay", "4"))
    service = ServiceManager(grace_s=1.0, health_interval_s=0.05)
    app = make_app(service=service, watch_url=None, clock=time.monotonic, initial_preset="slow",
                   autostart=True, probe_factory=FakeProbe([load_status("status_cpu.json")]))
    async with app.run_test(size=(120, 30)) as pilot:
        seen: list[float] = []
        for _ in range(200):
            await pilot.pause(0.05)
            status = app.service_status
            if status.state is ServiceState.HEALTHY:
                break
            if status.load_progress is not None:
                seen.append(status.load_progress)
                bar = str(app.screen.query_one("#service-bar", Static).render())
                assert "loading weights" in bar and "%" in bar
        assert app.service_status.state is ServiceState.HEALTHY
        assert seen and seen == sorted(seen) and 0.0 <= seen[0] < 1.0
    assert not service.status.running
