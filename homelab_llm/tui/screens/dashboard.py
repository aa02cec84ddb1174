"""Dashboard: the service line, per-device VRAM split, engine numbers, tok/s charts, chat.

The chat box sits below a scrolling body, so at 80x24 it is always on screen; at 160x48 the
memory and engine panels sit side by side and the charts take the rest of the height."""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, Header, Input, Static

from homelab_llm.tui.snapshot import ServerSnapshot
from homelab_llm.tui.widgets.chat import ChatBox
from homelab_llm.tui.widgets.engine_stats import EngineStats
from homelab_llm.tui.widgets.gpu_panel import GpuPanel
from homelab_llm.tui.widgets.format import rate
from homelab_llm.tui.widgets.history_chart import HistoryChart
from homelab_llm.tui.widgets.service_bar import ServiceBar

if TYPE_CHECKING:
    from homelab_llm.tui.app import HomelabApp


class DashboardScreen(Screen[None]):
    BINDINGS = [
        Binding("s", "app.toggle_service", "Start/stop"),
        Binding("i", "focus_chat", "Chat"),
        Binding("ctrl+l", "clear_chat", "Clear chat", show=False),
        Binding("escape", "leave_chat", "Keys"),  # shown only while the chat box has them
    ]

    app: HomelabApp  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__()
        self._reachable = False  # the last snapshot reached a server: focus moves only on a change
        self._refocus = False

    def compose(self) -> ComposeResult:
        yield Header()
        yield ServiceBar(id="service-bar")
        with VerticalScroll(id="dash-body"):
            with Horizontal(id="dash-columns"):
                with Vertical(id="dash-memory", classes="panel") as memory:
                    memory.border_title = "Memory"
                    yield Vertical(id="gpu-panels")
                    yield Static("", id="server-error")
                with Vertical(id="dash-engine", classes="panel") as engine:
                    engine.border_title = "Engine"
                    yield EngineStats(id="engine-stats")
            with Horizontal(id="dash-charts", classes="panel") as charts:
                charts.border_title = "Throughput, last minute"
                yield HistoryChart("prompt", unit="tok/s", style="magenta", fmt=rate,
                                   id="prompt-rate")
                yield HistoryChart("generation", unit="tok/s", style="green", fmt=rate,
                                   id="gen-rate")
        with Vertical(id="dash-chat", classes="panel") as chat:
            chat.border_title = "Chat"
            yield ChatBox(self.app.chat_url, api_key=self.app.api_key, clock=self.app.clock,
                          id="chat")
        yield Footer(compact=True, show_command_palette=False)

    def on_mount(self) -> None:
        self.watch(self.app, "snapshot", self._show_snapshot)
        self.watch(self.app, "service_status", lambda _: self.refresh_service())
        self.watch(self.app, "hardware", lambda _: self._show_snapshot(self.app.snapshot))
        self.watch(self.app, "telemetry", lambda _: self._show_snapshot(self.app.snapshot))
        self.set_interval(0.5, self.refresh_service)  # elapsed time while starting

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "leave_chat":
            return isinstance(self.focused, Input)
        return True

    def on_screen_suspend(self) -> None:
        # Under a modal Textual restores the focus itself; a mode switch comes back fresh.
        self._refocus = not isinstance(self.app.screen, ModalScreen)

    def on_screen_resume(self) -> None:
        if self._refocus and self.app.snapshot.ok:
            self.action_focus_chat()

    def _follow_reachability(self, snap: ServerSnapshot) -> None:
        """A server just became reachable: typing now goes to the chat box, so letters never
        reach the single-key bindings (`s` would stop the service). Esc gives them back, and
        later polls leave the focus where the user put it."""
        if snap.ok and not self._reachable and self.is_current:
            self.action_focus_chat()
        self._reachable = snap.ok

    def refresh_service(self) -> None:
        app = self.app
        self.query_one(ServiceBar).show(app.service_status, app.clock(), app.watch_url or "",
                                        app.current_preset)

    def _show_snapshot(self, snap: ServerSnapshot) -> None:
        app = self.app
        self._follow_reachability(snap)
        gpus = [g for g in app.hardware.gpus if not g.integrated]
        count = max(len(snap.devices), len(gpus))
        panels_box = self.query_one("#gpu-panels", Vertical)
        panels = list(panels_box.query(GpuPanel))
        fresh = len(panels) != count
        if fresh:
            panels_box.remove_children()
            panels = [GpuPanel() for _ in range(count)]
        for index, panel in enumerate(panels):
            device = snap.devices[index] if index < len(snap.devices) else None
            gpu = gpus[index] if index < len(gpus) and (device is None or device.name != "cpu") else None
            sensors = app.telemetry.get(gpu.pci_address) if gpu else None
            panel.show(index, device, gpu, sensors, snap.kv_usage)
        if fresh:
            panels_box.mount_all(panels)
        error = self.query_one("#server-error", Static)
        if not snap.ok:
            message = snap.error or "no server yet"
        elif not snap.devices:
            message = ("this server reports no memory split (vLLM, SGLang and llama.cpp expose "
                       "KV usage only)")
        else:
            message = ""
        error.update(message)
        error.display = bool(message)
        self.query_one(EngineStats).show(snap, app.host_reading)
        self.query_one("#prompt-rate", HistoryChart).show(app.prompt_history, snap.prompt_tps)
        self.query_one("#gen-rate", HistoryChart).show(app.generation_history, snap.generation_tps)
        self.refresh_service()

    def action_clear_chat(self) -> None:
        self.query_one(ChatBox).clear()

    def action_focus_chat(self) -> None:
        self.query_one("#chat-input").focus()

    def action_leave_chat(self) -> None:
        """Typing goes to the chat box; Esc gives the single-letter keys back."""
        self.set_focus(None)
