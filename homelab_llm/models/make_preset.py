"""A preset for a model on disk, filled in from its fit: TP size, int8 KV, the largest context
the plan allows and the sequences that fit at it. The TUI's "make a preset" opens the editor
with this; nothing is written until the user saves."""

from __future__ import annotations

import re

from homelab_llm.models.describe import LocalModel
from homelab_llm.models.fit import FIT_KV_DTYPE, Machine, fit_model, plan_for
from homelab_llm.presets import Preset

MAX_SEQS = 64  # plan's default max_num_seqs: the concurrency it sized activations for
CPU_CONTEXT = 8192  # without a GPU: a context a CPU answers in reasonable time
CPU_SEQS = 4


class PresetDraftError(ValueError):
    """The model cannot be made into a preset (unsupported, or it does not fit)."""


def preset_name(model_name: str) -> str:
    """A valid preset name from a model name: lowercase, safe characters, <= 64 long."""
    base = model_name.rsplit("/", 1)[-1].removesuffix(".gguf").lower()
    name = re.sub(r"[^a-z0-9._-]+", "-", base).strip("-._")[:64]
    return name or "model"


def draft_preset(model: LocalModel, machine: Machine | None) -> Preset:
    if model.config is None:
        raise PresetDraftError(f"{model.name}: the engine cannot run it ({model.reason})")
    description = f"{model.name} ({model.quantization}), made from the Models screen"
    if machine is None:
        length = min(model.config.max_position_embeddings, CPU_CONTEXT)
        return Preset(name=preset_name(model.name), model=model.path, description=description,
                      args={"device": "cpu", "max_model_len": length, "max_num_seqs": CPU_SEQS})
    fit = fit_model(model.config, machine)
    if not fit.fits:
        raise PresetDraftError(f"{model.name} does not fit: {fit.reason}")
    plan = plan_for(model.config, machine)
    seqs = plan.max_concurrency.get(str(plan.max_model_len), 1)
    if fit.max_context < plan.max_model_len:  # the KV cache, not the model, sets the length
        seqs = 1
    args: dict[str, str | int | float | bool] = {
        "device": "cuda", "tensor_parallel_size": machine.tensor_parallel_size,
        "kv_cache_dtype": FIT_KV_DTYPE, "max_model_len": fit.max_context,
        "max_num_seqs": max(1, min(seqs, MAX_SEQS)), "enable_prefix_caching": True}
    return Preset(name=preset_name(model.name), model=model.path, description=description,
                  args=args, startup_timeout=900)
