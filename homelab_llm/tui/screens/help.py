"""Help (? or F1): every key binding of the app and of the screen underneath, grouped."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Static

ABOUT = ("homelab-llm runs an inference server from a preset as a child process and shows what "
         "it is doing. Modes: d Dashboard · p Presets · h Hardware (w: build wizard) · l Logs · "
         "b Bench. In a text field letters type; Esc gives the keys back. Ctrl+P opens the "
         "command palette; q or Ctrl+C quits and stops the service.")


KEY_NAMES = {"question_mark": "?", "escape": "esc", "delete": "del"}


def _key(binding: Binding) -> str:
    """Every key of a binding (the footer shows only the first, to save room)."""
    return ", ".join(KEY_NAMES.get(k.strip(), k.strip()) for k in binding.key.split(","))


def bindings_table(title: str, bindings: list[Binding]) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=None)
    table.add_column(style="bold cyan", no_wrap=True, width=14)
    table.add_column()
    for binding in bindings:
        if binding.description:
            table.add_row(_key(binding), binding.description)
    return table


class HelpScreen(ModalScreen[None]):
    BINDINGS = [("escape,q,question_mark,f1", "dismiss", "Close")]

    def __init__(self, app_bindings: list[Binding], screen: Screen[object]) -> None:
        super().__init__()
        self._app_bindings = app_bindings
        self._screen_bindings = [b for b in screen.BINDINGS if isinstance(b, Binding)] + [
            Binding(*b) for b in screen.BINDINGS if isinstance(b, tuple)]
        self._screen_name = type(screen).__name__.removesuffix("Screen")

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-body") as body:
            body.border_title = "Help"
            body.border_subtitle = "Esc closes"
            yield Static(ABOUT, id="help-about")
            yield Static(bindings_table("Everywhere", self._app_bindings))
            if self._screen_bindings:
                yield Static(bindings_table(f"On {self._screen_name}", self._screen_bindings))

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(result)
