"""Pilot tests: every screen with recorded data, preset editing, start/crash from the UI."""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest
from rich.console import Console
from textual.widgets import DataTable, Input, RichLog, Static

from homelab_llm.presets import load_preset, save_preset
from homelab_llm.tui.app import HomelabApp
from homelab_llm.tui.screens.help import HelpScreen
from homelab_llm.tui.screens.preset_editor import PresetEditor
from homelab_llm.tui.process_group import free_port
from homelab_llm.tui.service import ServiceManager, ServiceState
from homelab_llm.tui.snapshot import HardwareReport
from tui_fakes import FIXED_TELEMETRY, FakeHost, FakeProbe, FakeTelemetry, crash_preset, load_hardware, load_status

pytestmark = pytest.mark.timeout(60)


def make_app(**kw) -> HomelabApp:
    defaults = dict(probe_factory=FakeProbe([load_status()]), watch_url="http://recorded:8000",
                    hardware_source=load_hardware, telemetry=FakeTelemetry(FIXED_TELEMETRY),
                    clock=lambda: 1000.0, poll_interval_s=0.05, host=FakeHost())
    defaults.update(kw)
    return HomelabApp(**defaults)


def text_of(app: HomelabApp, selector: str) -> str:
    """A Static's content as plain text, whether it holds a str, Text or a Rich table."""
    return plain(app.screen.query_one(selector, Static).content)


def plain(content: object) -> str:
    if isinstance(content, str):
        return content
    console = Console(width=200, file=io.StringIO(), record=True)
    console.print(content)
    return console.export_text()


async def test_dashboard_shows_recorded_server() -> None:
    probe = FakeProbe([load_status()])
    app = make_app(probe_factory=probe)
    async with app.run_test(size=(100, 40)) as pilot:
        for _ in range(100):  # a loaded machine may need more than a few polls' time
            await pilot.pause(0.05)
            headers = [plain(s.content) for s in app.screen.query(".gpu-header").results(Static)]
            if probe.polls >= 2 and len(headers) == 2 and all(headers):
                break
        assert probe.url == "http://recorded:8000" and probe.polls >= 2  # re-armed after landing
        stats = text_of(app, "#engine-stats")
        assert "187,392/425,984 44.0% int8" in stats and "3 running · 1 waiting" in stats
        assert "p50 412 ms · p95 1.87 s" in stats and "88.0%" not in stats
        headers = [plain(s.content) for s in app.screen.query(".gpu-header").results(Static)]
        assert len(headers) == 2
        assert "Gen4 x4 of Gen4 x16 via chipset" in headers[1] and "97% 71°C 312W" in headers[0]
        assert "watching http://recorded:8000" in text_of(app, "#service-bar")


async def test_dashboard_without_server_says_how_to_start() -> None:
    app = make_app(watch_url=None)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause(0.2)
        assert "press s to start smollm2-cpu" in text_of(app, "#service-bar")
        assert "no server" in text_of(app, "#server-error")


async def test_chat_without_server_explains() -> None:
    app = make_app(watch_url=None)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("i")
        await pilot.press(*"hi", "enter")
        await pilot.pause(0.1)
        assert "no server to talk to" in text_of(app, "#chat-stats")


async def test_modes_help_and_palette() -> None:
    app = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause(0.2)
        await pilot.press("escape")  # the server answers, so the chat box took the keys
        for key, name in (("p", "presets"), ("h", "hardware"), ("l", "logs"), ("b", "bench"),
                          ("d", "dashboard")):
            await pilot.press(key)
            assert app.current_mode == name
        await pilot.press("escape")  # back on the dashboard the chat box has the keys again
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await pilot.press("ctrl+p")
        await pilot.pause(0.1)
        assert type(app.screen).__name__ == "CommandPalette"
        await pilot.press("escape")


