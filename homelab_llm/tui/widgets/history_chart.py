"""A column chart of recent samples (tok/s, GPU load, VRAM, watts...), as tall as its box.

One column per sample, newest on the right, each column filled to an eighth of a cell, scaled
to the larger of the highest sample shown and a fixed ceiling (100% for a load, the VRAM total);
the first line names the series, the latest value and the scale, so the chart reads without axes.
Used by the dashboard (tok/s) and the Hardware screen (per-GPU history).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rich.text import Text
from textual.widget import Widget

EIGHTHS = " ▁▂▃▄▅▆▇█"


def columns(values: Sequence[float], rows: int, top: float) -> list[str]:
    """Each value as a column of `rows` cells, bottom up; exact to an eighth of a cell."""
    out = []
    for value in values:
        eighths = 0 if top <= 0 else round(max(value, 0.0) / top * rows * 8)
        eighths = min(eighths, rows * 8)
        full, part = divmod(eighths, 8)
        cells = "█" * full + (EIGHTHS[part] if part else "")
        out.append(cells.ljust(rows))
    return out


def chart_lines(values: Sequence[float], width: int, rows: int, top: float) -> list[str]:
    """`rows` text lines, top line first; the newest sample in the last column."""
    shown = list(values)[-width:] if width > 0 else []
    cols = [" " * rows] * (width - len(shown)) + columns(shown, rows, top)
    return ["".join(col[r] for col in cols) for r in range(rows - 1, -1, -1)]


class HistoryChart(Widget):
    DEFAULT_CSS = "HistoryChart { height: 4; min-height: 2; }"

    def __init__(self, title: str, *, unit: str = "", style: str = "green",
                 fmt: Callable[[float | None], str] = lambda v: "n/a" if v is None else f"{v:.1f}",
                 ceiling: float = 0.0, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.title = title
        self.unit = unit
        self.style = style
        self.fmt = fmt
        self.ceiling = ceiling
        self.values: list[float] = []
        self.latest: float | None = None

    def show(self, values: Sequence[float], latest: float | None, ceiling: float | None = None) -> None:
        self.values = list(values)
        self.latest = latest
        if ceiling is not None:
            self.ceiling = ceiling
        self.refresh()

    def render(self) -> Text:
        width, rows = self.size.width, max(self.size.height - 1, 1)
        top = max([*self.values[-width:], self.ceiling, 0.0]) if width else self.ceiling
        head = Text.assemble((self.title, "bold"), f"  {self.fmt(self.latest)} {self.unit}".rstrip(),
                             (f"   scale 0-{self.fmt(top)}", "dim"))
        head.truncate(width)
        body = "\n".join(chart_lines(self.values, width, rows, top))
        return Text("\n").join([head, Text(body, style=self.style)])
