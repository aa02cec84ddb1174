"""Horizontal bar charts in plain text: one bar per labelled value, drawn with eighth blocks so a
bar is exact to 1/8 of a cell, scaled to the widget's width on every resize.

A group is one series (e.g. "prompt t/s"), each with its own scale: prompt and decode speeds
differ by 10-100x, and one shared axis would flatten the smaller series into nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.text import Text
from textual.widget import Widget

EIGHTHS = " ▏▎▍▌▋▊▉"


@dataclass(frozen=True)
class BarGroup:
    title: str
    bars: tuple[tuple[str, float | None], ...]  # (label, value); None: not measured
    unit: str = ""
    style: str = "cyan"
    digits: int | None = None  # None: 1 decimal below 100, none above (as the dashboard prints)


def bar(value: float, maximum: float, width: int) -> str:
    """A bar of `value / maximum` of `width` cells (at least a sliver for any positive value)."""
    if width <= 0 or maximum <= 0 or value <= 0:
        return ""
    eighths = max(1, round(min(value / maximum, 1.0) * width * 8))
    full, part = divmod(eighths, 8)
    return "█" * full + (EIGHTHS[part] if part else "")


def render_groups(groups: Sequence[BarGroup], width: int) -> Text:
    text = Text(no_wrap=True, overflow="ellipsis")
    label_w = max((len(label) for g in groups for label, _ in g.bars), default=0)
    first = True
    for group in groups:
        values = [v for _, v in group.bars if v is not None]
        value_texts = [_number(v, group.digits) for _, v in group.bars]
        value_w = max((len(v) for v in value_texts), default=3)
        bar_w = max(4, width - label_w - value_w - len(group.unit) - 4)
        if not first:
            text.append("\n\n")
        first = False
        text.append(group.title, style="bold")
        maximum = max(values, default=0.0)
        for (label, value), shown in zip(group.bars, value_texts):
            drawn = bar(value or 0.0, maximum, bar_w)
            text.append(f"\n{label:<{label_w}} ", style="dim")
            text.append(drawn, style=group.style)
            text.append(" " * (bar_w - len(drawn) + 1))
            text.append(f"{shown:>{value_w}}")
            if group.unit:
                text.append(f" {group.unit}", style="dim")
    return text


def _number(value: float | None, digits: int | None) -> str:
    if value is None:
        return "n/a"
    if digits is None:
        digits = 0 if value >= 100 else 1
    return f"{value:,.{digits}f}"


class BarChart(Widget):
    DEFAULT_CSS = "BarChart { height: auto; }"

    def __init__(self, *, placeholder: str = "", id: str | None = None) -> None:
        super().__init__(id=id)
        self.placeholder = placeholder
        self.groups: tuple[BarGroup, ...] = ()

    def show(self, groups: Sequence[BarGroup]) -> None:
        self.groups = tuple(g for g in groups if g.bars)
        self.refresh(layout=True)

    def get_content_height(self, container, viewport, width: int) -> int:  # type: ignore[no-untyped-def]
        if not self.groups:
            return 1
        return sum(1 + len(g.bars) for g in self.groups) + len(self.groups) - 1

    def render(self) -> Text:
        if not self.groups:
            return Text(self.placeholder, style="dim")
        return render_groups(self.groups, self.content_size.width)
