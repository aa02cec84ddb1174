"""Presets: the list (built-in and user), the selected one's TOML and launch command, and the keys
to start/stop, create, edit, duplicate and delete."""

from __future__ import annotations

import shlex
import sys
from typing import TYPE_CHECKING

from rich.syntax import Syntax
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Static

from homelab_llm.presets import Preset, PresetError, delete_preset, dump_preset
from homelab_llm.tui.launch import launch_command
from homelab_llm.tui.screens.confirm import ConfirmScreen
from homelab_llm.tui.screens.preset_editor import PresetEditor, save_edited_preset

if TYPE_CHECKING:
    from homelab_llm.tui.app import HomelabApp


class PresetsScreen(Screen[None]):
    BINDINGS = [
        Binding("s", "app.toggle_service", "Start/stop"),
        Binding("e,enter", "edit", "Edit"),
        Binding("n", "new", "New"),
        Binding("x,delete", "delete", "Delete"),
        Binding("c", "duplicate", "Duplicate", show=False),  # in the help; the footer is full
        Binding("r", "reload", "Reload", show=False),
    ]

    app: HomelabApp  # type: ignore[assignment]

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="presets-body"):
            table: DataTable[str | Text] = DataTable(id="preset-table", cursor_type="row")
            table.border_title = "Presets"
            yield table
            with VerticalScroll(id="preset-detail", classes="panel") as detail:
                detail.border_title = "Preset"
                yield Static(id="preset-toml")
                yield Static(id="preset-command")
        yield Footer(compact=True, show_command_palette=False)

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("Name", "Backend", "From")
        self.watch(self.app, "presets", lambda _: self._fill())
        self.watch(self.app, "service_status", lambda _: self._fill())

    def _fill(self) -> None:
        table = self.query_one(DataTable)
        selected = self.app.current_preset
        table.clear()
        running = self.app.service_status.preset if self.app.service_status.running else ""
        for preset in self.app.presets:
            name = Text(("▶ " if preset.name == running else "  ") + preset.name,
                        style="bold green" if preset.name == running else "")
            table.add_row(name, preset.backend, "built-in" if preset.builtin else "user",
                          key=preset.name)
        for path, error in self.app.broken_presets.items():
            table.add_row(Text(f"  {path.stem}", style="red"), "broken", "user", key=f"!{path}")
        names = [p.name for p in self.app.presets]
        if selected in names:
            table.move_cursor(row=names.index(selected), animate=False)
        self._show_detail()

    def selected(self) -> Preset | None:
        table = self.query_one(DataTable)
        if not table.row_count:
            return None
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value or ""
        return next((p for p in self.app.presets if p.name == key), None)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        preset = self.selected()
        if preset is not None:
            self.app.current_preset = preset.name
        self._show_detail()

    def _show_detail(self) -> None:
        preset = self.selected()
        toml, command = self.query_one("#preset-toml", Static), self.query_one("#preset-command", Static)
        if preset is None:
            key = ""
            table = self.query_one(DataTable)
            if table.row_count:
                key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value or ""
            error = next((e for p, e in self.app.broken_presets.items() if f"!{p}" == key), "")
            toml.update(Text(error or "no preset selected", style="red" if error else "dim"))
            command.update("")
            return
        toml.update(Syntax(dump_preset(preset), "toml", theme="ansi_dark", word_wrap=True,
                           background_color="default"))
        # Shown as a person would type it: "python", not this interpreter's install path (which
        # also keeps the screen identical from one machine to the next).
        argv = ["python" if arg == sys.executable else arg
                for arg in launch_command(preset, resolve_model=False)]
        source = "built-in" if preset.builtin else f"user file {preset.source}"
        command.update(Text.assemble(("launches ", "bold"), shlex.join(argv), "\n",
                                     (f"from {source}", "dim")))

    # ------------------------------------------------------------------ actions

    def action_edit(self) -> None:
        preset = self.selected()
        if preset is not None:
            title = f"Edit {preset.name}" + (" (saved as a user copy)" if preset.builtin else "")
            self.app.push_screen(PresetEditor(preset, title=title), self._saved)

    def action_new(self) -> None:
        blank = Preset(name="my-preset", model="@default", args={"device": "cpu"})
        self.app.push_screen(PresetEditor(blank, title="New preset"), self._saved)

    def action_duplicate(self) -> None:
        preset = self.selected()
        if preset is not None:
            names = {p.name for p in self.app.presets}
            name = next(f"{preset.name}-copy{'' if i == 1 else i}" for i in range(1, 1000)
                        if f"{preset.name}-copy{'' if i == 1 else i}" not in names)
            copy = preset.with_changes(name=name, source=None, builtin=False)
            self.app.push_screen(PresetEditor(copy, title=f"Duplicate of {preset.name}"), self._saved)

    def _saved(self, preset: Preset | None) -> None:
        save_edited_preset(self.app, preset)

    def action_delete(self) -> None:
        preset = self.selected()
        if preset is None:
            return
        if preset.builtin:
            self.notify(f"{preset.name} is built in and cannot be deleted; edit it to override it",
                        severity="warning")
            return

        def answered(yes: bool | None) -> None:
            if yes:
                try:
                    delete_preset(preset.name)
                except PresetError as err:
                    self.notify(str(err), severity="error")
                self.app.reload_presets()

        self.app.push_screen(ConfirmScreen(f"Delete user preset {preset.name}?\n{preset.source}"),
                             answered)

    def action_reload(self) -> None:
        self.app.reload_presets()
