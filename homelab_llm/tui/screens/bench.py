"""Bench: run a depth, concurrency or replay sweep against the running service (or any URL),
with progress, the result table and bar charts. Rows appear as each point finishes; cancelling
keeps them.

The sweep runs in a thread worker (`BenchJob`), never on the UI thread; its updates come back as
messages. One sweep at a time: the form is read when Run is pressed, so editing it during a run
changes nothing until the next one.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Button, DataTable, Footer, Header, Input, Label, ProgressBar, Select, Static

from homelab_llm.tui.bench_form import KINDS, BenchForm, BenchSpec, FormIssue, validate
from homelab_llm.tui.bench_job import BenchJob, JobUpdate, Report, empty_report
from homelab_llm.tui.bench_view import (chart_groups, columns, first_error, results_title,
                                        summary_line, table_rows)
from homelab_llm.tui.widgets.bar_chart import BarChart

if TYPE_CHECKING:
    from homelab_llm.tui.app import HomelabApp

# Fields shown per kind (the rest are hidden, not cleared: switching back keeps what was typed).
VISIBLE = {"depth": {"pp", "tg", "points", "repetitions"},
           "concurrency": {"pp", "tg", "points", "depth", "repetitions"},
           "replay": {"trace", "turns"}}
POINTS_LABEL = {"depth": "depths", "concurrency": "streams"}


@dataclass
class BenchUpdate(Message):
    update: JobUpdate


def _traces() -> list[str]:
    from homelab_llm.bench.replay import list_traces

    return list_traces() or ["agent-cpu"]


class BenchScreen(Screen[None]):
    BINDINGS = [
        Binding("ctrl+r", "run_or_cancel", "Run/cancel"),
        Binding("y", "copy_table", "Copy table"),
        Binding("escape", "leave_form", "Keys", show=False),
    ]

    app: HomelabApp  # type: ignore[assignment]

    def __init__(self, form: BenchForm | None = None) -> None:
        super().__init__()
        self.form = form or BenchForm()
        self.job: BenchJob | None = None
        self.report: Report | None = None

    def compose(self) -> ComposeResult:
        f = self.form
        yield Header()
        with Vertical(id="bench-form"):
            with Horizontal(classes="form-row"):
                yield Label("kind", classes="form-label")
                yield Select([(k, k) for k in KINDS], value=f.kind, allow_blank=False,
                             compact=True, id="b-kind")
                yield Label("target", classes="form-label")
                yield Input(f.target, placeholder="the running service", compact=True,
                            id="b-target")
            with Horizontal(classes="form-row"):
                yield Label("pp", classes="form-label -short", id="l-pp")
                yield Input(f.pp, compact=True, id="b-pp", classes="-num")
                yield Label("tg", classes="form-label -short", id="l-tg")
                yield Input(f.tg, compact=True, id="b-tg", classes="-num")
                yield Label("depth", classes="form-label", id="l-depth")
                yield Input(f.depth, compact=True, id="b-depth", classes="-num")
                yield Label(POINTS_LABEL.get(f.kind, "depths"), classes="form-label", id="l-points")
                yield Input(f.points, compact=True, id="b-points")
                yield Label("reps", classes="form-label", id="l-repetitions")
                yield Input(f.repetitions, compact=True, id="b-repetitions", classes="-num")
                yield Label("trace", classes="form-label", id="l-trace")
                traces = _traces()
                yield Select([(t, t) for t in traces], compact=True, allow_blank=False,
                             value=f.trace if f.trace in traces else traces[0], id="b-trace")
                yield Label("turns", classes="form-label", id="l-turns")
                yield Input(f.turns, placeholder="all", compact=True, id="b-turns", classes="-num")
            with Horizontal(classes="form-row"):
                yield Button("Run", id="b-run", variant="success", compact=True)
                yield Button("Cancel", id="b-cancel", variant="error", compact=True, disabled=True)
                yield ProgressBar(id="b-progress", show_eta=False, show_percentage=False)
                yield Static("", id="b-status")
            yield Static("", id="b-issues")
        with VerticalScroll(id="bench-body"):
            with Horizontal(id="bench-columns"):
                table: DataTable[str | Text] = DataTable(id="b-table", cursor_type="row",
                                                         zebra_stripes=True)
                table.border_title = "Results"
                yield table
                with Vertical(id="b-chart-panel", classes="panel") as panel:
                    panel.border_title = "Chart"
                    yield BarChart(placeholder="bars appear as points finish", id="b-chart")
            yield Static("", id="b-summary")
        yield Footer(compact=True, show_command_palette=False)

    def on_screen_resume(self) -> None:
        self._show_target_hint()

    def _show_target_hint(self) -> None:
        # Say which server an empty target means right now (it follows the service's state).
        url = self.app.probe_url()
        self.query_one("#b-target", Input).placeholder = (
            f"the running service ({url})" if url else "no service running: enter a URL or press s")

    def on_mount(self) -> None:
        self.watch(self.app, "service_status", lambda _: self._show_target_hint())
        self._show_kind(self.form.kind)
        self._set_columns(self.form.kind)
        self.query_one("#b-issues", Static).display = False
        self.query_one("#b-progress", ProgressBar).display = False  # until a sweep starts

    # ------------------------------------------------------------------ form

    def read_form(self) -> BenchForm:
        values: dict[str, str] = {}
        for f in fields(BenchForm):
            widget = self.query_one(f"#b-{f.name}")
            value = widget.value if isinstance(widget, (Input, Select)) else ""
            values[f.name] = "" if value is Select.BLANK else str(value)
        return BenchForm(**values)

    def _show_kind(self, kind: str) -> None:
        visible = VISIBLE.get(kind, set())
        for name in ("pp", "tg", "depth", "points", "repetitions", "trace", "turns"):
            for selector in (f"#b-{name}", f"#l-{name}"):
                self.query_one(selector).display = name in visible
        self.query_one("#l-points", Label).update(POINTS_LABEL.get(kind, "depths"))

    def _set_columns(self, kind: str) -> None:
        table = self.query_one("#b-table", DataTable)
        table.clear(columns=True)
        table.add_columns(*columns(kind))

    def on_select_changed(self, event: Select.Changed) -> None:
        if event.select.id == "b-kind" and isinstance(event.value, str):
            self._show_kind(event.value)
            self._mark_issues([])

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.action_run()

    def _mark_issues(self, issues: list[FormIssue]) -> None:
        bad = {i.field for i in issues}
        for name in ("target", "pp", "tg", "depth", "points", "repetitions", "trace", "turns"):
            self.query_one(f"#b-{name}").set_class(name in bad, "-invalid")
        box = self.query_one("#b-issues", Static)
        box.update(Text("\n".join(f"{i.field}: {i.message}" for i in issues), style="red"))
        box.display = bool(issues)

    # ------------------------------------------------------------------ running

    def action_run_or_cancel(self) -> None:
        if self.job is not None and self.job.running:
            self.action_cancel()
        else:
            self.action_run()

    def action_run(self) -> None:
        if self.job is not None and self.job.running:
            self.notify("a sweep is already running: cancel it first (Ctrl+R)", severity="warning")
            return
        spec, issues = validate(self.read_form(), self.app.probe_url(), self.app.api_key,
                                self.app.max_model_len())
        self._mark_issues(issues)
        if spec is None:
            return
        self.start(spec)

    def start(self, spec: BenchSpec) -> None:
        self.job = BenchJob(spec, lambda update: self.post_message(BenchUpdate(update)))
        self._set_columns(spec.kind)
        self.show_report(empty_report(spec))
        progress = self.query_one("#b-progress", ProgressBar)
        progress.update(total=max(spec.total_units, 1), progress=0)
        progress.display = True
        self.query_one("#b-status", Static).update("connecting…")
        self._set_running(True)
        self._run_job(self.job)

    @work(thread=True, exclusive=True, group="bench")
    def _run_job(self, job: BenchJob) -> None:
        job.run()

    def action_cancel(self) -> None:
        if self.job is not None and self.job.running:
            self.job.cancel()
            self.query_one("#b-status", Static).update("cancelling…")

    def _set_running(self, running: bool) -> None:
        self.query_one("#b-run", Button).disabled = running
        self.query_one("#b-cancel", Button).disabled = not running

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "b-run":
            self.action_run()
        elif event.button.id == "b-cancel":
            self.action_cancel()

    def on_bench_update(self, message: BenchUpdate) -> None:
        update = message.update
        progress = self.query_one("#b-progress", ProgressBar)
        progress.update(total=max(update.total, 1), progress=update.done)
        status = self.query_one("#b-status", Static)
        if update.error:
            status.update(Text(update.error, style="red"))
        elif update.cancelled:
            status.update(Text(update.label, style="yellow"))
        elif update.finished:
            status.update(update.label)
        else:
            status.update(f"{update.done}/{update.total} · {update.label}")
        self.show_report(update.report)
        if update.finished:
            self._set_running(False)
            if update.error:
                self.notify(update.error, title="bench failed", severity="error", timeout=10)

    def show_report(self, report: Report) -> None:
        """Fill the table, chart and summary from `report` (also used by the snapshot test)."""
        self.report = report
        table = self.query_one("#b-table", DataTable)
        rows = table_rows(report)
        if table.row_count > len(rows):  # a new sweep started
            table.clear()
        for index, row in enumerate(rows):  # rows only ever get appended while a sweep runs
            if index >= table.row_count:
                table.add_row(*row)
        table.border_title = results_title(report)
        self.query_one("#b-chart", BarChart).show(chart_groups(report))
        has_rows = bool(rows)
        summary = summary_line(report) if has_rows else ""
        error = first_error(report)
        text = Text(summary, style="dim")
        if error:
            text.append(f"\nfirst error: {error}", style="red")
        self.query_one("#b-summary", Static).update(text)

    # ------------------------------------------------------------------ misc

    def action_copy_table(self) -> None:
        from homelab_llm.bench.report import replay_table, sweep_table
        from homelab_llm.bench.replay import ReplayReport

        if self.report is None or not table_rows(self.report):
            self.notify("no results to copy yet", severity="warning")
            return
        report = self.report
        text = (replay_table(report, markdown=True) if isinstance(report, ReplayReport)
                else sweep_table(report, markdown=True))
        self.app.copy_to_clipboard(text)
        self.notify("results copied as a markdown table")

    def action_leave_form(self) -> None:
        self.set_focus(None)

    def on_unmount(self) -> None:
        self.stop_job()

    def stop_job(self, timeout: float = 5.0) -> None:
        """Cancel a running sweep and wait for its requests to close (the app is quitting)."""
        if self.job is not None and self.job.running:
            self.job.cancel()
            self.job.wait(timeout)
