"""Every built-in preset that runs our own engine names a model family the engine can load.

A preset's model is a user's folder, absent here, so the family comes from its name: "@default"
(the embedded SmolLM2), an assets/model_configs name or .json, or a folder whose name starts with
one (e.g. ~/models/Qwen3.6-27B-int4-AutoRound -> Qwen3.6-27B). That config must parse.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from homelab_llm.engine.model.config import config_from_hf
from homelab_llm.hwcheck.plan_command import model_configs_dir
from homelab_llm.presets import Preset, list_presets

EMBEDDED_FAMILY = "SmolLM2-135M"  # what "@default" (the bundled GGUF) is


def family_config(model: str, known: list[Path]) -> Path | None:
    """The assets config whose name is the longest prefix of the model's folder or file name."""
    stem = EMBEDDED_FAMILY if model == "@default" else Path(model).expanduser().name
    stem = stem.lower().removesuffix(".json")
    matches = [p for p in known if stem.startswith(p.stem.lower())]
    return max(matches, key=lambda p: len(p.stem), default=None)


def builtin_engine_presets() -> list[Preset]:
    return [p for p in list_presets() if p.builtin and p.backend == "builtin"]


@pytest.mark.parametrize("preset", builtin_engine_presets(), ids=lambda p: p.name)
def test_builtin_preset_model_is_a_supported_family(preset: Preset) -> None:
    known = sorted(model_configs_dir().glob("*.json"))
    path = family_config(preset.model, known)
    assert path is not None, (f"preset {preset.name}: model {preset.model!r} is no known family "
                              f"({', '.join(p.stem for p in known)})")
    config_from_hf(json.loads(path.read_text()), name=path.stem, where=str(path))


def test_family_lookup_takes_the_longest_prefix_and_refuses_unknown_names(tmp_path: Path) -> None:
    known = [tmp_path / f"{n}.json" for n in ("Qwen3-8B", "Qwen3.6-27B", "Qwen3.6-27B-Base")]
    assert family_config("~/models/Qwen3.6-27B-int4-AutoRound", known) == known[1]
    assert family_config("/m/qwen3.6-27b-base-w4a16", known) == known[2]
    assert family_config("~/models/gemma-3-27b-it-w4a16", known) is None


def test_the_dual_7900xtx_preset_runs_the_hybrid_27b() -> None:
    preset = next(p for p in builtin_engine_presets() if p.name == "dual-7900xtx-27b-128k")
    path = family_config(preset.model, sorted(model_configs_dir().glob("*.json")))
    assert path is not None and path.stem == "Qwen3.6-27B"
    assert config_from_hf(json.loads(path.read_text())).is_hybrid
