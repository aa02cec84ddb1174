"""A labelled tok/s sparkline: the latest value as a number, the recent history as a line."""

from __future__ import annotations

from collections.abc import Sequence

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Label, Sparkline

from homelab_llm.tui.widgets.format import rate


class RateChart(Horizontal):
    DEFAULT_CSS = """
    RateChart { height: 1; }
    RateChart > Label { width: 24; }
    RateChart > Sparkline { width: 1fr; }
    """

    def __init__(self, title: str, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.title = title

    def compose(self) -> ComposeResult:
        yield Label(f"{self.title}  n/a")
        yield Sparkline([], summary_function=max)

    def show(self, history: Sequence[float], latest: float | None) -> None:
        self.query_one(Label).update(f"{self.title} {rate(latest):>7} tok/s")
        self.query_one(Sparkline).data = list(history) or [0.0]