async def test_hardware_screen_lists_gpus_and_warnings() -> None:
    app = make_app(start_mode="hardware")
    async with app.run_test(size=(120, 30)) as pilot:
        await pilot.pause(0.2)
        table = app.screen.query_one(DataTable)
        assert table.row_count == 2
        row = [str(c) for c in table.get_row_at(1)]
        assert row[1] == "0c:00.0" and "x4 of Gen4 x16" in row[4] and row[5] == "chipset"
        assert row[7] == "95% 66°C 298W"
        assert "runs at x4 of x16" in text_of(app, "#hw-notes")


async def test_hardware_screen_degrades_when_hwcheck_fails() -> None:
    app = make_app(start_mode="hardware",
                   hardware_source=lambda: HardwareReport(error="hardware check unavailable: boom"))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause(0.2)
        assert app.screen.query_one(DataTable).row_count == 0
        assert "hardware check unavailable: boom" in text_of(app, "#hw-notes")


async def test_presets_screen_select_shows_detail() -> None:
    app = make_app(start_mode="presets")
    async with app.run_test(size=(120, 30)) as pilot:
        await pilot.pause(0.1)
        table = app.screen.query_one(DataTable)
        assert table.row_count >= 7
        # Walk up from the selected preset to agent-long-context (the list grows with presets).
        for _ in range(table.row_count):
            if app.current_preset == "agent-long-context":
                break
            await pilot.press("up")
            await pilot.pause(0.02)
        assert app.current_preset == "agent-long-context"
        assert "max_model_len = 131072" in text_of(app, "#preset-toml")
        assert "--tensor-parallel-size 2" in text_of(app, "#preset-command")


async def test_editing_with_invalid_input_shows_inline_and_writes_nothing(user_presets: Path) -> None:
    app = make_app(start_mode="presets")
    async with app.run_test(size=(100, 40)) as pilot:
        await pilot.press("e")  # smollm2-cpu is selected
        editor = app.screen
        assert isinstance(editor, PresetEditor)
        port = editor.query_one("#f-port", Input)
        port.value = "99999"
        args = editor.query_one("#f-args")
        args.text = "max_num_seqs = 0\n"
        await pilot.pause(0.05)
        assert "must be an integer 1-65535" in text_of(app, "#err-port")
        assert "max_num_seqs" in text_of(app, "#err-args")
        assert editor.query_one("#save").disabled
        await pilot.press("ctrl+s")
        assert app.screen is editor  # refused
        port.value = "eighty"
        await pilot.pause(0.05)
        assert "'eighty' is not an integer" in text_of(app, "#err-port")
        await pilot.press("escape")
        assert not user_presets.exists() or not any(user_presets.iterdir())


async def test_new_preset_is_saved_and_listed(user_presets: Path) -> None:
    app = make_app(start_mode="presets")
    async with app.run_test(size=(100, 40)) as pilot:
        await pilot.press("n")
        editor = app.screen
        editor.query_one("#f-name", Input).value = "my-cpu"
        editor.query_one("#f-port", Input).value = "8111"
        await pilot.pause(0.05)
        await pilot.press("ctrl+s")
        await pilot.pause(0.05)
        assert (user_presets / "my-cpu.toml").is_file()
        assert load_preset("my-cpu").port == 8111
        assert "my-cpu" in [p.name for p in app.presets] and app.current_preset == "my-cpu"


async def test_duplicate_then_delete(user_presets: Path) -> None:
    app = make_app(start_mode="presets")
    async with app.run_test(size=(100, 40)) as pilot:
        await pilot.press("c")
        await pilot.pause(0.05)
        await pilot.press("ctrl+s")
        await pilot.pause(0.05)
        assert (user_presets / "smollm2-cpu-copy.toml").is_file()
        assert app.current_preset == "smollm2-cpu-copy"
        await pilot.pause(0.05)
        await pilot.press("x")
        await pilot.press("y")
        await pilot.pause(0.05)
        assert not (user_presets / "smollm2-cpu-copy.toml").exists()
        app.current_preset = "smollm2-cpu"
        await pilot.press("x")  # a built-in: refused, nothing asked
        assert app.screen.__class__.__name__ == "PresetsScreen"


