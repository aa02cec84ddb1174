"""How much GPU memory a running preset holds, and which idle presets to stop so another fits.

Engines on a GPU claim memory up front: ours and vLLM take gpu_memory_utilization of every GPU
they use (the KV cache fills the rest), SGLang mem_fraction_static; with an explicit
kv_cache_memory_bytes ours holds the memory plan's fixed parts plus that KV. llama.cpp holds
about its GGUF file. A command preset declares gpu_memory_utilization in its args (they are not
passed to its command) or holds nothing, as CPU presets do. The budget is the machine's total GPU memory;
two presets whose claims add up past it cannot run together, so the router swaps them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from homelab_llm.presets import Preset

VLLM_DEFAULT_UTILIZATION = 0.9
SGLANG_DEFAULT_FRACTION = 0.88


@dataclass(frozen=True)
class Running:
    name: str
    claim_bytes: int
    last_used: float
    busy: bool  # requests in flight: never stopped to make room


def _number(args: dict[str, object], *keys: str, default: float) -> float:
    for key in keys:
        value = args.get(key, args.get(key.replace("_", "-")))
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return default


def _plan_claim(preset: Preset, gpu_memory: int, tp: int) -> int | None:
    """Ours with kv_cache_memory_bytes: the plan's fixed parts plus that KV, per device."""
    from homelab_llm.engine.args import parse_bytes
    from homelab_llm.engine.memory import plan
    from homelab_llm.errors import HomelabError
    from homelab_llm.models.describe import describe_gguf, describe_hf

    kv = preset.args.get("kv_cache_memory_bytes")
    if kv is None:
        return None
    try:  # a model not on disk (yet) falls back to the utilization estimate
        path = Path(preset.resolved_model())
        model = describe_gguf(path) if path.suffix == ".gguf" else describe_hf(path)
        if model.config is None:
            return None
        d = plan(model.config, gpu_memory_bytes=gpu_memory, tensor_parallel_size=tp).per_device[0]
        fixed = d.weights_bytes + d.buffers_bytes + d.activation_bytes + d.graph_bytes + d.other_bytes
        return (fixed + int(parse_bytes(kv) or 0)) * tp  # type: ignore[arg-type]
    except (HomelabError, OSError):
        return None


def claim_bytes(preset: Preset, gpu_memory: int) -> int:
    """GPU bytes `preset` holds while it runs, over all its GPUs (0 on the CPU)."""
    args = preset.args
    if str(args.get("device", "")).startswith("cpu"):
        return 0
    if preset.backend == "builtin":
        tp = int(_number(args, "tensor_parallel_size", default=1))
        exact = _plan_claim(preset, gpu_memory, tp)
        if exact is not None:
            return exact
        return int(gpu_memory * _number(args, "gpu_memory_utilization", default=0.9)) * tp
    if preset.backend == "vllm":
        tp = int(_number(args, "tensor_parallel_size", default=1))
        return int(gpu_memory * _number(args, "gpu_memory_utilization",
                                        default=VLLM_DEFAULT_UTILIZATION)) * tp
    if preset.backend == "sglang":
        tp = int(_number(args, "tp_size", "tensor_parallel_size", default=1))
        return int(gpu_memory * _number(args, "mem_fraction_static",
                                        default=SGLANG_DEFAULT_FRACTION)) * tp
    if preset.backend == "llama.cpp":
        try:
            return os.path.getsize(preset.resolved_model())
        except OSError:
            return 0
    # A command preset declares its share the vLLM way (args are not passed to its command).
    tp = int(_number(args, "tensor_parallel_size", default=1))
    return int(gpu_memory * _number(args, "gpu_memory_utilization", default=0.0)) * tp


def evictions(running: Sequence[Running], need: int, budget: int | None) -> list[str] | None:
    """Idle presets to stop (least recently used first) so `need` more bytes fit; [] when it
    fits already; None when even stopping every idle preset would not make room (wait)."""
    if budget is None or need == 0:
        return []
    need = min(need, budget)  # a preset larger than the estimate allows gets the whole machine
    used = sum(r.claim_bytes for r in running)
    if used + need <= budget:
        return []
    chosen = []
    for r in sorted((r for r in running if not r.busy and r.claim_bytes), key=lambda r: r.last_used):
        chosen.append(r.name)
        used -= r.claim_bytes
        if used + need <= budget:
            return chosen
    return None
