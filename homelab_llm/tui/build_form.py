"""The build wizard's form as plain data: catalog picks or custom values, as typed, -> a hwcheck
`Build` to check, or the problems with the custom values, each tied to its field.

Custom entries use the catalog's own units (mm, expansion-slot positions, watts, connector
counts). A custom board is written as its x16-size slots, comma-separated, each
"POSITION [xWIDTH] [genN] [cpu|chipset]", e.g. "1 x16 gen5 cpu, 3 x8 gen5 cpu, 5 x4 gen4 chipset";
the slots are named slot1, slot3, ... after their positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from homelab_llm.hwcheck.catalog import Catalog, CatalogError
from homelab_llm.hwcheck.fit import Board, Build, Card, Case, Placement, Psu, Slot

CUSTOM = "custom"
MAX_CARDS = 4


@dataclass(frozen=True)
class FieldIssue:
    field: str  # the widget id suffix it belongs to, e.g. "card1-length_mm", "board-slots"
    message: str


@dataclass
class CardChoice:
    gpu: str = "amd-7900xtx-reference"  # catalog id or CUSTOM
    slot: str = ""
    riser: bool = False
    # custom values as typed
    length_mm: str = "300"
    thickness_slots: str = "3"
    tdp_w: str = "350"
    pcie_8pin: str = "2"
    pin16: str = "0"  # 12V-2x6 / 12VHPWR plugs
    transient: bool = False


@dataclass
class BuildChoices:
    board: str = "asus-proart-x670e-creator"
    board_slots: str = "1 x16 gen5 cpu, 4 x8 gen5 cpu, 7 x4 gen4 chipset"
    case: str = "fractal-define-7-xl"
    case_expansion_slots: str = "8"
    case_max_gpu_length_mm: str = "400"
    case_vertical_mount_slots: str = "0"
    psu: str = "seasonic-prime-tx-1600-atx3"
    psu_watts: str = "1200"
    psu_pcie_8pin: str = "4"
    psu_pin16: str = "1"
    cpu_watts: str = "120"
    cards: list[CardChoice] = field(default_factory=lambda: [CardChoice(), CardChoice()])


def _number(issues: list[FieldIssue], name: str, text: str, *, minimum: float = 0,
            whole: bool = False, unit: str = "") -> float:
    raw = text.strip()
    try:
        value = float(int(raw)) if whole else float(raw)
    except ValueError:
        kind = "whole number" if whole else "number"
        issues.append(FieldIssue(name, f"{raw or 'nothing'!r} is not a {kind}{unit}"))
        return minimum
    if value < minimum or (minimum == 0 and not whole and value <= 0):
        floor = f"at least {minimum:g}" if minimum or whole else "above 0"
        issues.append(FieldIssue(name, f"must be {floor}, got {value:g}"))
    return value


def parse_slots(text: str) -> list[Slot]:
    """"1 x16 gen5 cpu, 3 x8" -> slots; ValueError naming the bad part."""
    slots: list[Slot] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        position, width, gen, lanes = None, 16, 4, "cpu"
        for word in part.lower().split():
            if word.isdigit():
                position = int(word)
            elif word.startswith("x") and word[1:].isdigit():
                width = int(word[1:])
            elif word.startswith("gen") and word[3:].isdigit():
                gen = int(word[3:])
            elif word in ("cpu", "chipset"):
                lanes = word
            else:
                raise ValueError(f"{word!r} in {part!r}: write POSITION [xWIDTH] [genN] [cpu|chipset]")
        if position is None or position < 1:
            raise ValueError(f"{part!r} needs a slot position (1 = nearest the CPU)")
        if width not in (1, 2, 4, 8, 16) or gen not in (3, 4, 5):
            raise ValueError(f"{part!r}: width x1-x16 and gen3-gen5 only")
        if any(s.position == position for s in slots):
            raise ValueError(f"two slots at position {position}")
        slots.append(Slot(f"slot{position}", position, 16, width, gen, lanes))
    if not slots:
        raise ValueError("give at least one slot, e.g. 1 x16 gen5 cpu, 4 x8 gen5 cpu")
    return sorted(slots, key=lambda s: s.position)


def resolve_board(choices: BuildChoices, catalog: Catalog, issues: list[FieldIssue]) -> Board | None:
    if choices.board != CUSTOM:
        return _catalog(catalog, "board", choices.board, "board", issues)
    try:
        return Board(CUSTOM, "custom board", tuple(parse_slots(choices.board_slots)))
    except ValueError as err:
        issues.append(FieldIssue("board-slots", str(err)))
        return None


def _catalog(catalog: Catalog, kind: str, entry: str, name: str, issues: list[FieldIssue]):  # type: ignore[no-untyped-def]
    try:
        return catalog.get(kind, entry)
    except CatalogError as err:
        issues.append(FieldIssue(name, str(err)))
        return None


def resolve_card(choice: CardChoice, index: int, catalog: Catalog,
                 issues: list[FieldIssue]) -> Card | None:
    if choice.gpu != CUSTOM:
        return _catalog(catalog, "gpu", choice.gpu, f"card{index}", issues)
    name = f"card{index}"
    before = len(issues)
    length = _number(issues, f"{name}-length_mm", choice.length_mm, unit=" (mm)")
    thickness = _number(issues, f"{name}-thickness_slots", choice.thickness_slots, unit=" (slots)")
    tdp = _number(issues, f"{name}-tdp_w", choice.tdp_w, minimum=1, whole=True, unit=" (W)")
    eight = _number(issues, f"{name}-pcie_8pin", choice.pcie_8pin, whole=True)
    sixteen = _number(issues, f"{name}-pin16", choice.pin16, whole=True)
    if len(issues) > before:
        return None
    connectors = {k: int(v) for k, v in (("pcie_8pin", eight), ("12v_2x6", sixteen)) if v}
    return Card(f"custom-{index}", f"custom card {index}", length, thickness, int(tdp),
                connectors, choice.transient)


def resolve(choices: BuildChoices, catalog: Catalog) -> tuple[Build | None, list[FieldIssue]]:
    issues: list[FieldIssue] = []
    board = resolve_board(choices, catalog, issues)
    if choices.case == CUSTOM:
        before = len(issues)
        slots = _number(issues, "case-expansion_slots", choices.case_expansion_slots, minimum=1,
                        whole=True)
        length = _number(issues, "case-max_gpu_length_mm", choices.case_max_gpu_length_mm,
                         unit=" (mm)")
        vertical = _number(issues, "case-vertical_mount_slots", choices.case_vertical_mount_slots,
                           whole=True)
        case = Case(CUSTOM, "custom case", int(slots), length, int(vertical)) \
            if len(issues) == before else None
    else:
        case = _catalog(catalog, "case", choices.case, "case", issues)
    if choices.psu == CUSTOM:
        before = len(issues)
        watts = _number(issues, "psu-watts", choices.psu_watts, minimum=1, whole=True, unit=" (W)")
        eight = _number(issues, "psu-pcie_8pin", choices.psu_pcie_8pin, whole=True)
        sixteen = _number(issues, "psu-pin16", choices.psu_pin16, whole=True)
        psu = Psu(CUSTOM, f"custom {watts:g} W PSU", int(watts),
                  {"pcie_8pin": int(eight), "12v_2x6": int(sixteen)}) \
            if len(issues) == before else None
    else:
        psu = _catalog(catalog, "psu", choices.psu, "psu", issues)
    cpu = _number(issues, "cpu_watts", choices.cpu_watts, whole=True, unit=" (W)")
    placements = []
    used: set[str] = set()
    for index, choice in enumerate(choices.cards, start=1):
        card = resolve_card(choice, index, catalog, issues)
        if board is not None and board.slot(choice.slot) is None:
            issues.append(FieldIssue(f"card{index}-slot", f"pick a slot of {board.name}"))
        elif choice.slot and choice.slot in used:
            issues.append(FieldIssue(f"card{index}-slot", f"{choice.slot} already holds a card"))
        used.add(choice.slot)
        if card is not None:
            placements.append(Placement(card, choice.slot, choice.riser))
    if not choices.cards:
        issues.append(FieldIssue("cards", "add at least one card"))
    if issues or board is None or case is None or psu is None:
        return None, issues
    return Build(board, case, psu, tuple(placements), int(cpu)), issues


def default_slots(board: Board, count: int) -> list[str]:
    """Where cards go first: the x16-size slots top to bottom, CPU lanes before chipset ones."""
    x16 = [s for s in board.slots if s.physical_width >= 16 or s.open_ended]
    ordered = sorted(x16, key=lambda s: (s.lanes != "cpu", s.position)) + \
        [s for s in board.slots if s not in x16]
    names = [s.name for s in ordered]
    return [names[i] if i < len(names) else "" for i in range(count)]
