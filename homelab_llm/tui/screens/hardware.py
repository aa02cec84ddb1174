"""Hardware: GPUs, PCIe links (current vs max, CPU or chipset), NUMA, live sensors, and the
warnings of the hardware check."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Static

from homelab_llm.tui.snapshot import GpuTelemetry, HardwareReport
from homelab_llm.tui.widgets.format import gib

if TYPE_CHECKING:
    from homelab_llm.tui.app import HomelabApp

COLUMNS = ("#", "PCI", "Name", "VRAM", "PCIe link", "Via", "NUMA", "Load Temp Power")


class HardwareScreen(Screen[None]):
    BINDINGS = [("r", "rescan", "Rescan")]

    app: HomelabApp  # type: ignore[assignment]

    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical(id="hw-body"):
            table: DataTable[str | Text] = DataTable(id="hw-gpus", cursor_type="row", zebra_stripes=True)
            table.border_title = "GPUs"
            yield table
            yield Static(id="hw-notes", classes="panel")
        yield Footer(compact=True, show_command_palette=False)

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns(*COLUMNS)
        self.watch(self.app, "hardware", lambda _: self._show())
        self.watch(self.app, "telemetry", lambda _: self._show())

    def _show(self) -> None:
        report: HardwareReport = self.app.hardware
        table = self.query_one(DataTable)
        table.clear()
        for index, gpu in enumerate(report.gpus):
            sensors = self.app.telemetry.get(gpu.pci_address)
            link = Text(gpu.link.describe(), style="yellow" if gpu.link.degraded else "")
            via = Text(gpu.attached_to or "?", style="yellow" if gpu.attached_to == "chipset" else "")
            table.add_row(
                f"{index}{'i' if gpu.integrated else ''}", gpu.pci_address.removeprefix("0000:"),
                gpu.name, gib(gpu.vram_bytes), link, via,
                "?" if gpu.numa_node is None else str(gpu.numa_node), _sensors(sensors))
        notes = Text()
        if report.error:
            notes.append(report.error + "\n", style="red")
        elif not report.gpus:
            notes.append("No GPU found: the engine runs on the CPU.\n", style="dim")
        if report.topology:
            notes.append("Topology: ", style="bold")
            notes.append(report.topology + "\n")
        for warning in report.warnings:
            notes.append("⚠ " + warning + "\n", style="yellow")
        if self.app.hardware_pending:
            notes.append("checking hardware…", style="dim")
        self.query_one("#hw-notes", Static).update(notes)

    def action_rescan(self) -> None:
        self.app.refresh_hardware()


def _sensors(sensors: GpuTelemetry | None) -> str:
    if sensors is None:
        return "n/a"
    values = [(sensors.load_pct, "%"), (sensors.temp_c, "°C"), (sensors.power_w, "W")]
    return " ".join("-" if v is None else f"{v:.0f}{unit}" for v, unit in values)
