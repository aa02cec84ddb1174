"""The full flow against a real `homelab-llm serve` child on the smollm2-cpu preset: start from
the UI, healthy, one chat with streamed tokens, the dashboard reading /v1/status, stop, and no
process left behind."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from homelab_llm.presets import load_preset, save_preset
from homelab_llm.tui.app import HomelabApp
from homelab_llm.tui.process_group import free_port, process_group_alive
from homelab_llm.tui.service import ServiceManager, ServiceState
from homelab_llm.tui.widgets.chat import ChatBox
from tui_fakes import FakeTelemetry
from homelab_llm.tui.snapshot import HardwareReport

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


async def test_start_chat_stop_with_real_server(smollm2_path: Path, user_presets: Path) -> None:
    # the built-in preset, on a free port so parallel runs and a real server on 8000 don't clash
    save_preset(load_preset("smollm2-cpu").with_changes(port=free_port()))
    service = ServiceManager(grace_s=10.0)
    app = HomelabApp(service=service, telemetry=FakeTelemetry(), hardware_source=HardwareReport,
                     poll_interval_s=0.25, autostart=True)
    async with app.run_test(size=(120, 40)) as pilot:
        deadline = time.monotonic() + 500  # a loaded 2-core CI box
        while app.service_status.state is not ServiceState.HEALTHY and time.monotonic() < deadline:
            assert app.service_status.state is ServiceState.STARTING, list(service.logs)[-20:]
            await pilot.pause(0.2)
        assert app.service_status.state is ServiceState.HEALTHY, list(service.logs)[-20:]
        pgid = app.service_status.pid
        while not app.snapshot.ok and time.monotonic() < deadline:
            await pilot.pause(0.2)
        assert app.snapshot.source == "status" and app.snapshot.kv_tokens_capacity

        chat = app.screen.query_one(ChatBox)
        await pilot.press("i", *"Say hello.", "enter")
        while (chat.last_timing is None or chat.last_timing.finished_at is None) and \
                time.monotonic() < deadline:
            await pilot.pause(0.2)
        timing = chat.last_timing
        assert timing is not None and timing.first_token_at is not None and timing.tokens > 0
        assert chat.messages[-1]["role"] == "assistant" and chat.messages[-1]["content"]

        # The dashboard polls /v1/status every 0.25 s: a snapshot from while the reply streamed
        # still counts it in flight, and stopping then asks first (a dialog this test would not
        # answer). Stop once the dashboard shows the server idle, as a user would see it.
        while ((app.snapshot.running or 0) + (app.snapshot.waiting or 0)) > 0 and \
                time.monotonic() < deadline:
            await pilot.pause(0.2)
        await pilot.press("escape", "s")  # leave the chat box, then stop
        while app.service_status.state is not ServiceState.STOPPED and time.monotonic() < deadline:
            await pilot.pause(0.2)
        assert app.service_status.state is ServiceState.STOPPED
    assert pgid is not None and not process_group_alive(pgid)
