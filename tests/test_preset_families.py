"""Every built-in preset on the builtin backend names a model of a family the engine loads: its
model folder maps to a shipped config (assets/model_configs) whose architecture parses. A new
builtin-backend preset must be added to MODEL_SHAPES below, which is what makes this test fail
when it names a family the engine does not run."""

from __future__ import annotations

import json
from pathlib import Path

from homelab_llm.assets import assets_dir
from homelab_llm.engine.model.config import SUPPORTED_ARCHITECTURES, config_from_hf
from homelab_llm.presets import scan_presets

# model (as written in a builtin preset) -> assets/model_configs/<name>.json of its shape
MODEL_SHAPES = {
    "@default": "SmolLM2-135M",
    "~/models/qwen3-32b-w4a16": "Qwen3-32B",
    "~/models/qwen3-30b-a3b-w4a16": "Qwen3-30B-A3B",
    "~/models/gemma-3-27b-it-w4a16": "Gemma-3-27B",
    "~/models/Qwen3.6-27B-int4-AutoRound": "Qwen3.6-27B",
    "~/models/gpt-oss-20b": "gpt-oss-20b",
}


def test_every_builtin_backend_preset_names_a_loadable_family() -> None:
    presets = [p for p in scan_presets().presets if p.builtin and p.backend == "builtin"]
    assert presets
    configs = assets_dir() / "model_configs"
    for preset in presets:
        assert preset.model in MODEL_SHAPES, (
            f"preset {preset.name}: model {preset.model!r} has no shape in MODEL_SHAPES")
        path = Path(configs / f"{MODEL_SHAPES[preset.model]}.json")
        cfg = config_from_hf(json.loads(path.read_text()), name=path.stem, where=str(path))
        assert cfg.architecture in SUPPORTED_ARCHITECTURES, preset.name
