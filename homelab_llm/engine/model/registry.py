"""ModelConfig.architecture -> the model class that runs it (one file per family in model/)."""

from __future__ import annotations

from homelab_llm.engine.model.config import ModelConfig, UnsupportedModelError
from homelab_llm.engine.model.llama import LlamaForCausalLM
from homelab_llm.engine.model.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    try:
        return MODEL_CLASSES[config.architecture]
    except KeyError:
        raise UnsupportedModelError(
            f"architecture {config.architecture!r} has no model class; "
            f"supported: {', '.join(MODEL_CLASSES)}") from None
