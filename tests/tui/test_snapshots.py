"""Snapshot tests (pytest-textual-snapshot): each screen at 80x24, the dashboard also at 120x40 and 160x48 (side by side),
from recorded data, a fixed clock and no live pollers, so the SVGs are identical every run.
Update them with `pytest tests/tui/test_snapshots.py --snapshot-update` after a deliberate change."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.pilot import Pilot
from textual.widgets import Input

from homelab_llm.tui.app import HomelabApp
from homelab_llm.tui.probe import CounterRates, snapshot_from_metrics
from homelab_llm.tui.prometheus import parse_prometheus
from homelab_llm.tui.service import ServiceManager
from tui_fakes import FIXED_TELEMETRY, FIXTURES, FakeHost, FakeProbe, FakeTelemetry, load_hardware, load_status

pytestmark = pytest.mark.timeout(120)

# A fixed minute of history so the charts have a shape (tok/s, oldest first, 2 samples a
# second): bursts of prompt processing while generation runs near a steady rate.
KEY_PROMPT = [0, 0, 1800, 3900, 4200, 2600, 900, 0, 0, 3100, 4800, 4400, 2874]
KEY_GEN = [0, 12, 48, 90, 101, 99, 97, 60, 31, 70, 96, 97, 96.3]


def stretched(points: list[float], n: int = 120) -> list[float]:
    """Linear interpolation of the key points to n samples (the app keeps 120)."""
    out = []
    for i in range(n):
        x = i * (len(points) - 1) / (n - 1)
        lo = int(x)
        hi = min(lo + 1, len(points) - 1)
        out.append(round(points[lo] + (points[hi] - points[lo]) * (x - lo), 1))
    return out


PROMPT_HISTORY = stretched(KEY_PROMPT)
GEN_HISTORY = stretched(KEY_GEN)


def recorded_app(snapshot=None, **kw) -> HomelabApp:
    service = ServiceManager()
    service.logs.extend(["$ python -m homelab_llm serve model.gguf --port 8000",
                         "INFO loading weights: 8.4 GiB", "INFO KV cache: 425984 tokens (int8)",
                         "INFO Uvicorn running on http://127.0.0.1:8000"])
    options = dict(service=service, probe_factory=FakeProbe([snapshot or load_status()]),
                   watch_url="http://127.0.0.1:8000", hardware_source=load_hardware,
                   telemetry=FakeTelemetry(FIXED_TELEMETRY), clock=lambda: 1000.0,
                   poll_interval_s=3600.0, host=FakeHost())  # one poll: nothing changes while drawing
    app = HomelabApp(**{**options, **kw})
    app.prompt_history.extend(PROMPT_HISTORY)
    app.generation_history.extend(GEN_HISTORY)
    return app


async def settle(pilot: Pilot) -> None:
    app = pilot.app
    for _ in range(100):
        if app.snapshot.ok and not app.hardware_pending and app.telemetry:
            break
        await pilot.pause(0.02)
    for box in app.screen.query(Input):  # a focused box's blinking cursor would make shots differ
        box.cursor_blink = False
    await pilot.pause(0.1)


@pytest.mark.parametrize("size", [(80, 24), (120, 40), (160, 48)])
def test_dashboard(snap_compare, size: tuple[int, int]) -> None:
    assert snap_compare(recorded_app(), terminal_size=size, run_before=settle)


def test_dashboard_hybrid_model_state_slice(snap_compare) -> None:
    """A hybrid (Gated DeltaNet) model: the VRAM bars show recurrent state as their own slice."""
    hybrid = load_status("status_dual_gpu_hybrid.json")
    assert snap_compare(recorded_app(hybrid), terminal_size=(120, 40), run_before=settle)


def test_dashboard_vllm_child(snap_compare) -> None:
    vllm = snapshot_from_metrics(parse_prometheus((FIXTURES / "vllm_metrics.txt").read_text()),
                                 CounterRates(), now=1.0)
    assert snap_compare(recorded_app(vllm), terminal_size=(80, 24), run_before=settle)


@pytest.mark.parametrize("mode", ["presets", "hardware", "logs"])
def test_screens(snap_compare, mode: str) -> None:
    assert snap_compare(recorded_app(start_mode=mode), terminal_size=(80, 24), run_before=settle)


def test_help(snap_compare) -> None:
    async def run_before(pilot: Pilot) -> None:
        await settle(pilot)
        await pilot.press("f1")

    assert snap_compare(recorded_app(), terminal_size=(80, 24), run_before=run_before)


def test_editor_with_invalid_input(snap_compare, user_presets: Path) -> None:
    async def run_before(pilot: Pilot) -> None:
        await settle(pilot)
        await pilot.press("e")
        pilot.app.screen.query_one("#f-port").value = "99999"
        await pilot.pause(0.1)

    assert snap_compare(recorded_app(start_mode="presets"), terminal_size=(80, 24),
                        run_before=run_before)


def test_bench_results(snap_compare) -> None:
    """A finished depth sweep (recorded numbers): the form, the table and the bars at 80x24."""
    from tui_fakes import depth_report

    async def run_before(pilot: Pilot) -> None:
        await settle(pilot)
        pilot.app.screen.show_report(depth_report())
        await pilot.pause(0.1)

    assert snap_compare(recorded_app(start_mode="bench"), terminal_size=(80, 24),
                        run_before=run_before)


def test_build_wizard_verdict(snap_compare) -> None:
    """RTX 5090 + RTX 4090 on an 850 W PSU: the verdict step with every rule's reason."""
    from homelab_llm.assets import assets_dir
    from homelab_llm.hwcheck.catalog import load_catalog

    async def run_before(pilot: Pilot) -> None:
        await settle(pilot)
        await pilot.press("w")
        wizard = pilot.app.screen.query_one("#hw-wizard")
        wizard.query_one("#w-card1-gpu").value = "rtx-5090-fe"
        wizard.query_one("#w-card2-gpu").value = "rtx-4090-fe"
        wizard.query_one("#w-psu").value = "corsair-rm850x-2021"
        await pilot.pause()
        for _ in range(4):
            await pilot.press("ctrl+n")
        pilot.app.set_focus(None)
        await pilot.pause(0.1)

    app = recorded_app(start_mode="hardware",
                       catalog_loader=lambda: load_catalog([assets_dir() / "hardware"]))
    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


def test_hardware_from_sysfs_fixture(snap_compare) -> None:
    """`tui --sysfs-root` on the AM5 chipset fixture: hwcheck's matrix and tree, the warnings,
    and a minute of (recorded) GPU and host history."""
    from homelab_llm.tui.hardware import collect_hardware_report

    root = str(Path(__file__).parents[1] / "hwcheck" / "fixtures" / "am5_chipset_x4")
    app = recorded_app(start_mode="hardware", hardware_source=lambda: collect_hardware_report(root))
    for address, scale in (("0000:03:00.0", 1.0), ("0000:0c:00.0", 0.9)):
        for key, top in (("load", 100), ("vram", 20 << 30), ("power", 330), ("temp", 75)):
            for value in stretched([v * top / 101 * scale for v in KEY_GEN]):
                app.history.add(f"gpu/{address}/{key}", value)
    for key, top in (("cpu", 60), ("ram", 14 << 30), ("child_cpu", 200), ("child_rss", 3 << 30)):
        for value in stretched([v * top / 101 for v in KEY_GEN]):
            app.history.add(f"host/{key}", value)
    assert snap_compare(app, terminal_size=(120, 40), run_before=settle)
