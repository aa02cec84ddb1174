"""The control app: modes (Dashboard, Presets, Hardware, Logs, Bench), the managed service, and
the pollers that feed the screens.

State lives here in reactive attributes; screens watch them. All I/O runs in thread workers that
post their result back as a message and re-arm themselves after it lands, so polls never stack
and the UI thread never waits on a server, a driver or a child process.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.message import Message
from textual.reactive import reactive
from textual.screen import Screen

from homelab_llm.hwcheck.catalog import Catalog, load_catalog
from homelab_llm.presets import Preset, PresetScan, scan_presets
from homelab_llm.tui.hardware import TelemetryReader, collect_hardware_report
from homelab_llm.tui.history import HISTORY_POINTS, History
from homelab_llm.tui.host import HostReader, HostReading
from homelab_llm.tui.exit_guard import ExitGuard
from homelab_llm.tui.probe import Probe
from homelab_llm.tui.screens.bench import BenchScreen
from homelab_llm.tui.screens.dashboard import DashboardScreen
from homelab_llm.tui.screens.hardware import HardwareScreen
from homelab_llm.tui.screens.help import HelpScreen
from homelab_llm.tui.screens.logs import LogsScreen
from homelab_llm.tui.screens.models import ModelsScreen
from homelab_llm.tui.screens.presets import PresetsScreen
from homelab_llm.tui.service import (LogLine, ServiceEvent, ServiceManager, ServiceState,
                                     ServiceStatus, StateChanged, kill_all_now)
from homelab_llm.tui.service_actions import ServiceActions
from homelab_llm.tui.snapshot import GpuTelemetry, HardwareReport, ServerSnapshot


class ProbeLike(Protocol):
    def poll(self) -> ServerSnapshot: ...
    def close(self) -> None: ...


class TelemetryLike(Protocol):
    def read(self) -> dict[str, GpuTelemetry]: ...
    def close(self) -> None: ...


@dataclass
class ServiceEventMessage(Message):
    event: ServiceEvent


@dataclass
class SnapshotMessage(Message):
    url: str | None
    snapshot: ServerSnapshot


@dataclass
class HardwareMessage(Message):
    report: HardwareReport


@dataclass
class TelemetryMessage(Message):
    readings: dict[str, GpuTelemetry]
    host: HostReading


class HostLike(Protocol):
    def read(self, child_pid: int | None) -> HostReading: ...


class HomelabApp(ServiceActions, App[int]):
    CSS_PATH = "app.tcss"
    TITLE = "homelab-llm"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (150, "-wide")]  # side by side needs ~75 cols each
    MODES = {"dashboard": "dashboard", "presets": "presets", "hardware": "hardware", "logs": "logs",
             "bench": "bench", "models": "models"}
    BINDINGS = [
        Binding("d", "switch_mode('dashboard')", "Dashboard"),
        Binding("p", "switch_mode('presets')", "Presets"),
        Binding("h", "switch_mode('hardware')", "Hardware"),
        Binding("l", "switch_mode('logs')", "Logs"),
        Binding("b", "switch_mode('bench')", "Bench"),
        Binding("m", "switch_mode('models')", "Models", show=False),  # footer is full; in help
        # The footer has 80 columns for a screen's own keys and these: the screens that act on
        # the service show `s` themselves; F1, Ctrl+P and quitting are listed in the help.
        Binding("s", "toggle_service", "Start/stop", show=False),
        Binding("question_mark,f1", "help", "Help", key_display="?"),
        Binding("ctrl+p", "command_palette", "Commands", show=False),
        Binding("q", "quit", "Quit", show=False),
        # Textual 8 only hints at Ctrl+Q on Ctrl+C; people press Ctrl+C to leave a terminal app.
        # Priority: it quits even from a text field (whose own Ctrl+C would copy).
        Binding("ctrl+c", "quit", "Quit (also from a text field)", key_display="Ctrl+C",
                show=False, priority=True),
    ]

    snapshot: reactive[ServerSnapshot] = reactive(ServerSnapshot, always_update=True)
    service_status: reactive[ServiceStatus] = reactive(ServiceStatus)
    hardware: reactive[HardwareReport] = reactive(HardwareReport)
    telemetry: reactive[dict[str, GpuTelemetry]] = reactive(dict)
    presets: reactive[list[Preset]] = reactive(list, always_update=True)
    current_preset: reactive[str] = reactive("smollm2-cpu")

    def __init__(self, *, service: ServiceManager | None = None,
                 presets_loader: Callable[[], PresetScan] = scan_presets,
                 probe_factory: Callable[[str], ProbeLike] = Probe,
                 hardware_source: Callable[[], HardwareReport] = collect_hardware_report,
                 telemetry: TelemetryLike | None = None, host: HostLike | None = None,
                 clock: Callable[[], float] = time.monotonic, poll_interval_s: float = 0.5,
                 watch_url: str | None = None, api_key: str | None = None,
                 initial_preset: str = "smollm2-cpu", start_mode: str = "dashboard",
                 autostart: bool = False, handle_signals: bool = False,
                 catalog_loader: Callable[[], Catalog] = load_catalog) -> None:
        super().__init__()
        self.service = service or ServiceManager()
        self.presets_loader = presets_loader
        self.probe_factory = probe_factory
        self.hardware_source = hardware_source
        self.telemetry_reader: TelemetryLike = telemetry or TelemetryReader()
        self.host_reader: HostLike = host or HostReader()
        self.host_reading = HostReading()
        self.history = History()  # per-GPU sensors and host figures, for the Hardware charts
        self.clock = clock
        self.poll_interval_s = poll_interval_s
        self.watch_url = watch_url
        self.api_key = api_key
        self.start_mode = start_mode
        self.autostart = autostart
        self.handle_signals = handle_signals
        self.catalog_loader = catalog_loader
        self.broken_presets: dict[Path, str] = {}
        self.hardware_pending = True
        self.prompt_history: deque[float] = deque(maxlen=HISTORY_POINTS)
        self.generation_history: deque[float] = deque(maxlen=HISTORY_POINTS)
        self.exit_guard: ExitGuard | None = None
        self._probes: dict[str, ProbeLike] = {}  # touched only by the (single) poll worker
        self.set_reactive(HomelabApp.current_preset, initial_preset)

    # ------------------------------------------------------------------ lifecycle

    def on_mount(self) -> None:
        for name, screen in (("dashboard", DashboardScreen()), ("presets", PresetsScreen()),
                             ("hardware", HardwareScreen()), ("logs", LogsScreen()),
                             ("bench", BenchScreen()), ("models", ModelsScreen())):
            self.install_screen(screen, name)
        self.service.subscribe(self._on_service_event)
        self.service_status = self.service.status
        self.reload_presets()
        self.switch_mode(self.start_mode)
        if self.handle_signals:
            loop = asyncio.get_running_loop()
            self.exit_guard = ExitGuard(lambda code: loop.call_soon_threadsafe(self.exit, code),
                                        kill_all_now)
            self.exit_guard.install()
        self.find_orphans()
        self.refresh_hardware()
        self.poll_server()
        self.poll_telemetry()
        if self.autostart:
            self.action_toggle_service()

    def on_unmount(self) -> None:
        # The app is going away (quit, signal or exception): the child must not outlive it, and
        # a running sweep must close its requests so the server stops working for nobody.
        try:
            bench = self.get_screen("bench")
        except KeyError:  # quit before mount finished
            bench = None
        if isinstance(bench, BenchScreen):
            bench.stop_job()
        self.service.shutdown()
        self.telemetry_reader.close()
        for probe in list(self._probes.values()):
            probe.close()

    # ------------------------------------------------------------------ presets

    def reload_presets(self) -> None:
        scan = self.presets_loader()
        self.broken_presets = scan.broken
        self.presets = scan.presets
        if scan.broken:
            self.notify(f"{len(scan.broken)} preset file(s) could not be read; see Presets",
                        severity="warning")

    def preset_named(self, name: str) -> Preset | None:
        return next((p for p in self.presets if p.name == name), None)

    # ------------------------------------------------------------------ service

    def _on_service_event(self, event: ServiceEvent) -> None:
        self.post_message(ServiceEventMessage(event))  # from the manager's threads; thread-safe

    def on_service_event_message(self, message: ServiceEventMessage) -> None:
        event = message.event
        if isinstance(event, LogLine):
            try:
                logs = self.get_screen("logs")
            except KeyError:  # a line from before the screens are installed or after they went:
                return  # the service keeps every line in its own buffer (the logs screen reads it)
            if isinstance(logs, LogsScreen) and logs.is_mounted:
                logs.append(event.text)
        elif isinstance(event, StateChanged):
            self.service_status = event.status

    def watch_service_status(self, old: ServiceStatus, new: ServiceStatus) -> None:
        if new.state is ServiceState.STOPPED and self.watch_url:
            self.sub_title = f"watching {self.watch_url}"
        else:
            self.sub_title = f"{new.preset or self.current_preset} · {new.state.value}"
        if new.state is old.state:
            return
        if new.state is ServiceState.HEALTHY:
            self.notify(new.message, title="service healthy")
        elif new.state is ServiceState.CRASHED:
            reason = new.reason or "(no output; see Logs)"
            self.notify(f"{reason}\n{new.message} · l shows the log", title="service crashed",
                        severity="error", timeout=20)

    def max_model_len(self) -> int | None:
        """The served context limit: the server's own word (/v1/status), else the preset's."""
        value = self.snapshot.config.get("max_model_len") if self.snapshot.ok else None
        if value is None and self.service_status.running:
            preset = self.preset_named(self.service_status.preset)
            value = preset.args.get("max_model_len") if preset else None
        return value if isinstance(value, int) and value > 0 else None

    def chat_url(self) -> str | None:
        return self.probe_url()

    def probe_url(self) -> str | None:
        status = self.service_status
        if status.state is ServiceState.HEALTHY:
            return status.url
        return self.watch_url

    # ------------------------------------------------------------------ pollers

    @work(thread=True, exclusive=True, group="probe")
    def poll_server(self) -> None:
        url = self.probe_url()
        if url is None:
            snap = ServerSnapshot(error=self._idle_message())
        else:
            probe = self._probes.get(url)
            if probe is None:
                probe = self._probes[url] = self.probe_factory(url)
            snap = probe.poll()
        self.post_message(SnapshotMessage(url, snap))

    def _idle_message(self) -> str:
        state = self.service_status.state
        if state is ServiceState.STARTING:
            return "waiting for the service to become healthy…"
        return "no server: start a preset with s, or run `homelab-llm tui --url URL`"

    def on_snapshot_message(self, message: SnapshotMessage) -> None:
        snap = message.snapshot
        if snap.ok:
            self.prompt_history.append(snap.prompt_tps or 0.0)
            self.generation_history.append(snap.generation_tps or 0.0)
        self.snapshot = snap
        self.set_timer(self.poll_interval_s, self.poll_server)  # re-armed only after it landed

    @work(thread=True, exclusive=True, group="hardware")
    def refresh_hardware(self) -> None:
        self.post_message(HardwareMessage(self.hardware_source()))

    def on_hardware_message(self, message: HardwareMessage) -> None:
        self.hardware_pending = False
        self.hardware = message.report

    @work(thread=True, exclusive=True, group="telemetry")
    def poll_telemetry(self) -> None:
        self.post_message(TelemetryMessage(self.telemetry_reader.read(),
                                           self.host_reader.read(self.service.status.pid)))

    def on_telemetry_message(self, message: TelemetryMessage) -> None:
        for address, r in message.readings.items():
            for key, value in (("load", r.load_pct), ("temp", r.temp_c), ("power", r.power_w),
                               ("vram", r.vram_used_bytes)):
                self.history.add(f"gpu/{address}/{key}", value)
        host = self.host_reading = message.host
        for key, value in (("cpu", host.cpu_pct), ("ram", host.ram_used),
                           ("child_cpu", host.child_cpu_pct), ("child_rss", host.child_rss)):
            self.history.add(f"host/{key}", value)
        self.telemetry = message.readings
        self.set_timer(1.0, self.poll_telemetry)

    # ------------------------------------------------------------------ help, palette

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # Switching to the mode already shown does nothing: leave it out of the footer.
        if action == "switch_mode" and parameters and parameters[0] == self.current_mode:
            return False
        return True

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            return
        self.push_screen(HelpScreen([b for b in self.BINDINGS if isinstance(b, Binding)], self.screen))

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for mode in self.MODES:
            yield SystemCommand(f"Show {mode.title()}", f"switch to the {mode} screen",
                                lambda mode=mode: self.switch_mode(mode))
        verb = "Stop" if self.service.status.running else "Start"
        yield SystemCommand(f"{verb} the service", f"{verb.lower()} {self.current_preset}",
                            self.action_toggle_service)
        for preset in self.presets:
            yield SystemCommand(f"Select preset {preset.name}", preset.description or preset.backend,
                                lambda name=preset.name: setattr(self, "current_preset", name))
