"""A stacked bar of one device's memory: weights / activations / graphs / KV used / KV free /
state / other / free, each segment's width proportional to its bytes, then a legend in words
with sizes (wrapping between entries, never inside one). `state` (hybrid models' recurrent
states) is listed only when the server reports some; KV used and free always are."""

from __future__ import annotations

from rich.text import Text
from textual.geometry import Size
from textual.reactive import reactive
from textual.widget import Widget

from homelab_llm.tui.snapshot import DeviceMemory
from homelab_llm.tui.widgets.format import gib

# label -> colour; chosen to stay distinct on dark and light themes.
SEGMENT_STYLES: dict[str, str] = {
    "weights": "#5f87d7", "activations": "#d7875f", "graphs": "#af87d7", "KV used": "#5fd75f",
    "KV free": "#2e6b2e", "state": "#5fd7d7", "other": "#d7d75f", "free": "#4e4e4e",
}
ALWAYS_LISTED = ("KV used", "KV free")
GAP = "  "


def legend(segments: list[tuple[str, int]], width: int) -> Text:
    """Entries like "■ KV used 5.7G", broken into lines between entries, never inside one."""
    text = Text()
    column = 0
    for label, size in segments:
        if size <= 0 and label not in ALWAYS_LISTED:
            continue
        entry = f"{label} {gib(size)}"
        needed = len(entry) + 2
        if column and column + len(GAP) + needed > width:
            text.append("\n")
            column = 0
        elif column:
            text.append(GAP)
            column += len(GAP)
        text.append("■ ", style=SEGMENT_STYLES[label])
        text.append(entry)
        column += needed
    return text


def bar_cells(segments: list[tuple[str, int]], width: int) -> list[tuple[str, int]]:
    """Integer cell counts per segment summing to width (largest remainder), so the bar never
    jitters by a cell between refreshes and a non-empty segment shows at least one cell when it can."""
    total = sum(max(b, 0) for _, b in segments)
    if total <= 0 or width <= 0:
        return [(label, 0) for label, _ in segments]
    exact = [max(b, 0) * width / total for _, b in segments]
    cells = [int(e) for e in exact]
    for i in sorted(range(len(exact)), key=lambda i: exact[i] - cells[i], reverse=True):
        if sum(cells) >= width:
            break
        cells[i] += 1
    for i, (_, b) in enumerate(segments):  # steal from the widest for tiny non-zero segments
        if b > 0 and cells[i] == 0:
            widest = max(range(len(cells)), key=cells.__getitem__)
            if cells[widest] > 1:
                cells[widest] -= 1
                cells[i] = 1
    return [(label, n) for (label, _), n in zip(segments, cells)]


class VramBar(Widget):
    """The bar, then the legend (one line or more). Data arrives through `update(device, kv_fraction)`."""

    DEFAULT_CSS = "VramBar { height: auto; }"
    device: reactive[DeviceMemory | None] = reactive(None, layout=True)
    kv_used_fraction: reactive[float | None] = reactive(None)

    def update(self, device: DeviceMemory | None, kv_used_fraction: float | None) -> None:
        self.device = device
        self.kv_used_fraction = kv_used_fraction
        self.display = device is not None  # the dashboard says once why there is no split

    def render(self) -> Text:
        if self.device is None:
            return Text("memory split: not reported by this server", style="dim")
        segments = self.device.segments(self.kv_used_fraction)
        bar = Text()
        for label, cells in bar_cells(segments, self.size.width):
            bar.append("█" * cells, style=SEGMENT_STYLES[label])
        return Text("\n").join([bar, legend(segments, self.size.width)])

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        if self.device is None:
            return 1
        return 1 + len(legend(self.device.segments(self.kv_used_fraction), width).split("\n"))
