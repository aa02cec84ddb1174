"""The build wizard: board, case, cards and PSU, each from the hardware catalog or typed in, then
the verdict of every hwcheck rule with its reason and what to do about it.

Every change re-checks the whole build (the rules are pure and take microseconds), so the line
under the steps always says where the build stands; the last step explains it. Custom values
that do not parse are marked in place and listed, and no verdict is shown until they are fixed.
"""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from pathlib import Path

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Button, Checkbox, Input, Label, Select, Static, TabbedContent, TabPane

from homelab_llm.errors import HomelabError
from homelab_llm.hwcheck.build_file import CardPlacement, build_toml
from homelab_llm.hwcheck.catalog import Catalog
from homelab_llm.hwcheck.fit import Board, Build, Slot, Verdict, check_build, overall, slot_width
from homelab_llm.tui.build_form import (CUSTOM, MAX_CARDS, BuildChoices, CardChoice, FieldIssue,
                                        default_slots, parse_slots, resolve)

SAVED_HEADER = "# Saved by the build wizard; check it with `homelab-llm hwcheck build FILE.toml`."
STEPS = ("board", "case", "cards", "psu", "verdict")
STEP_TITLES = ("1 Board", "2 Case", "3 Cards", "4 PSU", "5 Verdict")
MARK = {"pass": ("✓", "green"), "warn": ("⚠", "yellow"), "fail": ("✗", "bold red"),
        "info": ("•", "cyan")}
OVERALL = {"pass": "this build works", "warn": "this build works, with the caveats below",
           "fail": "this build does not work as chosen"}
PLUG_NAMES = {"pcie_8pin": "8-pin", "12v_2x6": "12V-2x6", "12pin": "12-pin"}
CARD_FIELDS = (("length_mm", "mm"), ("thickness_slots", "slots"), ("tdp_w", "W"),
               ("pcie_8pin", "8-pin"), ("pin16", "16-pin"))


def verdict_table(verdicts: list[Verdict]) -> Group:
    """The overall answer, then one row per verdict: the reason wraps in its own column so the
    marks stay readable at 80 columns; suggestions hang under their reason."""
    status = overall(verdicts)
    table = Table.grid(padding=(0, 1))
    table.add_column(no_wrap=True)
    table.add_column(ratio=1)
    for v in verdicts:
        mark, style = MARK[v.status]
        table.add_row(Text(f"{mark} {v.rule}", style=style), v.reason)
        for tip in v.suggestions:
            table.add_row("", Text(f"→ {tip}", style="dim"))
    mark, style = MARK[status]
    return Group(Text(f"{mark} {OVERALL[status]}\n", style=style + " bold"), table)


def summary_text(verdicts: list[Verdict]) -> Text:
    text = Text()
    for rule in ("physical", "lanes", "power"):
        statuses = {v.status for v in verdicts if v.rule == rule}
        status = "fail" if "fail" in statuses else "warn" if "warn" in statuses else "pass"
        mark, style = MARK[status]
        text.append(f"{mark} {rule}  ", style=style)
    text.append("· step 5 says why", style="dim")
    return text


def slot_label(slot: Slot) -> str:
    width = f"x{slot.electrical_width}" + (f" (x{slot.shared_width} shared)"
                                           if slot.shared_width else "")
    return f"{slot.name} · pos {slot.position} · {width} Gen{slot.gen} {slot.lanes}"


