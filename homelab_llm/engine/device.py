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


def resolve_dtype(dtype: str, device: torch.device, quantization: str | None = None) -> torch.dtype:
    if dtype == "auto":
        # fp32 on the CPU: exact against references and as fast as bf16 there for small dense
        # models. 4-bit weights on the CPU want bf16: torch's int4 kernel only runs fast with bf16
        # activations (fp32 falls back to an exact but ~20x slower reference).
        if device.type == "cuda" or quantization == "w4a16":
            return torch.bfloat16
        return torch.float32
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
    from homelab_llm.engine.model.loader import load_model_config, resolve_format, resolve_quantization

    path = resolve_model_path(args.model)
    device = resolve_device(args.device)
    config = load_model_config(path, args.load_format, args.hf_overrides)
    quantization = resolve_quantization(config, resolve_format(path, args.load_format),
                                        args.quantization)
    return ModelTarget(path, device, config, quantization, resolve_dtype(args.dtype, device, quantization))
