"""Hardware: this PC (GPUs, PCIe links current vs max, CPU or chipset, NUMA, live sensors), the
topology matrix and PCIe tree exactly as `hwcheck` prints them, the warnings, and history charts
per GPU and for the host (CPU, RAM, and the service's own CPU and memory); and the build wizard
for a PC not bought yet (w switches)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import ContentSwitcher, DataTable, Footer, Header, Static

from homelab_llm.errors import HomelabError
from homelab_llm.presets import user_presets_dir

from homelab_llm.tui.snapshot import GpuTelemetry, HardwareReport
from homelab_llm.tui.widgets.build_wizard import BuildWizard
from homelab_llm.tui.widgets.format import gib
from homelab_llm.tui.widgets.hw_charts import GpuCharts, HostCharts

if TYPE_CHECKING:
    from homelab_llm.tui.app import HomelabApp

COLUMNS = ("#", "PCI", "Name", "VRAM", "PCIe link", "Via", "NUMA", "Load Temp Power")


class HardwareScreen(Screen[None]):
    BINDINGS = [
        Binding("w", "toggle_view", "PC/wizard"),
        Binding("r", "rescan", "Rescan"),
        Binding("ctrl+n", "wizard_step(1)", "Next step"),
        Binding("ctrl+b", "wizard_step(-1)", "Back"),
        Binding("ctrl+s", "save_build", "Save build"),
    ]

    app: HomelabApp  # type: ignore[assignment]

    def compose(self) -> ComposeResult:
        yield Header()
        with ContentSwitcher(initial="hw-body", id="hw-views"):
            with VerticalScroll(id="hw-body"):
                table: DataTable[str | Text] = DataTable(id="hw-gpus", cursor_type="row",
                                                         zebra_stripes=True)
                table.border_title = "GPUs"
                yield table
                yield Static(id="hw-notes", classes="panel")
                topology = Static(id="hw-topology", classes="panel")
                topology.border_title = "Topology"
                yield topology
                with Vertical(id="hw-history", classes="panel") as history:
                    history.border_title = "History"
                    yield Vertical(id="hw-gpu-charts")
                    yield HostCharts(id="hw-host-charts")
            try:
                yield BuildWizard(self.app.catalog_loader(), id="hw-wizard")
            except HomelabError as err:  # a broken user catalog file: say which, keep the rest
                yield Static(Text(f"build wizard unavailable: {err}", style="red"), id="hw-wizard")
        yield Footer(compact=True, show_command_palette=False)

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns(*COLUMNS)
        self.watch(self.app, "hardware", lambda _: self._show())
        self.watch(self.app, "telemetry", lambda _: self._show())

    def _show(self) -> None:
        self._show_table()
        self._show_charts()

    def _show_charts(self) -> None:
        gpus = [g for g in self.app.hardware.gpus if not g.integrated]
        box = self.query_one("#hw-gpu-charts", Vertical)
        rows = list(box.query(GpuCharts))
        if [r.address for r in rows] != [g.pci_address for g in gpus]:
            box.remove_children()
            rows = [GpuCharts(f"GPU{i}", g.pci_address, g.vram_bytes) for i, g in enumerate(gpus)]
            box.mount_all(rows)
        for row in rows:
            row.show(self.app.history)
        self.query_one(HostCharts).show(self.app.history, self.app.host_reading)

    def _show_table(self) -> None:
        report: HardwareReport = self.app.hardware
        table = self.query_one(DataTable)
        table.clear()
        for index, gpu in enumerate(report.gpus):
            sensors = self.app.telemetry.get(gpu.pci_address)
            link = Text(gpu.link.describe(), style="yellow" if gpu.link.degraded else "")
            via = Text(gpu.attached_to or "n/a", style="yellow" if gpu.attached_to == "chipset" else "")
            table.add_row(
                f"{index}{'i' if gpu.integrated else ''}", gpu.pci_address.removeprefix("0000:"),
                gpu.name, gib(gpu.vram_bytes), link, via,
                "-" if gpu.numa_node is None else str(gpu.numa_node), _sensors(sensors))
        notes = Text()
        if report.error:
            notes.append(report.error + "\n", style="red")
        elif not report.gpus:
            notes.append("No GPU found: the engine runs on the CPU.\n", style="dim")
        for warning in report.warnings:
            notes.append("⚠ " + warning + "\n", style="yellow")
        if self.app.hardware_pending:
            notes.append("checking hardware…", style="dim")
        notes.rstrip()
        self.query_one("#hw-notes", Static).update(notes)
        topology = "\n\n".join(part for part in (report.topology, report.tree) if part)
        box = self.query_one("#hw-topology", Static)
        box.update(Text(topology))
        box.display = bool(topology)

    def action_rescan(self) -> None:
        self.app.refresh_hardware()

    def action_toggle_view(self) -> None:
        switcher = self.query_one(ContentSwitcher)
        wizard = switcher.current != "hw-wizard"
        switcher.current = "hw-wizard" if wizard else "hw-body"
        self.sub_title = "build wizard" if wizard else ""
        self.refresh_bindings()
        if wizard:
            self.query_one("#w-board").focus()
        else:
            self.set_focus(None)

    def action_save_build(self) -> None:
        try:
            path = self.query_one(BuildWizard).save(user_presets_dir().parent / "builds")
        except (HomelabError, OSError) as err:
            self.notify(str(err), title="build not saved", severity="error")
            return
        self.notify(f"saved {path}; check it with `homelab-llm hwcheck build {path}`",
                    title="build saved")

    def action_wizard_step(self, delta: int) -> None:
        self.query_one(BuildWizard).action_step(delta)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        in_wizard = self.query_one(ContentSwitcher).current == "hw-wizard"
        if action == "rescan":  # this PC's view only
            return not in_wizard
        if action in ("wizard_step", "save_build"):
            return in_wizard and bool(self.query(BuildWizard))
        return True


def _sensors(sensors: GpuTelemetry | None) -> str:
    if sensors is None:
        return "n/a"
    values = [(sensors.load_pct, "%"), (sensors.temp_c, "°C"), (sensors.power_w, "W")]
    return " ".join("-" if v is None else f"{v:.0f}{unit}" for v, unit in values)
