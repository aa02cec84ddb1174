"""Where and how a model runs: its path, device and dtype, resolved from the engine flags.

Shared by rank 0 (core.LLMEngine) and the worker ranks of other nodes (parallel/worker.py), so
every rank resolves the same flags the same way. Bad flags raise EngineArgsError naming the flag.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from homelab_llm.engine.args import EngineArgs, EngineArgsError
from homelab_llm.engine.model.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(model: str) -> str:
    if model:
        return model
    from homelab_llm.assets import default_model_path

    return str(default_model_path())


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineArgsError(f"--device {device}: no CUDA/HIP device is visible; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise EngineArgsError(f"--device {device!r} is not supported; use auto, cpu or cuda[:N]")
    if dev.type == "cuda":
        index = 0 if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise EngineArgsError(
                f"--device {device}: only {torch.cuda.device_count()} GPU(s) are visible")
        dev = torch.device("cuda", index)
    return dev


def fast_cpu_default(dtype: str, device: torch.device) -> bool:
    """--dtype auto on the CPU: 4-bit weights (a GGUF Q4 file's included) run through torch's
    int4 kernel in bf16 and the LM head through an int8 copy, while the rest of the model stays
    fp32 (kernels/w4a16_cpu.py has the numbers). --dtype float32 is the exact mode."""
    return device.type == "cpu" and dtype == "auto"


def resolve_dtype(dtype: str, device: torch.device, quantization: str | None = None) -> torch.dtype:
    del quantization  # the CPU keeps fp32 around 4-bit matmuls too (fast_cpu_default)
    if dtype == "auto":
        # fp32 on the CPU: exact against references, as fast as bf16 there for elementwise work,
        # and the fast default computes only its 4-bit matmuls in bf16.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise EngineArgsError(f"--dtype {dtype!r} is not supported; use auto, float32, bfloat16 or float16")
    return DTYPES[dtype]


@dataclass(frozen=True)
class ModelTarget:
    """A model resolved from the flags: what every rank loads, where, and in which dtype."""
    path: str
    device: torch.device
    config: ModelConfig
    quantization: str | None
    dtype: torch.dtype


def resolve_target(args: EngineArgs) -> ModelTarget:
    # The loader pulls in the model code: imported here so `homelab_llm.engine.device` stays light.
    from homelab_llm.engine.model.loader import (
        default_quantization,
        load_model_config,
        resolve_format,
        resolve_quantization,
    )

    path = resolve_model_path(args.model)
    device = resolve_device(args.device)
    config = load_model_config(path, args.load_format, args.hf_overrides)
    fmt = resolve_format(path, args.load_format)
    wanted = args.quantization or default_quantization(
        path, fmt, fast_cpu_default(args.dtype, device))
    quantization = resolve_quantization(config, fmt, wanted)
    return ModelTarget(path, device, config, quantization, resolve_dtype(args.dtype, device, quantization))
