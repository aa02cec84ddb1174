"""Create or edit a preset in a form. Every keystroke re-validates; each problem shows under its
own field, and Save refuses (writes nothing) while any remain. Dismisses with the valid Preset
or None; the caller writes it."""

from __future__ import annotations

import shlex
import tomllib
from typing import Any

from textual.app import ComposeResult
from textual.containers import Horizontal, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static, TextArea

from homelab_llm.presets import (BACKENDS, Preset, PresetError, PresetIssue, dump_preset,
                                  parse_preset, save_preset)

FIELDS = ("name", "description", "backend", "model", "command", "host", "port", "health_path",
          "startup_timeout", "args", "env")


def _table_text(entries: dict[str, object]) -> str:
    """args/env as the `key = value` lines a user would write in the TOML file."""
    text = dump_preset(Preset(name="x", args=entries))  # type: ignore[arg-type]
    return text.split("[args]\n", 1)[1] if "[args]\n" in text else ""


def save_edited_preset(app: Any, preset: Preset | None) -> None:
    """The editor's result written as a user preset, selected and shown (None: cancelled)."""
    if preset is None:
        return
    try:
        path = save_preset(preset)
    except (PresetError, OSError) as err:
        app.notify(f"not saved: {err}", severity="error")
        return
    app.current_preset = preset.name
    app.reload_presets()
    app.notify(f"saved {path}")


class PresetEditor(ModalScreen[Preset | None]):
    BINDINGS = [("escape", "cancel", "Cancel"), ("ctrl+s", "save", "Save")]

    def __init__(self, preset: Preset, *, title: str) -> None:
        super().__init__()
        self.preset = preset
        self.title_text = title
        self.issues: list[PresetIssue] = []

    def compose(self) -> ComposeResult:
        p = self.preset
        with VerticalScroll(id="editor-body") as body:
            body.border_title = self.title_text
            body.border_subtitle = "Ctrl+S saves · Esc cancels"
            yield from self._field("name", Input(p.name, id="f-name"))
            yield from self._field("description", Input(p.description, id="f-description"))
            yield from self._field("backend", Select([(b, b) for b in BACKENDS], value=p.backend,
                                                     allow_blank=False, id="f-backend"))
            yield from self._field("model", Input(p.model, placeholder="path, HF name or @default",
                                                  id="f-model"))
            yield Button("Browse models...", id="pick-model")
            yield from self._field("command", Input(shlex.join(p.command),
                                                    placeholder="{python} server.py --port {port}",
                                                    id="f-command"))
            yield from self._field("host", Input(p.host, id="f-host"))
            yield from self._field("port", Input(str(p.port), id="f-port"))
            yield from self._field("health_path", Input(p.health_path, id="f-health_path"))
            yield from self._field("startup_timeout", Input(f"{p.startup_timeout:g}",
                                                            id="f-startup_timeout"))
            yield from self._field("args", TextArea(_table_text(p.args), id="f-args",
                                                    soft_wrap=False, show_line_numbers=False))
            yield from self._field("env", TextArea(_table_text(dict(p.env)), id="f-env",
                                                   soft_wrap=False))
            with Horizontal(id="editor-buttons"):
                yield Button("Save", id="save", variant="success")
                yield Button("Cancel", id="cancel")
            yield Static("", id="editor-summary")

    def _field(self, name: str, widget: Input | Select[str] | TextArea) -> ComposeResult:
        label = name.replace("_", " ")
        if name in ("args", "env"):
            label += "  (TOML: key = value, one a line)"
        yield Label(label, classes="field-label")
        yield widget
        yield Static("", id=f"err-{name}", classes="field-error")

    def on_mount(self) -> None:
        self.validate_form()

    # ------------------------------------------------------------- reading the form

    def _text(self, name: str) -> str:
        widget = self.query_one(f"#f-{name}")
        if isinstance(widget, TextArea):
            return widget.text
        if isinstance(widget, Select):
            return str(widget.value)
        return widget.value  # type: ignore[attr-defined, no-any-return]

    def read_form(self) -> tuple[Preset | None, list[PresetIssue]]:
        issues: list[PresetIssue] = []
        data: dict[str, object] = {k: self._text(k).strip() for k in
                                   ("name", "description", "backend", "model", "host", "health_path")}
        data = {k: v for k, v in data.items() if v or k in ("name", "host", "model")}
        for key, kind in (("port", int), ("startup_timeout", float)):
            raw = self._text(key).strip()
            try:
                data[key] = kind(raw)
            except ValueError:
                issues.append(PresetIssue(key, f"{raw!r} is not a{'n integer' if kind is int else ' number'}"))
        try:
            command = shlex.split(self._text("command"))
            if command:
                data["command"] = command
        except ValueError as err:
            issues.append(PresetIssue("command", f"cannot split into words: {err}"))
        for table in ("args", "env"):
            try:
                data[table] = tomllib.loads(self._text(table))
            except tomllib.TOMLDecodeError as err:
                issues.append(PresetIssue(table, f"not TOML key = value lines: {err}"))
        if any(i.field in ("args", "env") for i in issues):
            data.pop("args", None), data.pop("env", None)
        preset, found = parse_preset(data, name=str(data.get("name", "")))
        # a field that failed to parse above would also fail validation with its default: say it once
        issues += [i for i in found if i.field.split(".")[0] not in {j.field for j in issues}]
        return (None if issues else preset), issues

    def validate_form(self) -> Preset | None:
        preset, self.issues = self.read_form()
        by_field: dict[str, list[str]] = {}
        for issue in self.issues:
            root = issue.field.split(".")[0] or "name"
            key = root if root in FIELDS else "args"
            prefix = issue.field.split(".", 1)[1] + ": " if "." in issue.field else ""
            by_field.setdefault(key, []).append(prefix + issue.message)
        for name in FIELDS:
            error = self.query_one(f"#err-{name}", Static)
            error.update("\n".join(by_field.get(name, [])))
            error.display = name in by_field
            self.query_one(f"#f-{name}").set_class(name in by_field, "-invalid")
        summary = self.query_one("#editor-summary", Static)
        summary.update(f"{len(self.issues)} problem(s): fix them to save" if self.issues else "")
        self.query_one("#save", Button).disabled = bool(self.issues)
        return preset

    def on_input_changed(self) -> None:
        self.validate_form()

    def on_text_area_changed(self) -> None:
        self.validate_form()

    def on_select_changed(self) -> None:
        self.validate_form()

    # ------------------------------------------------------------- actions

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        elif event.button.id == "pick-model":
            self.action_pick_model()
        else:
            self.action_cancel()

    def action_pick_model(self) -> None:
        """The models found on disk, or a file browser; the choice replaces the model field."""
        from homelab_llm.models.scan import scan_configured
        from homelab_llm.tui.screens.model_dialogs import ModelPicker

        def picked(path: str | None) -> None:
            if path:
                self.query_one("#f-model", Input).value = path

        self.app.push_screen(ModelPicker(scan_configured), picked)

    def action_save(self) -> None:
        preset = self.validate_form()
        if preset is None:
            self.notify("not saved: fix the fields marked in red", severity="error")
            return
        self.dismiss(preset)

    def action_cancel(self) -> None:
        self.dismiss(None)
