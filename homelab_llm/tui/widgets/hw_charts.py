"""History charts for the Hardware screen: one row per GPU (load, VRAM used, power,
temperature), and one for the host (CPU, RAM) and the service child (its CPU, its memory)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Static

from homelab_llm.tui.history import History
from homelab_llm.tui.host import HostReading
from homelab_llm.tui.widgets.format import NA, gib
from homelab_llm.tui.widgets.history_chart import HistoryChart


def _pct(v: float | None) -> str:
    return NA if v is None else f"{v:.0f}%"


def _watts(v: float | None) -> str:
    return NA if v is None else f"{v:.0f} W"


def _celsius(v: float | None) -> str:
    return NA if v is None else f"{v:.0f}°C"


def _bytes(v: float | None) -> str:
    return gib(None if v is None else int(v))


class GpuCharts(Vertical):
    DEFAULT_CSS = """
    GpuCharts { height: auto; }
    GpuCharts > Horizontal { height: 5; }
    GpuCharts HistoryChart { width: 1fr; height: 5; margin-right: 2; }
    """

    def __init__(self, label: str, address: str, vram_total: int | None) -> None:
        super().__init__()
        self.label = label
        self.address = address
        self.vram_total = vram_total

    def compose(self) -> ComposeResult:
        yield Static(f"{self.label} {self.address}", classes="chart-label")
        with Horizontal():
            yield HistoryChart("load", fmt=_pct, ceiling=100.0, style="green", classes="-load")
            yield HistoryChart("VRAM used", fmt=_bytes, ceiling=float(self.vram_total or 0),
                               style="#5f87d7", classes="-vram")
            yield HistoryChart("power", fmt=_watts, style="yellow", classes="-power")
            yield HistoryChart("temp", fmt=_celsius, style="red", classes="-temp")

    def show(self, history: History) -> None:
        """Safe before the charts exist (just mounted): they fill from on_mount then."""
        self._history = history
        for key in ("load", "vram", "power", "temp"):
            series = f"gpu/{self.address}/{key}"
            for chart in self.query(f".-{key}").results(HistoryChart):
                chart.show(history.get(series), history.latest(series))

    def on_mount(self) -> None:
        if getattr(self, "_history", None) is not None:
            self.show(self._history)


class HostCharts(Vertical):
    DEFAULT_CSS = """
    HostCharts { height: auto; }
    HostCharts > Horizontal { height: 5; }
    HostCharts HistoryChart { width: 1fr; height: 5; margin-right: 2; }
    """

    def compose(self) -> ComposeResult:
        yield Static("Host and service", classes="chart-label")
        with Horizontal():
            yield HistoryChart("CPU", fmt=_pct, ceiling=100.0, style="green", classes="-cpu")
            yield HistoryChart("RAM used", fmt=_bytes, style="#5f87d7", classes="-ram")
            yield HistoryChart("service CPU", fmt=_pct, ceiling=100.0, style="magenta",
                               classes="-child_cpu")
            yield HistoryChart("service RSS", fmt=_bytes, style="cyan", classes="-child_rss")

    def show(self, history: History, reading: HostReading) -> None:
        ceilings = {"ram": float(reading.ram_total or 0)}
        for key in ("cpu", "ram", "child_cpu", "child_rss"):
            series = f"host/{key}"
            self.query_one(f".-{key}", HistoryChart).show(history.get(series), history.latest(series),
                                                         ceilings.get(key))
