"""The dashboard's pieces on their own: the VRAM legend in words, the state slice of hybrid
models, and the history chart's columns exact to an eighth of a cell."""

from __future__ import annotations

from homelab_llm.tui.probe import snapshot_from_status
from homelab_llm.tui.snapshot import DeviceMemory
from homelab_llm.tui.widgets.history_chart import chart_lines, columns
from homelab_llm.tui.widgets.vram_bar import legend

G = 1 << 30


def test_legend_names_every_slice_in_words_and_wraps_between_entries() -> None:
    device = DeviceMemory("gpu", 24 * G, weights=8 * G, activations=G, graphs=G // 2,
                          kv_cache=10 * G, state=2 * G, other=G, free=G)
    wide = legend(device.segments(0.25), 200).plain
    assert wide == ("■ weights 8.0G  ■ activations 1.0G  ■ graphs 512M  ■ KV used 2.5G  "
                    "■ KV free 7.5G  ■ state 2.0G  ■ other 1.0G  ■ free 1.0G")
    narrow = legend(device.segments(0.25), 40).plain.split("\n")
    assert all(len(line) <= 40 for line in narrow) and len(narrow) == 4
    assert all(not line.startswith(" ") and "■" in line for line in narrow)


def test_state_slice_only_for_hybrids() -> None:
    plain = DeviceMemory("gpu", 4 * G, weights=G, kv_cache=G, free=2 * G)
    assert "state" not in legend(plain.segments(None), 200).plain
    assert "KV used 0M" in legend(plain.segments(None), 200).plain  # KV is always listed
    snap = snapshot_from_status({"devices": [{"name": "gpu", "total": 4 * G, "state": G // 4}],
                                 "latency": {"tpot_p95": 0.05}})
    assert snap.devices[0].state == G // 4 and snap.tpot_p95 == 0.05


def test_history_columns_are_exact_to_an_eighth() -> None:
    assert columns([0, 50, 100, 101], rows=2, top=100) == ["  ", "█ ", "██", "██"]
    assert columns([100 / 8], rows=1, top=100) == ["▁"]
    lines = chart_lines([25, 100], width=4, rows=2, top=100)
    assert lines == ["   █", "  ▄█"]  # newest on the right, empty columns on the left
