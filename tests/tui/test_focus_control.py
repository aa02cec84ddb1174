"""Input focus and what `s` does: typing never reaches the single-key bindings, and `s` asks
before it stops busy work, replaces a preset or starts one beside a watched server."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
from textual.widgets import Input

from homelab_llm.presets import save_preset
from homelab_llm.tui.screens.confirm import ConfirmScreen
from homelab_llm.tui.process_group import free_port
from homelab_llm.tui.service import ServiceManager, ServiceState, ServiceStatus
from homelab_llm.tui.service_control import Verb, decide_toggle
from test_app import make_app
from tui_fakes import FakeProbe, load_status, tiny_preset

pytestmark = pytest.mark.timeout(60)

HEALTHY = ServiceStatus(state=ServiceState.HEALTHY, preset="a", pid=1, url="http://x")


@pytest.mark.parametrize("status,selected,watch,in_flight,verb,asks", [
    (ServiceStatus(), "a", None, 0, Verb.START, ""),
    (ServiceStatus(), "a", "http://far:8000", 0, Verb.START, "watching http://far:8000"),
    (HEALTHY, "a", None, 0, Verb.STOP, ""),
    (HEALTHY, "a", None, 3, Verb.STOP, "3 requests are in flight"),
    (HEALTHY, "b", None, 0, Verb.SWITCH, "Stop a and start b?"),
    (replace(HEALTHY, state=ServiceState.STOPPING), "a", None, 0, Verb.NOTHING, ""),
])
def test_decide_toggle(status, selected, watch, in_flight, verb, asks) -> None:
    decision = decide_toggle(status, selected, watch_url=watch, in_flight=in_flight)
    assert decision.verb is verb
    assert (asks in decision.question) if asks else not decision.question


async def wait_for(pilot, predicate, steps: int = 200) -> None:
    for _ in range(steps):
        await pilot.pause(0.05)
        if predicate():
            return
    raise AssertionError("condition never became true")


async def test_typing_status_never_stops_the_service(tmp_path: Path) -> None:
    save_preset(tiny_preset("tiny", free_port(), pidfile=tmp_path / "pids"))
    service = ServiceManager(grace_s=1.0, health_interval_s=0.05)
    app = make_app(service=service, watch_url=None, clock=time.monotonic, initial_preset="tiny",
                   autostart=True, probe_factory=FakeProbe([load_status("status_cpu.json")]))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.service_status.state is ServiceState.HEALTHY)
        chat = app.screen.query_one("#chat-input", Input)
        await wait_for(pilot, lambda: app.focused is chat)
        await pilot.press(*"status", "p", "h", "l", "c", "q")
        await pilot.pause(0.3)
        assert chat.value == "statusphlcq"
        assert app.current_mode == "dashboard"
        assert app.service_status.state is ServiceState.HEALTHY
        await pilot.press("escape")  # Esc gives the keys back
        assert app.focused is None
        await pilot.press("p")
        assert app.current_mode == "presets"
    assert not service.status.running


async def test_watch_mode_asks_before_starting_a_local_preset() -> None:
    started: list[str] = []
    app = make_app(watch_url="http://recorded:8000")
    app.service.start = lambda preset, port=None: started.append(preset.name)  # type: ignore
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause(0.2)
        await pilot.press("escape", "s")
        assert isinstance(app.screen, ConfirmScreen)
        assert "watching http://recorded:8000" in app.screen.question
        await pilot.press("n")
        assert started == []
        await pilot.press("s", "y")
        await pilot.pause(0.05)
        assert started == ["smollm2-cpu"]
        assert "watching http://recorded:8000" in str(app.sub_title)
