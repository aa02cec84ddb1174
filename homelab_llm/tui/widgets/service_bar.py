"""One line saying what the managed service is doing: starting (with elapsed time, a spinner
and, when the server tells it, a load progress bar with its phase), healthy, crashed (exit code), or that we only watch a server we did not start."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from homelab_llm.tui.service import ServiceState, ServiceStatus
from homelab_llm.tui.widgets.format import duration

SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
STATE_STYLE = {ServiceState.STOPPED: "dim", ServiceState.STARTING: "yellow",
               ServiceState.HEALTHY: "green", ServiceState.STOPPING: "yellow",
               ServiceState.CRASHED: "bold red"}


LOAD_BAR_CELLS = 20


def progress_bar(fraction: float, cells: int) -> Text:
    """A bar exact to an eighth of a cell: filled part green, the rest dim."""
    eighths = round(min(max(fraction, 0.0), 1.0) * cells * 8)
    full, part = divmod(eighths, 8)
    partial = " ▏▎▍▌▋▊▉"[part] if part else ""
    bar = Text("█" * full + partial, style="green")
    bar.append("░" * (cells - full - len(partial)), style="dim")
    return bar


def service_line(status: ServiceStatus, now: float, watching: str, preset: str) -> Text:
    state = status.state
    text = Text()
    if state is ServiceState.STARTING and status.started_at is not None:
        elapsed = now - status.started_at
        text.append(f"{SPINNER[int(elapsed * 4) % len(SPINNER)]} starting ", style="yellow")
        text.append(status.preset, style="bold")
        text.append(f" · {duration(elapsed)}")
        if status.load_progress is None:
            text.append(f" · waiting for health at {status.url}")
            return text
        text.append(f" · {status.load_phase} ")
        text.append_text(progress_bar(status.load_progress, LOAD_BAR_CELLS))
        text.append(f" {status.load_progress * 100:.0f}%")
        return text
    if state is ServiceState.STOPPED and watching:  # nothing of ours runs; we watch theirs
        text.append("● watching ", style="cyan")
        text.append(watching, style="bold")
        return text
    text.append("● ", style=STATE_STYLE[state])
    text.append(state.value, style=STATE_STYLE[state])
    if state is ServiceState.HEALTHY:
        text.append(f"  {status.preset}", style="bold")
        text.append(f"  {status.url}")
        if status.ready_after_s is not None:
            text.append(f"  ready in {status.ready_after_s:.1f} s", style="dim")
    elif state is ServiceState.CRASHED:
        text.append(f"  {status.reason or status.message}", style="red")
        text.append("  (l: Logs)", style="dim")
    elif state is ServiceState.STOPPING:
        text.append(f"  {status.preset}")
    else:
        text.append(f"  press s to start {preset}" if preset else "  pick a preset (p)")
    return text


class ServiceBar(Static):
    def show(self, status: ServiceStatus, now: float, watching: str, preset: str) -> None:
        self.update(service_line(status, now, watching, preset))
        self.set_class(status.state is ServiceState.CRASHED, "-crashed")
