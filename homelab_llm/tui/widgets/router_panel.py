"""The router from the TUI: start/stop `homelab-llm router` as a managed child (the same
ServiceManager the presets use: own process group, health wait, crash report) and show which
presets it has up. Polls /router/status in a thread worker, re-armed after each answer."""

from __future__ import annotations

import sys

import httpx
from rich.text import Text
from textual import work
from textual.widgets import Static

from homelab_llm.presets import Preset
from homelab_llm.tui.service import ServiceManager, ServiceState
from homelab_llm.tui.widgets.service_bar import STATE_STYLE

POLL_S = 1.0


def router_preset(port: int) -> Preset:
    """`homelab-llm router` as a command preset, so the service manager can run it."""
    return Preset(name="router", backend="command", port=port, startup_timeout=60,
                  command=(sys.executable, "-m", "homelab_llm", "router", "--port", "{port}"))


class RouterPanel(Static):
    def __init__(self, port: int, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.port = port
        self.manager = ServiceManager(grace_s=5.0, health_interval_s=0.2)
        self.presets: dict[str, dict[str, object]] = {}

    def on_mount(self) -> None:
        self.render_state()
        self.poll()

    def on_unmount(self) -> None:
        self.manager.shutdown()  # never leave a router (and its presets) behind the app

    @property
    def running(self) -> bool:
        return self.manager.status.running

    def toggle(self) -> None:
        if self.running:
            self.stop_router()
        else:
            self.manager.start(router_preset(self.port))
            self.render_state()

    @work(thread=True, exclusive=True, group="router-stop")
    def stop_router(self) -> None:
        self.manager.stop()
        self.app.call_from_thread(self.render_state)

    @work(thread=True, exclusive=True, group="router-poll")
    def poll(self) -> None:
        presets: dict[str, dict[str, object]] = {}
        if self.manager.status.state is ServiceState.HEALTHY:
            try:
                presets = httpx.get(self.manager.status.url + "/router/status", timeout=2.0).json()
            except (httpx.HTTPError, ValueError):
                presets = {}
        self.app.call_from_thread(self.polled, presets)

    def polled(self, presets: dict[str, dict[str, object]]) -> None:
        self.presets = presets
        self.render_state()
        self.set_timer(POLL_S, self.poll)

    def render_state(self) -> None:
        status = self.manager.status
        text = Text("router ", style="bold")
        text.append(status.state.value, style=STATE_STYLE[status.state])
        if status.state is ServiceState.HEALTHY:
            text.append(f"  {status.url}/v1", style="bold")
            for name, info in self.presets.items():
                state = str(info.get("state", "?"))
                style = "green" if state == "healthy" else "yellow" if state == "starting" else "dim"
                text.append(f"\n  {name}: ")
                text.append(state, style=style)
        elif status.state is ServiceState.CRASHED:
            text.append(f"  {status.message}", style="red")
        else:
            text.append(f"  (o starts it on port {self.port})", style="dim")
        self.update(text)