async def test_crash_flow_from_the_ui() -> None:
    save_preset(crash_preset(free_port()))
    service = ServiceManager(grace_s=1.0)
    app = make_app(service=service, watch_url=None, clock=time.monotonic,
                   initial_preset="crasher")
    toasts: list[str] = []
    notify = app.notify
    app.notify = lambda message, **kw: (toasts.append(message), notify(message, **kw))[1]
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("s")
        for _ in range(100):
            await pilot.pause(0.05)
            if app.service_status.state is ServiceState.CRASHED:
                break
        assert app.service_status.exit_code == 1
        await pilot.pause(0.05)
        assert "fatal: out of memory" in text_of(app, "#service-bar")  # the reason, not noise
        assert toasts and toasts[-1].splitlines()[0] == "fatal: out of memory"
        assert "crasher exited with code 1" in toasts[-1]
        await pilot.press("l")
        await pilot.pause(0.05)
        lines = [strip.text.rstrip() for strip in app.screen.query_one(RichLog).lines]
        assert "fatal: out of memory" in lines
    assert not service.status.running


@pytest.mark.parametrize("keys", [("escape", "q"), ("ctrl+c",)], ids=["q", "ctrl+c-while-typing"])
async def test_quitting_stops_the_child(tmp_path: Path, keys: tuple[str, ...]) -> None:
    from tui_fakes import tiny_preset

    from homelab_llm.tui.process_group import process_group_alive

    save_preset(tiny_preset("tiny", free_port(), pidfile=tmp_path / "pids"))
    service = ServiceManager(grace_s=1.0, health_interval_s=0.05)
    app = make_app(service=service, watch_url=None, clock=time.monotonic, initial_preset="tiny",
                   autostart=True, probe_factory=FakeProbe([load_status("status_cpu.json")]))
    async with app.run_test(size=(100, 30)) as pilot:
        for _ in range(200):
            await pilot.pause(0.05)
            if app.service_status.state is ServiceState.HEALTHY:
                break
        assert app.service_status.state is ServiceState.HEALTHY
        pgid = app.service_status.pid
        await pilot.pause(0.2)
        assert "healthy  tiny" in text_of(app, "#service-bar")
        await pilot.press(*keys)  # Ctrl+C quits even from the chat box (Textual would only hint)
        assert app._exit, "the key did not ask the app to exit"
    assert pgid is not None and not process_group_alive(pgid)


async def test_hardware_screen_on_a_recorded_sysfs_tree() -> None:
    """The app's --sysfs-root path: hwcheck's own matrix and tree, the chipset warning, charts."""
    from homelab_llm.tui.hardware import NoTelemetry, collect_hardware_report

    root = str(Path(__file__).parents[1] / "hwcheck" / "fixtures" / "am5_chipset_x4")
    app = make_app(start_mode="hardware", hardware_source=lambda: collect_hardware_report(root),
                   telemetry=NoTelemetry())
    async with app.run_test(size=(120, 40)) as pilot:
        for _ in range(200):
            await pilot.pause(0.05)
            if not app.hardware_pending:
                break
        await pilot.pause(0.1)
        topology = text_of(app, "#hw-topology")
        assert "GPU0  X     PHB" in topology and "GPU1  PHB   X" in topology
        assert "PIX one PCIe bridge" in topology and "NS" in topology  # the legend, as hwcheck
        assert "0000:00:02.1 root port" in topology and "[Gen4 x4]" in topology
        assert "0000:0c:00.0 GPU1 Radeon RX 7900 XTX · chipset lanes" in topology
        assert "is on chipset lanes" in text_of(app, "#hw-notes")
        labels = [plain(s.content) for s in app.screen.query(".chart-label").results(Static)]
        assert labels[:2] == ["GPU0 0000:03:00.0", "GPU1 0000:0c:00.0"]
        assert "Host and service" in labels
        cpu = app.screen.query_one("#hw-host-charts .-cpu")
        assert cpu.latest == 23.0 and cpu.values  # psutil's figure (faked here), charted
