"""One device on the dashboard: a header (name, VRAM, PCIe link, live sensors) and its VRAM bar."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from homelab_llm.tui.snapshot import DeviceMemory, GpuInfo, GpuTelemetry
from homelab_llm.tui.widgets.format import gib
from homelab_llm.tui.widgets.vram_bar import VramBar


def gpu_header(index: int, device: DeviceMemory | None, gpu: GpuInfo | None,
               sensors: GpuTelemetry | None) -> Text:
    name = (gpu.name if gpu else "") or (device.name if device else "") or "device"
    total = device.total if device else (gpu.vram_bytes if gpu else None)
    label = "CPU" if device is not None and device.name.lower() == "cpu" else f"GPU{index}"
    text = Text.assemble((f"{label} ", "bold"), (name, "bold"), f"  {gib(total)}")
    if gpu is not None:
        link_style = "yellow" if gpu.link.degraded else ""
        text.append("  PCIe ")
        text.append(gpu.link.describe(), style=link_style)
        if gpu.attached_to:
            text.append(f" via {gpu.attached_to}", style="yellow" if gpu.attached_to == "chipset" else "")
    if sensors is not None:
        parts = []
        if sensors.load_pct is not None:
            parts.append(f"{sensors.load_pct:.0f}%")
        if sensors.temp_c is not None:
            parts.append(f"{sensors.temp_c:.0f}°C")
        if sensors.power_w is not None:
            parts.append(f"{sensors.power_w:.0f}W")
        if parts:
            text.append("  " + " ".join(parts), style="cyan")
    return text


class GpuPanel(Vertical):
    DEFAULT_CSS = "GpuPanel { height: auto; }"

    def compose(self) -> ComposeResult:
        yield Static(classes="gpu-header")
        yield VramBar()

    def show(self, index: int, device: DeviceMemory | None, gpu: GpuInfo | None,
             sensors: GpuTelemetry | None, kv_used_fraction: float | None) -> None:
        """Safe before mounting: the data is kept and applied once the children exist."""
        self._data = (index, device, gpu, sensors, kv_used_fraction)
        if self.is_mounted:
            self._apply()

    def on_mount(self) -> None:
        # The children may still be on their way in (the dashboard swaps every panel when the
        # device count changes): apply after the next refresh, when they are there.
        self.call_after_refresh(self._apply)

    def _apply(self) -> None:
        data = getattr(self, "_data", None)
        headers = self.query(".gpu-header").results(Static)
        bars = self.query(VramBar).results(VramBar)
        header, bar = next(headers, None), next(bars, None)
        if data is None or header is None or bar is None:
            return  # not composed yet (on_mount comes back) or being removed
        index, device, gpu, sensors, kv_used_fraction = data
        header.update(gpu_header(index, device, gpu, sensors))
        bar.update(device, kv_used_fraction)
