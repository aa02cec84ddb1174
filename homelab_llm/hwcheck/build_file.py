"""Build files (`hwcheck build FILE.toml`) written out: the commented example behind
`hwcheck build --example`, and the TOML the app's build wizard saves. Both go through
`build_toml`, and what it writes is what `catalog.load_build` reads back."""

from __future__ import annotations

from dataclasses import dataclass

EXAMPLE_HEADER = """\
# A planned PC for `homelab-llm hwcheck build FILE.toml`: does it fit, are the lanes right,
# is the power supply big enough. Every part is an id from the hardware catalog
# (`homelab-llm hwcheck catalog` lists them); a part not in the catalog can be written inline
# instead, e.g. [psu] with watts = 1000 and its connectors (see assets/hardware/psus.toml).
"""


@dataclass(frozen=True)
class CardPlacement:
    gpu: str  # catalog id
    slot: str  # the board's slot name, e.g. "PCIEX16_1"
    riser: bool = False  # on a riser cable (a vertical mount), not in the slot itself


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def build_toml(board: str, case: str, psu: str, cards: list[CardPlacement], cpu_watts: int,
               *, header: str = "", comments: bool = False) -> str:
    def note(text: str) -> list[str]:
        return [f"# {text}"] if comments else []

    lines = [header.rstrip("\n"), ""] if header else []
    lines += [*note("the CPU's own draw, for the power budget (watts)"),
              f"cpu_watts = {int(cpu_watts)}", "",
              *note("motherboard: its slots decide lanes (CPU or chipset) and widths"),
              f"board = {_quote(board)}",
              *note("case: expansion slots and the longest card it takes"),
              f"case = {_quote(case)}",
              *note("power supply: watts and PCIe power connectors"),
              f"psu = {_quote(psu)}"]
    for index, card in enumerate(cards):
        first = note("one [[gpu]] table per card, top slot first") if index == 0 else []
        lines += ["", *first, "[[gpu]]", f"ref = {_quote(card.gpu)}", f"slot = {_quote(card.slot)}"]
        if card.riser:
            lines.append("riser = true")
    return "\n".join(lines) + "\n"


def example_toml() -> str:
    """Two 7900 XTX in the two CPU slots of an X670E board: a common 48 GB build."""
    cards = [CardPlacement("amd-7900xtx-reference", "PCIEX16_1"),
             CardPlacement("amd-7900xtx-reference", "PCIEX16_2")]
    return build_toml("asus-proart-x670e-creator", "fractal-define-7-xl",
                      "seasonic-prime-tx-1600-atx3", cards, 120, header=EXAMPLE_HEADER, comments=True)
