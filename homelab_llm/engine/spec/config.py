"""--speculative-config: vLLM's JSON flag, parsed and checked into a SpeculativeConfig.

`{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N, "prompt_lookup_min": M}`
or `{"method": "mtp", "num_speculative_tokens": K}`. As in vLLM, an n-gram config without lookup
bounds uses 5 for both, and one bound alone sets the other. Every error is one line naming the flag.
Either method takes vLLM's `"disable_by_batch_size": B`: a step with more than B running
sequences drafts nothing (a verify row costs more as the batch grows: docs/BENCHMARKS.md 45.2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from homelab_llm.errors import HomelabError

METHODS = ("ngram", "mtp")
MAX_SPECULATIVE_TOKENS = 16  # a verify step computes K+1 positions per sequence
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"}
FLAG = "--speculative-config"


class SpeculativeConfigError(HomelabError, ValueError):
    """A bad --speculative-config value."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 0  # ngram only
    prompt_lookup_min: int = 0
    disable_by_batch_size: int = 0  # > 0: no drafts in a step with more running sequences

    def drafts_in_batch(self, running: int) -> bool:
        """Whether a step with this many running sequences drafts at all."""
        return not self.disable_by_batch_size or running <= self.disable_by_batch_size


def verify_width(config: SpeculativeConfig | None) -> int:
    """Rows a verify step gives each sequence: its last token and K drafts (1: no speculation)."""
    return 1 + (config.num_speculative_tokens if config else 0)


def _positive_int(data: dict[str, Any], key: str, default: int | None) -> int:
    value = data.get(key, default)
    if value is None:
        raise SpeculativeConfigError(f"{FLAG} needs \"{key}\" (a positive integer)")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpeculativeConfigError(f"{FLAG} \"{key}\" must be a positive integer, got {value!r}")
    return value


def parse_speculative_config(text: str | dict[str, Any] | None) -> SpeculativeConfig | None:
    """None (speculation off) for an empty value; else the checked config."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return None
    if isinstance(text, str):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise SpeculativeConfigError(
                f"{FLAG} is not valid JSON ({err.msg}); e.g. "
                "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'") from err
    else:
        data = text
    if not isinstance(data, dict):
        raise SpeculativeConfigError(f"{FLAG} must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise SpeculativeConfigError(
            f"{FLAG} has unknown key(s) {', '.join(unknown)}; use {', '.join(sorted(_KEYS))}")
    method = data.get("method")
    if method not in METHODS:
        raise SpeculativeConfigError(f"{FLAG} \"method\" must be one of {', '.join(METHODS)}, got {method!r}")
    k = _positive_int(data, "num_speculative_tokens", None)
    if k > MAX_SPECULATIVE_TOKENS:
        raise SpeculativeConfigError(
            f"{FLAG} \"num_speculative_tokens\" must be <= {MAX_SPECULATIVE_TOKENS}, got {k}")
    # null (vLLM's default) or absent: never disabled
    disable = _positive_int(data, "disable_by_batch_size", None) if data.get("disable_by_batch_size") is not None else 0
    if method == "mtp":
        extra = sorted({"prompt_lookup_max", "prompt_lookup_min"} & set(data))
        if extra:
            raise SpeculativeConfigError(f"{FLAG} {', '.join(extra)} only apply to method ngram")
        return SpeculativeConfig("mtp", k, disable_by_batch_size=disable)  # checkpoint: spec/mtp.py
    lo_given = data.get("prompt_lookup_min")
    if lo_given is not None:
        lo_given = _positive_int(data, "prompt_lookup_min", None)
    hi = _positive_int(data, "prompt_lookup_max", lo_given or 5)
    lo = lo_given or hi
    if lo > hi:
        raise SpeculativeConfigError(
            f"{FLAG} \"prompt_lookup_min\" ({lo}) must be <= \"prompt_lookup_max\" ({hi})")
    return SpeculativeConfig("ngram", k, hi, lo, disable)
