"""The TUI Models screen through a Pilot: fit verdicts in the table, "make a preset" opening the
editor filled from the plan and saving it, a pull with progress (a scripted puller: the real
one is tested against the fake hub), and the editor's model picker."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from textual.widgets import DataTable, Input, OptionList, Static, TextArea

from homelab_llm.models.download import FileProgress
from homelab_llm.models.fit import Machine, fit_model
from homelab_llm.models.pull import FitCheck, PullProgress
from homelab_llm.models.scan import find_models
from homelab_llm.presets import PRESETS_DIR_ENV, load_preset
from homelab_llm.tui.app import HomelabApp
from homelab_llm.tui.screens.model_dialogs import ModelPicker
from homelab_llm.tui.screens.models import ModelsScreen
from homelab_llm.tui.screens.preset_editor import PresetEditor
from homelab_llm.tui.process_group import free_port, process_group_alive
from homelab_llm.tui.widgets.router_panel import RouterPanel
from model_trees import dense_hf, write_gguf
from tests.tui.tui_fakes import FIXED_TELEMETRY, FakeProbe, FakeTelemetry, load_hardware, load_status

pytestmark = pytest.mark.timeout(60)
GIB = 1 << 30


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(PRESETS_DIR_ENV, str(tmp_path / "presets"))
    monkeypatch.setenv("HOMELAB_LLM_CONFIG", str(tmp_path / "config.toml"))
    root = tmp_path / "models"
    root.mkdir()
    dense_hf(root / "llama-hf")
    write_gguf(root / "gemma.gguf", arch="gemma3")
    (tmp_path / "config.toml").write_text(f'models_dirs = ["{root}"]\n')
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HOME", str(tmp_path))
    return root


def make_app() -> HomelabApp:
    return HomelabApp(probe_factory=FakeProbe([load_status()]), watch_url="http://recorded:8000",
                      hardware_source=load_hardware, telemetry=FakeTelemetry(FIXED_TELEMETRY),
                      clock=lambda: 1000.0, poll_interval_s=0.05)


async def wait_until(pilot, predicate, what: str) -> None:
    for _ in range(200):
        if predicate():
            return
        await pilot.pause(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def scripted_pull(repo_id, *, include, machine, on_fit, on_progress):
    on_fit(FitCheck("fit: fits 1 x 1.0 GiB", None, False))
    on_progress(PullProgress(1, 1, FileProgress("model.safetensors", 500_000, 1_000_000, 2e6, 250_000)))
    return SimpleNamespace(path=Path("/cache") / repo_id)


async def test_models_screen_verdicts_make_preset_and_pull(tree: Path) -> None:
    machine = Machine(GIB, 1)
    screen = ModelsScreen(scanner=lambda: find_models([tree]), machine_source=lambda: machine,
                          puller=scripted_pull, router_port=free_port())
    app = make_app()
    async with app.run_test(size=(150, 45)) as pilot:
        await app.push_screen(screen)
        table = screen.query_one(DataTable)
        await wait_until(pilot, lambda: table.row_count == 2, "the scan")
        rows = {str(table.get_row_at(i)[0]): table.get_row_at(i) for i in range(2)}
        llama = next(m for m in find_models([tree]) if m.name == "llama-hf")
        fit = fit_model(llama.config, machine)
        assert str(rows["llama-hf"][5]) == f"{fit.max_context // 1024}K ctx, {fit.concurrency_32k}x32K"
        assert str(rows["gemma.gguf"][5]) == "unsupported"

        table.move_cursor(row=[str(table.get_row_at(i)[0]) for i in range(2)].index("gemma.gguf"))
        await pilot.press("n")  # unsupported: a message, no editor
        await pilot.pause(0.1)
        assert not isinstance(app.screen, PresetEditor)

        table.move_cursor(row=[str(table.get_row_at(i)[0]) for i in range(2)].index("llama-hf"))
        await pilot.pause(0.05)
        assert "fits: up to" in str(screen.query_one("#model-info", Static).content)
        await pilot.press("n")
        await wait_until(pilot, lambda: isinstance(app.screen, PresetEditor), "the editor")
        editor = app.screen
        assert editor.query_one("#f-model", Input).value == str(tree / "llama-hf")
        args = editor.query_one("#f-args", TextArea).text
        assert f"max_model_len = {fit.max_context}" in args and 'kv_cache_dtype = "int8"' in args
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: app.screen is screen, "the editor to close")
        saved = load_preset("llama-hf")
        assert saved.model == str(tree / "llama-hf") and saved.args["tensor_parallel_size"] == 1

        await pilot.press("u")
        await pilot.pause(0.1)
        await pilot.click("#pull-repo")
        await pilot.press(*"acme/tiny", "enter")
        await wait_until(pilot, lambda: "pulled acme/tiny" in str(
            screen.query_one("#pull-status", Static).content), "the pull")

        # the router as a managed child: on, listing the presets (the one just saved too), off
        panel = screen.query_one(RouterPanel)
        await pilot.press("o")
        for _ in range(600):  # a cold `python -m homelab_llm router` on a loaded 2-core box
            if "llama-hf: stopped" in str(panel.render()):
                break
            await pilot.pause(0.05)
        text = str(panel.render())
        assert "router healthy" in text and f":{screen.router_port}/v1" in text, text
        pgid = panel.manager.status.pid
        await pilot.press("o")
        await wait_until(pilot, lambda: not panel.running, "the router to stop")
        assert pgid is not None and not process_group_alive(pgid)


async def test_editor_picks_a_model_from_the_list(tree: Path) -> None:
    app = make_app()
    async with app.run_test(size=(150, 45)) as pilot:
        await pilot.press("escape")  # the chat box may hold the keys (a healthy service)
        await pilot.press("p", "n")
        await wait_until(pilot, lambda: isinstance(app.screen, PresetEditor), "the editor")
        editor = app.screen
        editor.action_pick_model()
        await wait_until(pilot, lambda: isinstance(app.screen, ModelPicker)
                         and app.screen.query(OptionList), "the picker")
        options = app.screen.query_one(OptionList)
        await wait_until(pilot, lambda: options.option_count == 2, "the picker's scan")
        options.focus()
        options.highlighted = [options.get_option_at_index(i).id for i in range(2)].index(
            str(tree / "llama-hf"))
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.screen is editor, "the picker to close")
        assert editor.query_one("#f-model", Input).value == str(tree / "llama-hf")
