"""The build wizard's rules: will these cards fit, are the lanes good enough for tensor
parallelism, is the PSU enough. Each rule returns verdicts with the numbers behind them.

Conventions: slot positions count expansion-slot positions from the top of the board (1-based),
20.32 mm apart (the ATX pitch). A card T slots thick in position i covers positions
i .. i + ceil(T) - 1, so a card below it needs a slot at least ceil(T) positions further down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SLOT_PITCH_MM = 20.32
LENGTH_MARGIN_MM = 10  # closer than this to the case limit: cables and fans usually collide
REST_OF_SYSTEM_W = 100  # board, RAM, drives, fans, pump
TRANSIENT_HEADROOM = 0.30  # 4090/5090-class cards spike well above their rated power for ~ms
WATTS_PER_8PIN = 150
# Reference model for the all-reduce traffic estimate: a 27B-class dense model in bf16.
REF_HIDDEN, REF_LAYERS, REF_PREFILL_TOKENS = 5120, 64, 8192
GBPS_PER_LANE = {3: 0.985, 4: 1.969, 5: 3.938}


@dataclass(frozen=True)
class Slot:
    name: str
    position: int
    physical_width: int
    electrical_width: int
    gen: int
    lanes: str  # cpu | chipset
    shared_width: int | None = None  # width when a slot in `shares_with` is populated (x8/x8)
    shares_with: tuple[str, ...] = ()
    open_ended: bool = False


@dataclass(frozen=True)
class Board:
    id: str
    name: str
    slots: tuple[Slot, ...]
    form_factor: str = "ATX"

    def slot(self, name: str) -> Slot | None:
        return next((s for s in self.slots if s.name == name), None)


@dataclass(frozen=True)
class Case:
    id: str
    name: str
    expansion_slots: int
    max_gpu_length_mm: float
    vertical_mount_slots: int = 0  # 0: no vertical GPU bracket


@dataclass(frozen=True)
class Card:
    id: str
    name: str
    length_mm: float
    thickness_slots: float
    tdp_w: int
    power_connectors: dict[str, int] = field(default_factory=dict)  # pcie_8pin | 12v_2x6 | 12pin
    transient_class: bool = False  # 4090/5090-class power excursions
    vendor: str = ""
    vram_gib: int = 0

    @property
    def slots_covered(self) -> int:
        return math.ceil(self.thickness_slots - 1e-6)


@dataclass(frozen=True)
class Psu:
    id: str
    name: str
    watts: int
    connectors: dict[str, int] = field(default_factory=dict)  # pcie_8pin, 12v_2x6


@dataclass(frozen=True)
class Placement:
    card: Card
    slot: str
    riser: bool = False  # card mounted on a riser / vertical bracket, fed by `slot`


@dataclass(frozen=True)
class Build:
    board: Board
    case: Case
    psu: Psu
    placements: tuple[Placement, ...]
    cpu_watts: int = 120


@dataclass(frozen=True)
class Verdict:
    rule: str  # physical | lanes | power | suggestions
    status: str  # pass | warn | fail | info
    reason: str
    suggestions: tuple[str, ...] = ()


def thickness_from_mm(mm: float) -> float:
    return round(mm / SLOT_PITCH_MM, 2)


def slot_width(board: Board, slot: Slot, used: set[str]) -> int:
    if slot.shared_width is not None and used & set(slot.shares_with):
        return slot.shared_width
    return slot.electrical_width


def _fitting_pairs(board: Board, top_card: Card) -> list[tuple[Slot, Slot]]:
    x16 = sorted((s for s in board.slots if s.physical_width >= 16 or s.open_ended),
                 key=lambda s: s.position)
    return [(a, b) for i, a in enumerate(x16) for b in x16[i + 1:]
            if b.position - a.position >= top_card.slots_covered]


def check_physical(build: Build) -> list[Verdict]:
    out: list[Verdict] = []
    mounted = [p for p in build.placements if not p.riser]
    positions: dict[str, int] = {}
    for p in build.placements:
        slot = build.board.slot(p.slot)
        if slot is None:
            names = ", ".join(s.name for s in build.board.slots)
            out.append(Verdict("physical", "fail", f"{build.board.name} has no slot {p.slot!r} "
                               f"(slots: {names})"))
            continue
        positions[p.slot] = slot.position
        card = p.card
        if card.length_mm > build.case.max_gpu_length_mm:
            out.append(Verdict("physical", "fail", f"{card.name} is {card.length_mm:g} mm long; "
                               f"{build.case.name} takes {build.case.max_gpu_length_mm:g} mm"))
        elif card.length_mm > build.case.max_gpu_length_mm - LENGTH_MARGIN_MM:
            out.append(Verdict("physical", "warn", f"{card.name} ({card.length_mm:g} mm) leaves under "
                               f"{LENGTH_MARGIN_MM} mm to {build.case.name}'s "
                               f"{build.case.max_gpu_length_mm:g} mm limit: check front fans/radiator"))
        if p.riser:
            continue
        if slot.physical_width < 16 and not slot.open_ended:
            out.append(Verdict("physical", "fail", f"{p.slot} is physically x{slot.physical_width}; "
                               f"{card.name} needs an x16 slot", ("use a riser from this slot",)))
        last = slot.position + card.slots_covered - 1
        if last > build.case.expansion_slots:
            out.append(Verdict("physical", "fail", f"{card.name} ({card.thickness_slots:g} slots) in "
                               f"{p.slot} (position {slot.position}) needs expansion slots "
                               f"{slot.position}-{last}; {build.case.name} has "
                               f"{build.case.expansion_slots}",
                               ("move it to a higher slot", "use a case with "
                                f"{last} or more expansion slots", "vertical mount on a riser")))
    for upper in mounted:
        for lower in mounted:
            if upper is lower or upper.slot not in positions or lower.slot not in positions:
                continue
            gap = positions[lower.slot] - positions[upper.slot]
            need = upper.card.slots_covered
            if 0 < gap < need:
                pairs = _fitting_pairs(build.board, upper.card)
                alternatives = tuple(f"slots {a.name} and {b.name} (positions {a.position} and "
                                     f"{b.position}) fit" for a, b in pairs[:2])
                out.append(Verdict(
                    "physical", "fail",
                    f"{upper.card.name} ({upper.card.thickness_slots:g} slots) in {upper.slot} "
                    f"covers positions {positions[upper.slot]}-{positions[upper.slot] + need - 1}; "
                    f"{lower.slot} at position {positions[lower.slot]} is {gap} below it, "
                    f"needs {need}",
                    alternatives + (f"put {lower.card.name} on a riser (vertical mount or a "
                                    "bracket below the board)",)))
    if not out:
        out.append(Verdict("physical", "pass", "every card fits its slot, the case length and "
                           "the case's expansion slots"))
    return out


def allreduce_seconds(gbps: float, tokens: int = REF_PREFILL_TOKENS) -> float:
    """Time to move TP=2 all-reduce traffic for one prefill (bf16, 2 all-reduces per layer)."""
    return tokens * REF_HIDDEN * 2 * 2 * REF_LAYERS / (gbps * 1e9)


def check_lanes(build: Build) -> list[Verdict]:
    used = {p.slot for p in build.placements}
    slots = [(p, build.board.slot(p.slot)) for p in build.placements]
    known = [(p, s) for p, s in slots if s is not None]
    if len(known) < 2:
        return [Verdict("lanes", "pass", "one GPU: lanes only affect model loading time")]
    out: list[Verdict] = []
    free_cpu = [s for s in build.board.slots if s.name not in used and s.lanes == "cpu"
                and (s.physical_width >= 16 or s.open_ended)]
    move = (f"move it to {', '.join(s.name for s in free_cpu)} (CPU lanes)" if free_cpu
            else "use another CPU-lane slot (x8/x8 bifurcation)")
    for p, s in known:
        width = slot_width(build.board, s, used)
        gbps = GBPS_PER_LANE.get(s.gen, 1.0) * width
        t = allreduce_seconds(gbps)
        if s.lanes == "chipset" or width < 8:
            where = "chipset" if s.lanes == "chipset" else "CPU"
            out.append(Verdict(
                "lanes", "warn",
                f"{p.card.name} in {p.slot}: {where} lanes at Gen{s.gen} x{width} (~{gbps:.1f} GB/s). "
                f"Prefill all-reduce for an {REF_PREFILL_TOKENS}-token prompt on a 27B-class model "
                f"moves ~{REF_PREFILL_TOKENS * REF_HIDDEN * 4 * REF_LAYERS / 1e9:.1f} GB: ~{t:.1f} s "
                f"here vs ~{allreduce_seconds(GBPS_PER_LANE[4] * 8):.1f} s at Gen4 x8"
                + (", sharing the chipset uplink with USB/SATA/NVMe" if s.lanes == "chipset" else ""),
                (move, "a riser from a CPU slot",
                 "split by layers instead of tensor parallelism")))
    if not out:
        widths = ", ".join(f"{p.slot} x{slot_width(build.board, s, used)}" for p, s in known)
        out.append(Verdict("lanes", "pass", f"all GPUs on CPU lanes at x8 or more ({widths}): "
                           "fine for tensor parallelism"))
    return out


def adapter_8pins(card: Card) -> int:
    """8-pin plugs an adapter needs to feed this card's 16-pin (or 3090 FE 12-pin) connector."""
    return min(4, max(2, math.ceil(card.tdp_w / WATTS_PER_8PIN)))


