"""Two small modals of the Models flow: the pull dialog (repo id, include pattern) and the model
picker the preset editor opens (models found on disk, or any file/folder via a browser)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from textual import work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, DirectoryTree, Input, Label, OptionList
from textual.widgets.option_list import Option

from homelab_llm.models.describe import LocalModel
from homelab_llm.models.scan import is_hf_folder

CSS = "../models.tcss"


@dataclass(frozen=True)
class PullRequest:
    repo_id: str
    include: tuple[str, ...]


class PullDialog(ModalScreen[PullRequest | None]):
    CSS_PATH = CSS
    BINDINGS = [("escape", "cancel", "Cancel")]

    def compose(self) -> ComposeResult:
        with Vertical(id="pull-body") as body:
            body.border_title = "Pull from the Hugging Face Hub"
            yield Label("repo id", classes="field-label")
            yield Input(placeholder="Qwen/Qwen3-8B-AWQ", id="pull-repo")
            yield Label("include (optional globs, space separated)", classes="field-label")
            yield Input(placeholder="*Q4_K_M.gguf", id="pull-include")
            with Horizontal(id="pull-buttons"):
                yield Button("Pull", id="pull-go", variant="success")
                yield Button("Cancel", id="pull-cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "pull-go":
            self.action_submit()
        else:
            self.action_cancel()

    def on_input_submitted(self) -> None:
        self.action_submit()

    def action_submit(self) -> None:
        repo = self.query_one("#pull-repo", Input).value.strip()
        if repo.count("/") != 1 or repo.startswith("/") or repo.endswith("/"):
            self.notify("give the repo as owner/name, e.g. Qwen/Qwen3-8B-AWQ", severity="error")
            return
        include = tuple(self.query_one("#pull-include", Input).value.split())
        self.dismiss(PullRequest(repo, include))

    def action_cancel(self) -> None:
        self.dismiss(None)


class ModelPicker(ModalScreen[str | None]):
    """Dismisses with a model path: a found model (Enter) or a .gguf / HF folder in the browser."""

    CSS_PATH = CSS
    BINDINGS = [("escape", "cancel", "Cancel")]

    def __init__(self, scanner: Callable[[], list[LocalModel]], root: Path | None = None) -> None:
        super().__init__()
        self.scanner = scanner
        self.root = root or Path.home()

    def compose(self) -> ComposeResult:
        with Vertical(id="picker-body") as body:
            body.border_title = "Pick a model"
            body.border_subtitle = "Enter picks · Esc cancels"
            yield Label("found on disk (scanning...)", id="picker-found", classes="field-label")
            yield OptionList(id="picker-models")
            yield Label(f"or browse {self.root}", classes="field-label")
            yield DirectoryTree(self.root, id="picker-files")

    def on_mount(self) -> None:
        self.scan()

    @work(thread=True, exclusive=True, group="picker-scan")
    def scan(self) -> None:
        models = self.scanner()
        self.app.call_from_thread(self.show, models)

    def show(self, models: list[LocalModel]) -> None:
        options = self.query_one("#picker-models", OptionList)
        options.clear_options()
        for m in models:
            mark = "" if m.supported else "  (unsupported)"
            options.add_option(Option(f"{m.name}  {m.family} {m.quantization}{mark}", id=m.path))
        self.query_one("#picker-found", Label).update(f"found on disk: {len(models)} model(s)")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def on_directory_tree_file_selected(self, event: DirectoryTree.FileSelected) -> None:
        if event.path.suffix == ".gguf":
            self.dismiss(str(event.path))
        else:
            self.notify("pick a .gguf file or an HF folder (config.json + safetensors)")

    def on_directory_tree_directory_selected(self, event: DirectoryTree.DirectorySelected) -> None:
        if is_hf_folder(event.path):
            self.dismiss(str(event.path))

    def action_cancel(self) -> None:
        self.dismiss(None)