class BuildWizard(Vertical):
    def __init__(self, catalog: Catalog, choices: BuildChoices | None = None, *,
                 id: str | None = None) -> None:
        super().__init__(id=id)
        self.catalog = catalog
        self.initial = choices or BuildChoices()
        self.build: Build | None = None
        self.verdicts: list[Verdict] = []
        self.issues: list[FieldIssue] = []
        self._ready = False

    # ------------------------------------------------------------------ layout

    def _options(self, kind: str) -> list[tuple[str, str]]:
        return [(self.catalog.entries[kind][i].get("name", i), i) for i in self.catalog.ids(kind)] \
            + [("custom…", CUSTOM)]

    def _row(self, *widgets, id: str | None = None, classes: str = "wiz-row") -> Horizontal:  # type: ignore[no-untyped-def]
        return Horizontal(*widgets, id=id, classes=classes)

    def compose(self) -> ComposeResult:
        c = self.initial
        with TabbedContent(id="wiz-steps"):
            with TabPane(STEP_TITLES[0], id="step-board"), VerticalScroll():
                yield self._row(Label("board", classes="form-label"),
                                Select(self._options("board"), value=c.board, allow_blank=False,
                                       compact=True, id="w-board"))
                yield self._row(Label("slots", classes="form-label"),
                                Input(c.board_slots, compact=True, id="w-board-slots"),
                                id="w-board-custom")
                yield Static(id="w-board-info", classes="wiz-info")
            with TabPane(STEP_TITLES[1], id="step-case"), VerticalScroll():
                yield self._row(Label("case", classes="form-label"),
                                Select(self._options("case"), value=c.case, allow_blank=False,
                                       compact=True, id="w-case"))
                yield self._row(
                    Label("expansion slots", classes="form-label"),
                    Input(c.case_expansion_slots, compact=True, id="w-case-expansion_slots"),
                    Label("max GPU mm", classes="form-label"),
                    Input(c.case_max_gpu_length_mm, compact=True, id="w-case-max_gpu_length_mm"),
                    Label("vertical mount slots", classes="form-label"),
                    Input(c.case_vertical_mount_slots, compact=True,
                          id="w-case-vertical_mount_slots"),
                    id="w-case-custom")
                yield Static(id="w-case-info", classes="wiz-info")
            with TabPane(STEP_TITLES[2], id="step-cards"), VerticalScroll():
                yield self._row(Label("cards", classes="form-label"),
                                Select([(str(n), n) for n in range(1, MAX_CARDS + 1)],
                                       value=max(1, min(len(c.cards), MAX_CARDS)),
                                       allow_blank=False, compact=True, id="w-cards"))
                for n in range(1, MAX_CARDS + 1):
                    yield from self._card_rows(n, c.cards[n - 1] if n <= len(c.cards) else CardChoice())
            with TabPane(STEP_TITLES[3], id="step-psu"), VerticalScroll():
                yield self._row(Label("PSU", classes="form-label"),
                                Select(self._options("psu"), value=c.psu, allow_blank=False,
                                       compact=True, id="w-psu"))
                yield self._row(Label("watts", classes="form-label"),
                                Input(c.psu_watts, compact=True, id="w-psu-watts"),
                                Label("8-pin plugs", classes="form-label"),
                                Input(c.psu_pcie_8pin, compact=True, id="w-psu-pcie_8pin"),
                                Label("12V-2x6 plugs", classes="form-label"),
                                Input(c.psu_pin16, compact=True, id="w-psu-pin16"),
                                id="w-psu-custom")
                yield self._row(Label("CPU watts", classes="form-label"),
                                Input(c.cpu_watts, compact=True, id="w-cpu_watts"))
                yield Static(id="w-psu-info", classes="wiz-info")
            with TabPane(STEP_TITLES[4], id="step-verdict"), VerticalScroll():
                yield Static(id="w-verdict")
        yield Static(id="w-issues")
        with Horizontal(id="wiz-bar"):
            yield Button("‹ Back", id="w-back", compact=True)
            yield Button("Next ›", id="w-next", compact=True, variant="primary")
            yield Static(id="w-summary")

    def _card_rows(self, n: int, card: CardChoice) -> ComposeResult:
        gpu_value = card.gpu if card.gpu == CUSTOM or card.gpu in self.catalog.entries["gpu"] \
            else CUSTOM
        yield self._row(Label(f"card {n}", classes="form-label"),
                        Select(self._options("gpu"), value=gpu_value, allow_blank=False,
                               compact=True, id=f"w-card{n}-gpu"),
                        Select([], compact=True, prompt="slot", id=f"w-card{n}-slot"),
                        Checkbox("riser", card.riser, compact=True, id=f"w-card{n}-riser"),
                        id=f"w-card{n}", classes="wiz-row wiz-card")
        inputs = []
        for name, unit in CARD_FIELDS:
            inputs += [Input(str(getattr(card, name)), compact=True, id=f"w-card{n}-{name}",
                             classes="-num"), Label(unit, classes="form-unit")]
        yield self._row(*inputs, Checkbox("4090/5090-class spikes", card.transient, compact=True,
                                          id=f"w-card{n}-transient"),
                        id=f"w-card{n}-custom", classes="wiz-row wiz-custom")
        yield Static(id=f"w-card{n}-info", classes="wiz-info wiz-card-info")

    def on_mount(self) -> None:
        board = self.query_one("#w-board", Select).value
        self._fill_slots(str(board), [card.slot for card in self.initial.cards])
        self._ready = True
        self.recheck()

    # ------------------------------------------------------------------ reading the form

    def _value(self, selector: str) -> str:
        widget = self.query_one(selector)
        if isinstance(widget, Checkbox):
            return "1" if widget.value else ""
        value = widget.value  # type: ignore[attr-defined]
        return "" if value is Select.BLANK or value is None else str(value)

    def read_choices(self) -> BuildChoices:
        count = int(self._value("#w-cards") or 1)
        cards = []
        for n in range(1, count + 1):
            p = f"#w-card{n}"
            cards.append(CardChoice(
                gpu=self._value(f"{p}-gpu"), slot=self._value(f"{p}-slot"),
                riser=bool(self._value(f"{p}-riser")), transient=bool(self._value(f"{p}-transient")),
                **{name: self._value(f"{p}-{name}") for name, _ in CARD_FIELDS}))
        return BuildChoices(
            board=self._value("#w-board"), board_slots=self._value("#w-board-slots"),
            case=self._value("#w-case"),
            case_expansion_slots=self._value("#w-case-expansion_slots"),
            case_max_gpu_length_mm=self._value("#w-case-max_gpu_length_mm"),
            case_vertical_mount_slots=self._value("#w-case-vertical_mount_slots"),
            psu=self._value("#w-psu"), psu_watts=self._value("#w-psu-watts"),
            psu_pcie_8pin=self._value("#w-psu-pcie_8pin"), psu_pin16=self._value("#w-psu-pin16"),
            cpu_watts=self._value("#w-cpu_watts"), cards=cards)

    # ------------------------------------------------------------------ reacting

    def _board_now(self, board_id: str) -> Board | None:
        if board_id != CUSTOM:
            return self.catalog.get("board", board_id) if board_id else None
        try:
            return Board(CUSTOM, "custom board",
                         tuple(parse_slots(self.query_one("#w-board-slots", Input).value)))
        except ValueError:
            return None  # the slots field shows why

    def _fill_slots(self, board_id: str, wanted: list[str]) -> None:
        """Slot pickers offer the board's slots; a card keeps its slot if the board has it."""
        board = self._board_now(board_id)
        slots = board.slots if board is not None else ()
        options = [(slot_label(s), s.name) for s in slots]
        names = [s.name for s in slots]
        fallback = default_slots(board, MAX_CARDS) if board is not None else [""] * MAX_CARDS
        for n in range(1, MAX_CARDS + 1):
            select = self.query_one(f"#w-card{n}-slot", Select)
            keep = wanted[n - 1] if n - 1 < len(wanted) and wanted[n - 1] in names else fallback[n - 1]
            with select.prevent(Select.Changed):
                select.set_options(options)
                if keep:
                    select.value = keep

    def on_select_changed(self, event: Select.Changed) -> None:
        if not self._ready:
            return
        if event.select.id == "w-board":
            self._fill_slots(str(event.value), [c.slot for c in self.read_choices().cards])
        self.recheck()

    def on_input_changed(self, event: Input.Changed) -> None:
        if self._ready and event.input.id == "w-board-slots":
            self._fill_slots(CUSTOM, [c.slot for c in self.read_choices().cards])
        if self._ready:
            self.recheck()

    def on_checkbox_changed(self) -> None:
        if self._ready:
            self.recheck()

    def recheck(self) -> None:
        choices = self.read_choices()
        self._show_custom(choices)
        self.build, self.issues = resolve(choices, self.catalog)
        self.verdicts = check_build(self.build) if self.build is not None else []
        self._show_issues()
        self._show_info(choices)
        verdict = self.query_one("#w-verdict", Static)
        summary = self.query_one("#w-summary", Static)
        if self.build is None:
            verdict.update(Text("fix the values marked in red first", style="red"))
            summary.update(Text(f"{len(self.issues)} value(s) to fix", style="red"))
        else:
            verdict.update(verdict_table(self.verdicts))
            summary.update(summary_text(self.verdicts))

    def _show_custom(self, choices: BuildChoices) -> None:
        self.query_one("#w-board-custom").display = choices.board == CUSTOM
        self.query_one("#w-case-custom").display = choices.case == CUSTOM
        self.query_one("#w-psu-custom").display = choices.psu == CUSTOM
        count = len(choices.cards)
        for n in range(1, MAX_CARDS + 1):
            shown = n <= count  # hidden rows keep their values for when the count goes back up
            custom = shown and choices.cards[n - 1].gpu == CUSTOM
            self.query_one(f"#w-card{n}").display = shown
            self.query_one(f"#w-card{n}-custom").display = custom
            self.query_one(f"#w-card{n}-info").display = shown and not custom

    def _show_issues(self) -> None:
        bad = set()
        for issue in self.issues:
            for selector in (f"#w-{issue.field}", f"#w-{issue.field}-gpu"):
                if self.query(selector):
                    bad.add(selector)
                    break
        for widget in self.query(".-invalid"):
            if f"#{widget.id}" not in bad:
                widget.remove_class("-invalid")
        for selector in bad:
            self.query_one(selector).add_class("-invalid")
        box = self.query_one("#w-issues", Static)
        box.update(Text("\n".join(f"{i.field}: {i.message}" for i in self.issues), style="red"))
        box.display = bool(self.issues)

    def _show_info(self, choices: BuildChoices) -> None:
        build = self.build
        board_info = self.query_one("#w-board-info", Static)
        board = None
        if choices.board != CUSTOM:
            board = self.catalog.get("board", choices.board) if choices.board else None
        elif build is not None:
            board = build.board
        if board is not None:
            used = {c.slot for c in choices.cards}
            lines = [f"{s.name:<16} position {s.position}  {'x16 size' if s.physical_width >= 16 else f'x{s.physical_width} size'}"
                     f"  x{slot_width(board, s, used)} Gen{s.gen} via {s.lanes}" for s in board.slots]
            board_info.update("\n".join(lines))
        else:
            board_info.update("")
        case_info = self.query_one("#w-case-info", Static)
        case = self.catalog.get("case", choices.case) if choices.case != CUSTOM else None
        case_info.update(f"{case.expansion_slots} expansion slots · GPUs up to "
                         f"{case.max_gpu_length_mm:g} mm · vertical mount: "
                         f"{case.vertical_mount_slots or 'none'}" if case else "")
        psu_info = self.query_one("#w-psu-info", Static)
        psu = self.catalog.get("psu", choices.psu) if choices.psu != CUSTOM else None
        psu_info.update(f"{psu.watts} W · {psu.connectors.get('pcie_8pin', 0)} x 8-pin · "
                        f"{psu.connectors.get('12v_2x6', 0)} x 12V-2x6" if psu else "")
        for n, card_choice in enumerate(choices.cards, start=1):
            if card_choice.gpu == CUSTOM:
                continue
            card = self.catalog.get("gpu", card_choice.gpu)
            plugs = ", ".join(f"{v} x {PLUG_NAMES.get(k, k)}" for k, v in card.power_connectors.items())
            self.query_one(f"#w-card{n}-info", Static).update(
                f"  {card.length_mm:g} mm · {card.thickness_slots:g} slots · {card.tdp_w} W · "
                f"{plugs}" + (" · spikes" if card.transient_class else ""))

    # ------------------------------------------------------------------ steps

    def save(self, folder: Path) -> Path:
        """Write the build as a `hwcheck build` file in `folder`; returns its path."""
        choices = self.read_choices()
        if self.build is None:
            raise HomelabError("fix the values marked in red before saving the build")
        parts = [choices.board, choices.case, choices.psu, *(c.gpu for c in choices.cards)]
        if CUSTOM in parts:
            raise HomelabError("custom parts are not saved yet: pick catalog entries, or add "
                               "yours to the catalog (assets/hardware) first")
        cards = [CardPlacement(c.gpu, c.slot, c.riser) for c in choices.cards]
        text = build_toml(choices.board, choices.case, choices.psu, cards,
                          int(float(choices.cpu_watts)), header=SAVED_HEADER, comments=True)
        folder.mkdir(parents=True, exist_ok=True)
        stem = choices.board
        path = folder / f"{stem}.toml"
        number = 2
        while path.exists():  # never overwrite an earlier save
            path = folder / f"{stem}-{number}.toml"
            number += 1
        path.write_text(text)
        return path

    def action_step(self, delta: int) -> None:
        tabs = self.query_one("#wiz-steps", TabbedContent)
        current = STEPS.index(tabs.active.removeprefix("step-")) if tabs.active else 0
        tabs.active = f"step-{STEPS[max(0, min(len(STEPS) - 1, current + delta))]}"

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id in ("w-back", "w-next"):
            event.stop()
            self.action_step(-1 if event.button.id == "w-back" else 1)