def check_power(build: Build) -> list[Verdict]:
    out: list[Verdict] = []
    cards = [p.card for p in build.placements]
    gpu_w = sum(c.tdp_w for c in cards)
    steady = gpu_w + build.cpu_watts + REST_OF_SYSTEM_W
    spiky = [c.name for c in cards if c.transient_class]
    need = math.ceil(steady * (1 + TRANSIENT_HEADROOM)) if spiky else steady
    parts = " + ".join(f"{c.tdp_w} W" for c in cards)
    sums = f"GPUs {parts} + CPU {build.cpu_watts} W + rest {REST_OF_SYSTEM_W} W = {steady} W"
    if build.psu.watts < steady:
        out.append(Verdict("power", "fail", f"{sums}, over the {build.psu.watts} W PSU"
                           + (f"; with {TRANSIENT_HEADROOM:.0%} transient headroom for "
                              f"{', '.join(spiky)} it needs {need} W" if spiky else ""),
                           (f"a {_round_up_psu(need)} W PSU", "power-limit the GPUs "
                            "(nvidia-smi -pl / rocm-smi --setpoweroverdrive)")))
    elif build.psu.watts < need:
        out.append(Verdict("power", "fail", f"{sums}: fits the {build.psu.watts} W PSU at steady "
                           f"load, but {', '.join(spiky)} need {TRANSIENT_HEADROOM:.0%} headroom for "
                           f"transients: {need} W", (f"a {_round_up_psu(need)} W PSU",
                                                     "power-limit the GPUs")))
    else:
        out.append(Verdict("power", "pass", f"{sums}; the {build.psu.watts} W PSU leaves "
                           f"{(build.psu.watts / steady - 1):.0%} headroom"))
    out += _check_connectors(build, cards)
    return out


