"""Fit verdicts: for a model and a machine (GPU memory per device, TP size), the largest
context that fits at int8 KV and how many 32K sequences run at once.

The numbers are `engine.memory.plan`'s with the same defaults `homelab-llm plan` uses, so a
verdict here, `plan MODEL --kv-cache-dtype int8` and a running server agree.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from homelab_llm.engine.memory import MemoryPlan, plan
from homelab_llm.engine.model.config import ModelConfig
from homelab_llm.errors import HomelabError

FIT_KV_DTYPE = "int8"
FIT_CONCURRENCY_LEN = 32768


@dataclass(frozen=True)
class Machine:
    gpu_memory_bytes: int  # per device
    tensor_parallel_size: int = 1
    source: str = "given"  # "given" (flags) or "detected" (hwcheck)


@dataclass(frozen=True)
class Fit:
    fits: bool
    max_context: int  # largest max_model_len the KV cache holds (<= the model's own limit)
    concurrency_32k: int  # full 32K sequences at once
    weights_bytes: int  # per device (rank 0)
    reason: str = ""  # why it does not fit ("" when it does)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def plan_for(config: ModelConfig, machine: Machine) -> MemoryPlan:
    """The plan a fit verdict reads: int8 KV, the model's own context, `plan`'s defaults."""
    return plan(config, gpu_memory_bytes=machine.gpu_memory_bytes,
                tensor_parallel_size=machine.tensor_parallel_size, kv_cache_dtype=FIT_KV_DTYPE,
                max_model_len=config.max_position_embeddings)


def fit_model(config: ModelConfig, machine: Machine) -> Fit:
    try:
        p = plan_for(config, machine)
    except HomelabError as err:  # a TP size the shapes do not allow, ...
        return Fit(False, 0, 0, 0, str(err))
    max_context = min(p.tokens_capacity, config.max_position_embeddings)
    weights = p.per_device[0].weights_bytes
    if p.tokens_capacity == 0:
        return Fit(False, 0, 0, weights, p.warnings[0] if p.warnings else "no room for KV cache")
    return Fit(True, max_context, p.max_concurrency[str(FIT_CONCURRENCY_LEN)], weights)


def this_machine() -> Machine | None:
    """Every discrete GPU hwcheck finds, the smallest one's memory; None without a GPU."""
    from homelab_llm.hwcheck.gpus import detect_gpus

    sizes = [g.vram_bytes for g in detect_gpus() if not g.integrated and g.vram_bytes]
    return Machine(min(sizes), len(sizes), "detected") if sizes else None
