"""The dashboard's engine stats show total and active parameters when /v1/status reports them."""

from __future__ import annotations

from rich.console import Console

from homelab_llm.tui.snapshot import ServerSnapshot
from homelab_llm.tui.widgets.engine_stats import stats_table


def _render(config: dict) -> str:
    console = Console(width=120, record=True)
    console.print(stats_table(ServerSnapshot(source="status", ok=True, config=config)))
    return console.export_text()


def test_moe_shows_active_parameters() -> None:
    text = _render({"parameters": 30_532_122_624, "active_parameters": 3_353_032_704})
    assert "30.5B · 3.4B active per token" in text


def test_dense_shows_the_total_and_other_servers_nothing() -> None:
    assert "8.0B" in _render({"parameters": 8_030_261_248, "active_parameters": 8_030_261_248})
    assert "Params" not in _render({})
