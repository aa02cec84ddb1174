"""Logs: the managed child's stdout and stderr, streamed as they arrive."""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.app import ComposeResult
from textual.screen import Screen
from textual.widgets import Footer, Header, Log

if TYPE_CHECKING:
    from homelab_llm.tui.app import HomelabApp


class LogsScreen(Screen[None]):
    BINDINGS = [("c", "clear", "Clear"), ("end", "follow", "Follow")]

    app: HomelabApp  # type: ignore[assignment]

    def compose(self) -> ComposeResult:
        yield Header()
        yield Log(id="service-log", max_lines=5000, highlight=False)
        yield Footer(compact=True, show_command_palette=False)

    def on_mount(self) -> None:
        log = self.query_one(Log)
        log.write_lines(list(self.app.service.logs))  # what came before this screen existed

    def append(self, line: str) -> None:
        self.query_one(Log).write_line(line)

    def action_clear(self) -> None:
        self.query_one(Log).clear()

    def action_follow(self) -> None:
        log = self.query_one(Log)
        log.auto_scroll = True
        log.scroll_end(animate=False)
