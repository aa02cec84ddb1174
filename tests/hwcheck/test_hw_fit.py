"""Build wizard rules against worked examples (numbers in the messages are hand-checked)."""

from __future__ import annotations

from homelab_llm.hwcheck.fit import (Board, Build, Card, Case, Placement, Psu, Slot, allreduce_seconds,
                                     check_build, check_lanes, check_physical, check_power, overall,
                                     thickness_from_mm)

BOARD = Board("test-x670e", "Test X670E", (
    Slot("PCIE1", 1, 16, 16, 5, "cpu", shared_width=8, shares_with=("PCIE3", "PCIE5")),
    Slot("PCIE3", 3, 16, 8, 5, "cpu"),
    Slot("PCIE5", 5, 16, 8, 5, "cpu"),
    Slot("PCIE7", 7, 16, 4, 4, "chipset"),
    Slot("PCIE_X1", 2, 1, 1, 4, "chipset"),
))
CASE = Case("tower", "Test Tower", expansion_slots=8, max_gpu_length_mm=400, vertical_mount_slots=3)
BIG_PSU = Psu("1600", "Test 1600 W", 1600, {"pcie_8pin": 6, "12v_2x6": 2})
XTX_NITRO = Card("nitro", "7900 XTX Nitro+", 320, 3.5, 420, {"pcie_8pin": 3})
RTX_5090 = Card("5090", "RTX 5090 FE", 304, 2, 575, {"12v_2x6": 1}, transient_class=True)
RTX_4090 = Card("4090", "RTX 4090 FE", 304, 3, 450, {"12v_2x6": 1}, transient_class=True)


def build(*placements: Placement, psu: Psu = BIG_PSU, case: Case = CASE, cpu: int = 170) -> Build:
    return Build(BOARD, case, psu, tuple(placements), cpu)


def test_two_3_5_slot_cards_two_apart_do_not_fit_and_a_riser_is_suggested() -> None:
    verdicts = check_physical(build(Placement(XTX_NITRO, "PCIE1"), Placement(XTX_NITRO, "PCIE3")))
    (fail,) = [v for v in verdicts if v.status == "fail"]
    assert "covers positions 1-4" in fail.reason and "is 2 below it, needs 4" in fail.reason
    assert any("riser" in s for s in fail.suggestions)
    assert any("PCIE1 and PCIE5 (positions 1 and 5) fit" in s for s in fail.suggestions)


def test_two_3_5_slot_cards_four_apart_fit() -> None:
    verdicts = check_physical(build(Placement(XTX_NITRO, "PCIE1"), Placement(XTX_NITRO, "PCIE5")))
    assert [v.status for v in verdicts] == ["pass"]


def test_card_hanging_below_the_last_case_slot() -> None:
    # position 7 + ceil(3.5) - 1 = 10 > 8 case slots
    verdicts = check_physical(build(Placement(XTX_NITRO, "PCIE7")))
    (fail,) = [v for v in verdicts if v.status == "fail"]
    assert "needs expansion slots 7-10; Test Tower has 8" in fail.reason


def test_length_physical_width_and_unknown_slot() -> None:
    long_card = Card("long", "Long card", 395, 2, 300, {"pcie_8pin": 2})
    too_long = Card("huge", "Huge card", 410, 2, 300, {"pcie_8pin": 2})
    v = check_physical(build(Placement(long_card, "PCIE1")))
    assert v[0].status == "warn" and "under 10 mm" in v[0].reason
    v = check_physical(build(Placement(too_long, "PCIE1"), Placement(long_card, "PCIE_X1"),
                             Placement(long_card, "NOPE")))
    reasons = " | ".join(x.reason for x in v if x.status == "fail")
    assert "410 mm long; Test Tower takes 400 mm" in reasons
    assert "PCIE_X1 is physically x1" in reasons
    assert "no slot 'NOPE'" in reasons


def test_riser_skips_slot_geometry() -> None:
    v = check_physical(build(Placement(XTX_NITRO, "PCIE1"), Placement(XTX_NITRO, "PCIE3", riser=True)))
    assert [x.status for x in v] == ["pass"]


