"""Element sizes of the dtypes the engine and the CLI name, and the error a memory plan raises.

Torch-free (the planner and `plan` must not import torch). Shared by engine/memory.py and
engine/cache/state_layout.py, so one table says what a "bf16" or "torch.float32" element costs.
"""

from __future__ import annotations

from homelab_llm.engine.model.config import ModelConfig
from homelab_llm.errors import HomelabError

# Every spelling -> (canonical torch name, bytes per element).
_DTYPES: dict[str, tuple[str, int]] = {
    "float32": ("float32", 4), "fp32": ("float32", 4), "float": ("float32", 4),
    "bfloat16": ("bfloat16", 2), "bf16": ("bfloat16", 2),
    "float16": ("float16", 2), "fp16": ("float16", 2), "half": ("float16", 2),
    "int8": ("int8", 1), "fp8": ("float8_e4m3fn", 1), "float8_e4m3fn": ("float8_e4m3fn", 1),
}


class MemoryPlanError(HomelabError, ValueError):
    """Inputs that cannot make a plan (unknown dtype, no room for the weights, ...)."""


def _lookup(name: str) -> tuple[str, int]:
    key = str(name).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise MemoryPlanError(f"unknown dtype {name!r}; use one of bfloat16, float16, float32, int8")
    return _DTYPES[key]


def dtype_bytes(name: str) -> int:
    return _lookup(name)[1]


def canonical_dtype(name: str) -> str:
    """The torch attribute name for any accepted spelling ('bf16' -> 'bfloat16')."""
    return _lookup(name)[0]


def resolve_model_dtype(config: ModelConfig, model_dtype: str) -> str:
    """`auto` means the checkpoint's dtype; float32 checkpoints still run in float32 (as the engine)."""
    return config.torch_dtype if model_dtype in ("auto", "", None) else model_dtype
