"""Models: what is on disk (Hub cache, ~/models, the settings file's folders) with fit verdicts
for this machine's GPUs, a pull from the Hub with live progress, "make a preset", which opens
the preset editor filled in from the plan, and the router (one endpoint for every preset).

Scans and pulls run in thread workers and hand results back with call_from_thread; the UI
thread never reads a file header or a socket.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, ProgressBar, Static

from homelab_llm.errors import HomelabError
from homelab_llm.models.describe import LocalModel
from homelab_llm.models.fit import Fit, Machine, fit_model, this_machine
from homelab_llm.models.format import format_size, params_text, verdict_text, why_not
from homelab_llm.models.make_preset import PresetDraftError, draft_preset
from homelab_llm.models.pull import FitCheck, PullProgress, pull
from homelab_llm.models.scan import scan_configured
from homelab_llm.tui.screens.model_dialogs import PullDialog, PullRequest
from homelab_llm.settings import DEFAULT_ROUTER_PORT, load_settings
from homelab_llm.tui.screens.preset_editor import PresetEditor, save_edited_preset
from homelab_llm.tui.widgets.router_panel import RouterPanel

if TYPE_CHECKING:
    from homelab_llm.tui.app import HomelabApp

Scanner = Callable[[], list[LocalModel]]
MachineSource = Callable[[], Machine | None]


class ModelsScreen(Screen[None]):
    CSS_PATH = "../models.tcss"
    BINDINGS = [
        Binding("enter,n", "make_preset", "Make preset"),
        Binding("u", "pull", "Pull"),
        Binding("r", "rescan", "Rescan"),
        Binding("o", "toggle_router", "Router on/off"),
    ]

    app: HomelabApp  # type: ignore[assignment]

    def __init__(self, *, scanner: Scanner = scan_configured,
                 machine_source: MachineSource = this_machine,
                 puller: Callable[..., Any] = pull, router_port: int | None = None) -> None:
        super().__init__()
        self.scanner = scanner
        self.machine_source = machine_source
        self.puller = puller
        self.machine: Machine | None = None
        self.found: list[tuple[LocalModel, Fit | None]] = []
        self.pulling = False
        if router_port is None:
            try:
                router_port = load_settings().router_port
            except HomelabError:
                router_port = DEFAULT_ROUTER_PORT  # the scan reports the broken file
        self.router_port = router_port

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="models-body"):
            table: DataTable[str | Text] = DataTable(id="models-table", cursor_type="row")
            table.border_title = "Models (scanning...)"
            yield table
            with VerticalScroll(id="model-detail", classes="panel") as detail:
                detail.border_title = "Model"
                yield Static(id="model-info")
                yield Static(id="pull-status")
                yield ProgressBar(id="pull-progress", show_eta=True)
                yield RouterPanel(self.router_port, id="router-panel")
        yield Footer(compact=True, show_command_palette=False)

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns("Name", "Family", "Params", "Quant", "Size", "Fit")
        self.query_one("#pull-progress").display = False
        self.action_rescan()

    # ------------------------------------------------------------------ scanning

    def action_rescan(self) -> None:
        self.query_one(DataTable).border_title = "Models (scanning...)"
        self.scan()

    @work(thread=True, exclusive=True, group="models-scan")
    def scan(self) -> None:
        try:
            machine = self.machine_source()
            found = [(m, fit_model(m.config, machine) if m.config and machine else None)
                     for m in self.scanner()]
        except HomelabError as err:
            self.app.call_from_thread(self.notify, f"scan failed: {err}", severity="error")
            return
        self.app.call_from_thread(self.show, found, machine)

    def show(self, found: list[tuple[LocalModel, Fit | None]], machine: Machine | None) -> None:
        self.found, self.machine = found, machine
        table = self.query_one(DataTable)
        table.clear()
        for model, fit in found:
            verdict = verdict_text(model, fit)
            style = "green" if fit is not None and fit.fits else "red" if why_not(model, fit) else ""
            table.add_row(model.name, model.family, params_text(model), model.quantization,
                          format_size(model.size_bytes), Text(verdict, style=style), key=model.path)
        where = ("no GPU found" if machine is None else
                 f"{machine.tensor_parallel_size} x {machine.gpu_memory_bytes / 2**30:.0f} GiB")
        table.border_title = f"Models: {len(found)} · fit for {where}, int8 KV"
        self.show_detail()

    def selected(self) -> tuple[LocalModel, Fit | None] | None:
        table = self.query_one(DataTable)
        if not table.row_count:
            return None
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        return next(((m, f) for m, f in self.found if m.path == key), None)

    def on_data_table_row_highlighted(self) -> None:
        self.show_detail()

    def show_detail(self) -> None:
        info = self.query_one("#model-info", Static)
        chosen = self.selected()
        if chosen is None:
            info.update(Text("no models found: pull one (u) or add models_dirs to the settings file",
                             style="dim"))
            return
        m, fit = chosen
        lines = [Text(m.name, style="bold"), Text(m.path, style="dim"),
                 Text(f"{m.family} · {params_text(m)} params · {m.quantization} · "
                      f"{format_size(m.size_bytes)}")]
        if not m.supported:
            lines.append(Text(f"unsupported: {m.reason}", style="red"))
        elif fit is None:
            lines.append(Text("no GPU to fit against; a preset made here runs on the CPU", style="dim"))
        elif fit.fits:
            lines.append(Text(f"fits: up to {fit.max_context:,} tokens at int8 KV, "
                              f"{fit.concurrency_32k} sequences of 32K, weights "
                              f"{fit.weights_bytes / 1e9:.1f} GB per GPU", style="green"))
        else:
            lines.append(Text(f"does not fit: {fit.reason}", style="red"))
        info.update(Text("\n").join(lines))

    # ------------------------------------------------------------------ make a preset

    def action_make_preset(self) -> None:
        chosen = self.selected()
        if chosen is None:
            return
        try:
            preset = draft_preset(chosen[0], self.machine)
        except PresetDraftError as err:
            self.notify(str(err), severity="error")
            return
        taken = {p.name for p in self.app.presets}
        if preset.name in taken:
            preset = preset.with_changes(name=next(f"{preset.name}-{i}" for i in range(2, 1000)
                                                   if f"{preset.name}-{i}" not in taken))
        self.app.push_screen(PresetEditor(preset, title=f"New preset for {chosen[0].name}"),
                             lambda p: save_edited_preset(self.app, p))

    # ------------------------------------------------------------------ router

    def action_toggle_router(self) -> None:
        """One endpoint for every preset (`homelab-llm router`), run as a managed child."""
        try:
            self.query_one(RouterPanel).toggle()
        except HomelabError as err:  # its port is taken, ...
            self.notify(f"router not started: {err}", severity="error")

    # ------------------------------------------------------------------ pull

    def action_pull(self) -> None:
        if self.pulling:
            self.notify("a pull is already running", severity="warning")
            return
        self.app.push_screen(PullDialog(), self.start_pull)

    def start_pull(self, request: PullRequest | None) -> None:
        if request is None:
            return
        self.pulling = True
        bar = self.query_one("#pull-progress", ProgressBar)
        bar.display = True
        bar.update(total=None, progress=0)
        self.query_one("#pull-status", Static).update(f"pulling {request.repo_id}...")
        self.run_pull(request)

    @work(thread=True, exclusive=True, group="models-pull")
    def run_pull(self, request: PullRequest) -> None:
        call = self.app.call_from_thread
        try:
            result = self.puller(request.repo_id, include=request.include, machine=self.machine,
                                 on_fit=lambda c: call(self.show_fit, c),
                                 on_progress=lambda p: call(self.show_progress, p))
        except HomelabError as err:
            call(self.pull_done, f"pull failed: {err}", "error")
            return
        call(self.pull_done, f"pulled {request.repo_id} to {result.path}", "information")

    def show_fit(self, check: FitCheck) -> None:
        self.notify(check.verdict, severity="warning" if check.blocks else "information")

    def show_progress(self, progress: PullProgress) -> None:
        p = progress.file
        self.query_one("#pull-progress", ProgressBar).update(total=p.total_bytes, progress=p.done_bytes)
        resumed = f", resumed at {p.resumed_from / 1e6:,.1f} MB" if p.resumed_from else ""
        self.query_one("#pull-status", Static).update(
            f"[{progress.file_index}/{progress.file_count}] {p.filename}: {p.done_bytes / 1e6:,.1f}"
            f" / {p.total_bytes / 1e6:,.1f} MB at {p.rate_bps / 1e6:,.1f} MB/s{resumed}")

    def pull_done(self, message: str, severity: str) -> None:
        self.pulling = False
        self.query_one("#pull-progress", ProgressBar).display = False
        self.query_one("#pull-status", Static).update(message)
        self.notify(message, severity=severity)  # type: ignore[arg-type]
        self.action_rescan()