def test_cpu_lanes_x8_x8_are_fine_for_tp() -> None:
    (v,) = check_lanes(build(Placement(XTX_NITRO, "PCIE1"), Placement(XTX_NITRO, "PCIE5")))
    assert v.status == "pass" and "PCIE1 x8, PCIE5 x8" in v.reason  # bifurcated


def test_chipset_x4_warns_with_traffic_numbers_and_alternatives() -> None:
    (v,) = check_lanes(build(Placement(RTX_4090, "PCIE1"), Placement(RTX_4090, "PCIE7")))
    assert v.status == "warn"
    # 8192 tokens x 5120 hidden x 2 bytes x 2 all-reduces x 64 layers = 10.7 GB
    assert "~10.7 GB" in v.reason and "Gen4 x4 (~7.9 GB/s)" in v.reason
    assert "~1.4 s here vs ~0.7 s at Gen4 x8" in v.reason
    assert "chipset uplink" in v.reason
    assert v.suggestions[0] == "move it to PCIE3, PCIE5 (CPU lanes)"
    assert any("riser" in s for s in v.suggestions) and any("layers" in s for s in v.suggestions)
    assert abs(allreduce_seconds(7.876) - 1.363) < 0.01


def test_5090_plus_4090_on_850w_fails_with_the_numbers() -> None:
    psu = Psu("850", "Test 850 W", 850, {"pcie_8pin": 4, "12v_2x6": 1})
    verdicts = check_power(build(Placement(RTX_5090, "PCIE1"), Placement(RTX_4090, "PCIE5"), psu=psu))
    watts = verdicts[0]
    assert watts.status == "fail"
    # 575 + 450 + 170 + 100 = 1295 W steady; x1.3 = 1683.5 -> 1684 W
    assert "575 W + 450 W + CPU 170 W + rest 100 W = 1295 W, over the 850 W PSU" in watts.reason
    assert "needs 1684 W" in watts.reason
    assert any("2000 W" in s for s in watts.suggestions)
    connectors = verdicts[1]
    # one native 12V-2x6 goes to the 5090; the 4090 needs a 3x 8-pin adapter: 3 <= 4, a warning
    assert connectors.status == "warn" and "RTX 4090 FE through an 8-pin adapter" in connectors.reason


def test_transient_headroom_alone_can_fail() -> None:
    psu = Psu("1300", "Test 1300 W", 1300, {"12v_2x6": 2})
    (watts, connectors) = check_power(build(Placement(RTX_5090, "PCIE1"),
                                            Placement(RTX_4090, "PCIE5"), psu=psu))
    assert watts.status == "fail" and "fits the 1300 W PSU at steady load" in watts.reason
    assert connectors.status == "pass"


def test_not_enough_8_pin_plugs() -> None:
    psu = Psu("1000", "Test 1000 W", 1000, {"pcie_8pin": 4})
    (_, connectors) = check_power(build(Placement(XTX_NITRO, "PCIE1"), Placement(XTX_NITRO, "PCIE5"),
                                        psu=psu, cpu=120))
    assert connectors.status == "fail" and "6 x 8-pin needed" in connectors.reason


def test_a_good_build_passes_overall() -> None:
    verdicts = check_build(build(Placement(XTX_NITRO, "PCIE1"), Placement(XTX_NITRO, "PCIE5")))
    assert overall(verdicts) == "pass", verdicts
    assert any(v.rule == "suggestions" and "vertical GPU mount" in v.reason for v in verdicts)


def test_thickness_from_mm_uses_the_slot_pitch() -> None:
    assert thickness_from_mm(71.6) == 3.52
    # 61 mm (4090 FE) is 3.002 slot pitches: rounding to 0.01 keeps it a 3-slot card
    assert Card("x", "x", 300, thickness_from_mm(61.0), 300).slots_covered == 3
    assert Card("x", "x", 300, thickness_from_mm(62.0), 300).slots_covered == 4  # 3.05