def _check_connectors(build: Build, cards: list[Card]) -> list[Verdict]:
    have_8 = build.psu.connectors.get("pcie_8pin", 0)
    have_16 = build.psu.connectors.get("12v_2x6", 0)
    need_8 = sum(c.power_connectors.get("pcie_8pin", 0) for c in cards)
    need_16 = sum(c.power_connectors.get("12v_2x6", 0) for c in cards)
    adapters = [c for c in cards if c.power_connectors.get("12pin", 0)]
    short_16 = max(need_16 - have_16, 0)
    # 16-pin cards the PSU cannot feed natively go through an 8-pin adapter (lowest power first:
    # the native cables go to the hungriest cards)
    spill = sorted((c for c in cards if c.power_connectors.get("12v_2x6", 0)),
                   key=lambda c: c.tdp_w)[:short_16]
    via_adapter = spill + adapters
    need_8_total = need_8 + sum(adapter_8pins(c) for c in via_adapter)
    text = (f"cards need {need_8} x 8-pin and {need_16} x 12V-2x6; the PSU has {have_8} x 8-pin "
            f"and {have_16} x 12V-2x6")
    if need_8_total > have_8:
        via = " counting 16-pin adapters" if via_adapter else ""
        return [Verdict("power", "fail", f"{text}: {need_8_total} x 8-pin needed{via}",
                        ("a PSU with more PCIe cables or native 12V-2x6 connectors",))]
    if via_adapter:
        names = ", ".join(c.name for c in via_adapter)
        return [Verdict("power", "warn", f"{text}: {names} through an 8-pin adapter "
                        f"({need_8_total} x 8-pin in all)", ("one PSU cable per adapter plug, no "
                                                             "daisy-chained pigtails",))]
    return [Verdict("power", "pass", f"{text}: enough")]


def _round_up_psu(watts: int) -> int:
    sizes = (750, 850, 1000, 1200, 1300, 1500, 1600, 2000)
    return next((s for s in sizes if s >= watts), watts)


def suggestions(build: Build) -> list[Verdict]:
    out: list[Verdict] = []
    for p in build.placements:
        slot = build.board.slot(p.slot)
        if p.riser and slot is not None:
            tip = (f"{p.card.name} on a riser from {p.slot}: use a riser rated for PCIe "
                   f"{min(slot.gen, 4)}.0 or better and as short as the case allows")
            if slot.gen >= 5:
                tip += "; with a Gen4 riser set the slot to Gen4 in the BIOS to avoid link errors"
            if build.case.vertical_mount_slots and build.case.vertical_mount_slots < p.card.slots_covered:
                tip += (f"; {build.case.name}'s vertical bracket has {build.case.vertical_mount_slots} "
                        f"slots, the card needs {p.card.slots_covered}")
            out.append(Verdict("suggestions", "info", tip))
    if len(build.placements) >= 2 and build.case.vertical_mount_slots and not any(
            p.riser for p in build.placements):
        out.append(Verdict("suggestions", "info", f"{build.case.name} has a vertical GPU mount: a "
                           "quality riser there frees a slot position for airflow"))
    return out


def check_build(build: Build) -> list[Verdict]:
    return check_physical(build) + check_lanes(build) + check_power(build) + suggestions(build)


def overall(verdicts: list[Verdict]) -> str:
    statuses = {v.status for v in verdicts}
    return "fail" if "fail" in statuses else "warn" if "warn" in statuses else "pass"
