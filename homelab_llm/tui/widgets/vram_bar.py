"""A stacked bar of one device's memory: weights / activations / graphs / state (hybrid models'
recurrent states) / KV used / KV free / other / free, each segment's width proportional to its
bytes, with a legend of sizes (zero-byte segments other than KV are left out of the legend)."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from homelab_llm.tui.snapshot import DeviceMemory
from homelab_llm.tui.widgets.format import gib

# label -> (style, legend key); colours chosen to stay distinct on dark and light themes.
SEGMENT_STYLES: dict[str, tuple[str, str]] = {
    "weights": ("#5f87d7", "W"), "activations": ("#d7875f", "A"), "graphs": ("#af87d7", "G"),
    "state": ("#5fafaf", "S"), "kv used": ("#5fd75f", "KV"), "kv free": ("#2e6b2e", "kv"),
    "other": ("#d7d75f", "O"), "free": ("#4e4e4e", "F"),
}


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
    """Two lines: the bar, then the legend. Data arrives through `update(device, kv_fraction)`."""

    DEFAULT_CSS = "VramBar { height: 2; }"
    device: reactive[DeviceMemory | None] = reactive(None, layout=False)
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
            bar.append("█" * cells, style=SEGMENT_STYLES[label][0])
        legend = Text()
        for label, size in segments:
            if size <= 0 and label not in ("kv used", "kv free"):
                continue
            style, key = SEGMENT_STYLES[label]
            legend.append("■", style=style)
            legend.append(f"{key} {gib(size)} ")
        return Text("\n").join([bar, legend])
