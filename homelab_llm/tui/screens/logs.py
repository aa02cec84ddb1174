"""Logs: the managed child's stdout and stderr, streamed as they arrive, wrapped to the pane
(a long error line is read whole, not cut at the edge) and filterable: `/` focuses the filter,
every keystroke re-shows the kept lines that contain it (case-insensitive), Esc clears it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Header, Input, RichLog

from homelab_llm.tui.service import LOG_LINES_KEPT

if TYPE_CHECKING:
    from homelab_llm.tui.app import HomelabApp

ERROR_WORDS = ("error", "fatal", "traceback", "exception", "critical")


def styled(line: str) -> Text:
    lower = line.lower()
    return Text(line, style="red" if any(word in lower for word in ERROR_WORDS) else "")


class LogsScreen(Screen[None]):
    BINDINGS = [
        Binding("slash", "filter", "Filter", key_display="/"),
        Binding("c", "clear", "Clear"),
        Binding("end", "follow", "Follow"),
        Binding("escape", "clear_filter", "Clear filter", show=False),
    ]

    app: HomelabApp  # type: ignore[assignment]

    def compose(self) -> ComposeResult:
        yield Header()
        yield RichLog(id="service-log", max_lines=LOG_LINES_KEPT, wrap=True, markup=False)
        yield Input(placeholder="/ filter: show only lines containing… (Esc clears)", id="log-filter")
        yield Footer(compact=True, show_command_palette=False)

    def on_mount(self) -> None:
        self._refill()  # what came before this screen existed

    @property
    def needle(self) -> str:
        return self.query_one("#log-filter", Input).value.strip().lower()

    def _matches(self, line: str) -> bool:
        needle = self.needle
        return not needle or needle in line.lower()

    def _refill(self) -> None:
        log = self.query_one(RichLog)
        log.clear()
        for line in self.app.service.logs:
            if self._matches(line):
                log.write(styled(line))

    def append(self, line: str) -> None:
        if self._matches(line):
            self.query_one(RichLog).write(styled(line))

    def on_input_changed(self, event: Input.Changed) -> None:
        self._refill()

    def action_filter(self) -> None:
        self.query_one("#log-filter", Input).focus()

    def action_clear_filter(self) -> None:
        box = self.query_one("#log-filter", Input)
        if box.value:
            box.value = ""  # Changed refills
        self.set_focus(None)

    def action_clear(self) -> None:
        self.app.service.logs.clear()
        self.query_one(RichLog).clear()

    def action_follow(self) -> None:
        log = self.query_one(RichLog)
        log.auto_scroll = True
        log.scroll_end(animate=False)
