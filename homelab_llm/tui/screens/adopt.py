"""Asked at start when an earlier app left a service running: adopt it, stop it, or leave it."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from homelab_llm.tui.pidfiles import ServiceRecord

ADOPT, STOP, LEAVE = "adopt", "stop", "leave"


class AdoptScreen(ModalScreen[str]):
    BINDINGS = [("a", f"answer('{ADOPT}')", "Adopt"), ("x", f"answer('{STOP}')", "Stop it"),
                ("escape", f"answer('{LEAVE}')", "Leave it")]

    def __init__(self, record: ServiceRecord) -> None:
        super().__init__()
        self.record = record

    def compose(self) -> ComposeResult:
        r = self.record
        with Vertical(id="confirm-body"):
            yield Static(f"{r.preset} is still running from an earlier app (pid {r.pid}, "
                         f"{r.url}). Adopt it (watch and control it here), or stop it?")
            with Horizontal(id="confirm-buttons"):
                yield Button("Adopt (a)", id=ADOPT, variant="primary")
                yield Button("Stop it (x)", id=STOP, variant="error")
                yield Button("Leave (esc)", id=LEAVE)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(str(event.button.id))

    def action_answer(self, answer: str) -> None:
        self.dismiss(answer)
