"""How many positions a model can address, and `--hf-overrides` that change what it says.

A model's positions are derived as vLLM derives them: max_position_embeddings; times the rope
factor under linear or dynamic-NTK scaling; original_max_position_embeddings times the factor
under YaRN; llama3 configs already state their long length. `--max-model-len` beyond that is
refused before any weight is loaded (the RoPE table has one row per position: a position past it
would be read out of bounds on the GPU). `--hf-overrides JSON` is merged into the HF config dict
before it is parsed (top-level keys replace, as vLLM's do), so `{"rope_scaling": {...}}` extends
the positions; a GGUF file takes the rope and length keys only.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from homelab_llm.engine.model.config import ModelConfig, normalize_rope_scaling
from homelab_llm.errors import HomelabError
# The keys --hf-overrides may set on a GGUF model (its config is not an HF dict).
GGUF_OVERRIDE_KEYS = ("rope_scaling", "rope_parameters", "rope_theta", "max_position_embeddings")


class ContextLimitError(HomelabError, ValueError):
    """--max-model-len beyond the model's positions, or a bad --hf-overrides; one line, with the fix."""


def max_positions(max_position_embeddings: int, scaling: Mapping[str, Any] | None) -> int:
    """The positions a model with this length and rope scaling can address (vLLM's rule)."""
    s = scaling or {}
    rope_type = s.get("rope_type", "default")
    if rope_type in ("linear", "dynamic"):
        return int(max_position_embeddings * float(s["factor"]))
    if rope_type == "yarn":
        original = int(s.get("original_max_position_embeddings") or max_position_embeddings)
        return int(original * float(s["factor"]))
    return max_position_embeddings


def model_max_positions(config: ModelConfig) -> int:
    return max_positions(config.max_position_embeddings, config.rope_scaling)


def rope_table_rows(max_position_embeddings: int, scaling: Mapping[str, Any] | None) -> int:
    """Rows of the RoPE table (layers/rotary.py): every position the model addresses, and never
    fewer than max_position_embeddings (a YaRN config may state more than original x factor)."""
    return max(max_position_embeddings, max_positions(max_position_embeddings, scaling))


def parse_hf_overrides(text: str | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """--hf-overrides: a JSON object (or a dict already); None when not given."""
    if text is None or isinstance(text, Mapping):
        return dict(text) if text else None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ContextLimitError(f"--hf-overrides is not valid JSON ({err.msg}); pass an object, "
                                f"e.g. '{{\"rope_scaling\": {{\"rope_type\": \"yarn\", "
                                f"\"factor\": 4.0}}}}'") from None
    if not isinstance(value, dict):
        raise ContextLimitError(f"--hf-overrides must be a JSON object, got {type(value).__name__}")
    return value or None


def override_hf_dict(raw: Mapping[str, Any], overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """An HF config dict with the overrides' top-level keys replacing its own. A rope_scaling
    override also replaces transformers-5's rope_parameters scaling (rope_theta is kept)."""
    out = dict(raw)
    if not overrides:
        return out
    out.update(overrides)
    if "rope_scaling" in overrides and "rope_parameters" not in overrides and "rope_parameters" in raw:
        theta = (raw.get("rope_parameters") or {}).get("rope_theta")
        out["rope_parameters"] = {"rope_theta": theta} if theta is not None else {}
    return out


def override_config(config: ModelConfig, overrides: Mapping[str, Any] | None,
                    where: str) -> ModelConfig:
    """A parsed config (GGUF metadata) with the rope and length overrides applied."""
    if not overrides:
        return config
    unknown = sorted(set(overrides) - set(GGUF_OVERRIDE_KEYS))
    if unknown:
        raise ContextLimitError(
            f"--hf-overrides {', '.join(unknown)}: a GGUF model takes only "
            f"{', '.join(GGUF_OVERRIDE_KEYS)}")
    changes: dict[str, Any] = {}
    params = dict(overrides.get("rope_parameters") or {})
    theta = overrides.get("rope_theta", params.pop("rope_theta", None))
    try:
        if theta is not None:
            changes["rope_theta"] = float(theta)
        if "max_position_embeddings" in overrides:
            changes["max_position_embeddings"] = int(overrides["max_position_embeddings"])
    except (TypeError, ValueError) as err:
        raise ContextLimitError(f"--hf-overrides: bad value ({err})") from None
    if "rope_scaling" in overrides or params:
        scaling = overrides.get("rope_scaling") or params
        changes["rope_scaling"] = normalize_rope_scaling(scaling, f"{where} (--hf-overrides)")
    return dataclasses.replace(config, **changes)


def check_max_model_len(asked: int | None, config: ModelConfig) -> int:
    """The context limit to serve: --max-model-len if the model's positions cover it, else a
    one-line ContextLimitError naming both numbers and the ways out."""
    limit = model_max_positions(config)
    if asked is None or asked <= limit:
        return limit if asked is None else asked
    native = config.max_position_embeddings
    factor = -(-asked // native)  # the smallest whole factor that covers it
    hint = json.dumps({"rope_scaling": {"rope_type": "yarn", "factor": float(factor),
                                        "original_max_position_embeddings": native}})
    raise ContextLimitError(
        f"--max-model-len {asked} is beyond the model's {limit} positions "
        f"({_positions_source(config)}); extend them with --hf-overrides '{hint}' "
        f"(if the model supports rope scaling) or use --max-model-len {limit} or less")


def _positions_source(config: ModelConfig) -> str:
    s = config.rope_scaling or {}
    rope_type = s.get("rope_type")
    if rope_type in ("linear", "dynamic"):
        return f"max_position_embeddings {config.max_position_embeddings} x {rope_type} factor {s['factor']}"
    if rope_type == "yarn":
        original = s.get("original_max_position_embeddings") or config.max_position_embeddings
        return f"original_max_position_embeddings {original} x yarn factor {s['factor']}"
    return "max_position_embeddings"
