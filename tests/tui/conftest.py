"""TUI tests: every test gets its own empty user-preset folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from homelab_llm.presets import PRESETS_DIR_ENV


@pytest.fixture(autouse=True)
def user_presets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "user-presets"
    monkeypatch.setenv(PRESETS_DIR_ENV, str(folder))
    return folder
