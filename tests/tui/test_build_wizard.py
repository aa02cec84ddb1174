"""Build wizard on the Hardware screen: the form's parsing, and the hwcheck worked examples driven
through the UI (two 3.5-slot cards 2 positions apart: no fit and a riser suggestion; 4 apart: fit;
an RTX 5090 + 4090 on an 850 W PSU: fails with the numbers)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from textual.widgets import Checkbox, Input, Select, Static, TabbedContent

from homelab_llm.hwcheck.catalog import load_catalog
from homelab_llm.tui.app import HomelabApp
from homelab_llm.tui.build_form import CUSTOM, BuildChoices, CardChoice, parse_slots, resolve
from homelab_llm.tui.widgets.build_wizard import BuildWizard
from tui_fakes import FakeProbe, FakeTelemetry, load_hardware, load_status

pytestmark = pytest.mark.timeout(60)

# The worked examples' board (tests/hwcheck/test_hw_fit.py), typed into the custom board field.
TEST_BOARD = "1 x16 gen5 cpu, 3 x8 gen5 cpu, 5 x8 gen5 cpu, 7 x4 gen4 chipset"
NITRO = "sapphire-nitro-plus-7900xtx"  # 3.5 slots in the catalog


def shipped_catalog():
    from homelab_llm.assets import assets_dir

    return load_catalog([assets_dir() / "hardware"])  # not the user's own entries


# ---------------------------------------------------------------------------- form rules

def test_custom_slots_parse_and_explain() -> None:
    slots = parse_slots("3 x8, 1 x16 gen5 cpu, 7 x4 gen4 chipset")
    assert [(s.name, s.position, s.electrical_width, s.gen, s.lanes) for s in slots] == [
        ("slot1", 1, 16, 5, "cpu"), ("slot3", 3, 8, 4, "cpu"), ("slot7", 7, 4, 4, "chipset")]
    for text, message in (("", "at least one slot"), ("x16 gen5", "needs a slot position"),
                          ("1 x3", "width x1-x16"), ("1, 1 x8", "two slots at position 1"),
                          ("1 pcie", "'pcie' in '1 pcie'")):
        with pytest.raises(ValueError, match=message):
            parse_slots(text)


def test_custom_values_are_checked_per_field() -> None:
    choices = BuildChoices(psu=CUSTOM, psu_watts="lots", cpu_watts="-5", cards=[
        CardChoice(gpu=CUSTOM, slot="PCIEX16_1", length_mm="0", thickness_slots="2.5",
                   tdp_w="300", pcie_8pin="two")])
    build, issues = resolve(choices, shipped_catalog())
    assert build is None
    assert {i.field: i.message for i in issues} == {
        "card1-length_mm": "must be above 0, got 0",
        "card1-pcie_8pin": "'two' is not a whole number",
        "psu-watts": "'lots' is not a whole number (W)",
        "cpu_watts": "must be at least 0, got -5",
    }


# ---------------------------------------------------------------------------- pilot

def hw_app() -> HomelabApp:
    return HomelabApp(probe_factory=FakeProbe([load_status()]), watch_url="http://recorded:8000",
                      hardware_source=load_hardware, telemetry=FakeTelemetry(),
                      clock=lambda: 1000.0, poll_interval_s=3600.0, start_mode="hardware",
                      catalog_loader=shipped_catalog)


def fill(wizard: BuildWizard, **values: object) -> None:
    for name, value in values.items():
        widget = wizard.query_one(f"#w-{name.replace('__', '-')}")
        assert isinstance(widget, (Input, Select, Checkbox))
        widget.value = value


def verdict_text(wizard: BuildWizard) -> str:
    console = Console(width=100, file=io.StringIO(), record=True)
    console.print(wizard.query_one("#w-verdict", Static).content)
    return " ".join(console.export_text().split())  # wrapped lines joined


async def open_wizard(pilot) -> BuildWizard:
    await pilot.press("w")
    await pilot.pause()
    return pilot.app.screen.query_one(BuildWizard)


@pytest.mark.parametrize("lower_slot, fits", [("slot3", False), ("slot5", True)])
async def test_two_3_5_slot_cards(lower_slot: str, fits: bool) -> None:
    app = hw_app()
    async with app.run_test(size=(100, 40)) as pilot:
        wizard = await open_wizard(pilot)
        fill(wizard, board=CUSTOM)
        await pilot.pause()
        fill(wizard, board__slots=TEST_BOARD, case="fractal-define-7-xl")
        await pilot.pause()
        fill(wizard, card1__gpu=NITRO, card2__gpu=NITRO)
        await pilot.pause()
        fill(wizard, card1__slot="slot1", card2__slot=lower_slot)
        await pilot.pause()
        physical = [v for v in wizard.verdicts if v.rule == "physical"]
        text = verdict_text(wizard)
        if fits:
            assert [v.status for v in physical] == ["pass"]
            assert "✓ physical every card fits its slot" in text
        else:
            (fail,) = physical
            assert fail.status == "fail"
            assert "covers positions 1-4; slot3 at position 3 is 2 below it, needs 4" in text
            assert "→ slots slot1 and slot5 (positions 1 and 5) fit" in text
            assert "riser" in fail.suggestions[-1] and fail.suggestions[-1] in text
            assert "✗ this build does not work as chosen" in text
        summary = str(wizard.query_one("#w-summary", Static).content)
        assert summary.startswith("✓ physical" if fits else "✗ physical")


async def test_5090_and_4090_on_an_850w_psu_fail_with_the_numbers() -> None:
    app = hw_app()
    async with app.run_test(size=(80, 24)) as pilot:
        wizard = await open_wizard(pilot)
        fill(wizard, card1__gpu="rtx-5090-fe", card2__gpu="rtx-4090-fe",
             psu="corsair-rm850x-2021", cpu_watts="170")
        await pilot.pause()
        # walk the steps with the keys: board -> case -> cards -> PSU -> verdict
        for _ in range(4):
            await pilot.press("ctrl+n")
        assert wizard.query_one(TabbedContent).active == "step-verdict"
        text = verdict_text(wizard)
        assert "GPUs 575 W + 450 W + CPU 170 W + rest 100 W = 1295 W, over the 850 W PSU" in text
        assert "it needs 1684 W" in text and "→ a 2000 W PSU" in text
        # no native 16-pin on this PSU: both cards through adapters, 4 + 3 plugs > 4
        assert "7 x 8-pin needed counting 16-pin adapters" in text
        await pilot.press("ctrl+b")
        assert wizard.query_one(TabbedContent).active == "step-psu"


async def test_invalid_custom_card_is_marked_and_blocks_the_verdict() -> None:
    app = hw_app()
    async with app.run_test(size=(80, 24)) as pilot:
        wizard = await open_wizard(pilot)
        fill(wizard, card2__gpu=CUSTOM)
        await pilot.pause()
        assert wizard.query_one("#w-card2-custom").display
        fill(wizard, card2__thickness_slots="thick")
        await pilot.pause()
        assert wizard.query_one("#w-card2-thickness_slots").has_class("-invalid")
        assert "card2-thickness_slots: 'thick' is not a number (slots)" in str(
            wizard.query_one("#w-issues", Static).content)
        assert wizard.build is None and "fix the values" in verdict_text(wizard)
        fill(wizard, card2__thickness_slots="2")
        await pilot.pause()
        assert wizard.build is not None and not wizard.query(".-invalid")
        await pilot.press("w")  # back to this PC
        assert app.screen.query_one("#hw-views").current == "hw-body"


async def test_changing_the_board_moves_cards_to_its_slots() -> None:
    app = hw_app()
    async with app.run_test(size=(80, 24)) as pilot:
        wizard = await open_wizard(pilot)
        fill(wizard, board="gigabyte-b650-aorus-elite-ax")
        await pilot.pause()
        assert [c.slot for c in wizard.read_choices().cards] == ["PCIEX16", "PCIEX4"]
        lanes = [v for v in wizard.verdicts if v.rule == "lanes"]
        assert lanes[0].status == "warn" and "chipset lanes at Gen4 x4" in lanes[0].reason
        fill(wizard, cards=1)
        await pilot.pause()
        assert not wizard.query_one("#w-card2").display and len(wizard.build.placements) == 1


async def test_wizard_saves_a_build_file_hwcheck_reads(user_presets) -> None:
    from homelab_llm.hwcheck.catalog import load_build

    app = hw_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("w")
        await pilot.pause(0.1)
        await pilot.press("ctrl+s")
        await pilot.pause(0.1)
        await pilot.press("ctrl+s")  # a second save never overwrites the first
        await pilot.pause(0.1)
    folder = user_presets.parent / "builds"
    saved = sorted(folder.glob("*.toml"))
    assert [p.name for p in saved] == ["asus-proart-x670e-creator-2.toml",
                                       "asus-proart-x670e-creator.toml"]
    build = load_build(saved[1], shipped_catalog())
    assert build.board.name == "ASUS ProArt X670E-Creator WiFi" and len(build.placements) == 2
