"""Parameter counts (total and active per token) from tensor headers, never from weights.

A safetensors file starts with an 8-byte little-endian header length and a JSON header naming
every tensor's dtype and shape; a GGUF header lists tensor shapes (gguf_reader). Counting
shapes is exact for any architecture, including ones the engine cannot run, which is what a
model list needs. Invariants:
- packed 4-bit weights (GPTQ/AWQ/AutoRound int32 `qweight`) count the values they pack; their
  scales, zero points and g_idx are storage, not parameters;
- routed experts (HF `.experts.`, GGUF `_exps`) count once in total and top_k / num_experts of
  them in active; shared experts are always active.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_QUANT_STORAGE_SUFFIXES = (".qzeros", ".scales", ".g_idx", ".zeros")
_HF_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_HEADER_LIMIT = 100 << 20  # a sane safetensors header is a few MB; more means a corrupt file


class HeaderError(ValueError):
    """A safetensors header that cannot be read; the caller adds the path."""


@dataclass(frozen=True)
class ParamCount:
    total: int
    active: int  # equals total for a dense model

    @property
    def is_moe(self) -> bool:
        return self.active < self.total


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """{tensor name: {"dtype", "shape", "data_offsets"}} (the __metadata__ entry removed)."""
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise HeaderError("shorter than a safetensors header")
            (size,) = struct.unpack("<Q", head)
            if size > _HEADER_LIMIT:
                raise HeaderError(f"header length {size} is implausible")
            body = f.read(size)
    except OSError as err:
        raise HeaderError(str(err)) from None
    if len(body) < size:
        raise HeaderError("the header ends early")
    try:
        header = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HeaderError(f"the header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise HeaderError("the header is not a JSON object")
    header.pop("__metadata__", None)
    return header


def _routed_share(top_k: Any, num_experts: Any) -> float:
    try:
        k, n = int(top_k), int(num_experts)
    except (TypeError, ValueError):
        return 1.0
    return k / n if 0 < k <= n else 1.0


def count_tensors(tensors: Iterable[tuple[str, int]], expert_marker: str, routed_share: float
                  ) -> ParamCount:
    """(name, element count) pairs -> totals; names containing expert_marker are routed experts."""
    dense = experts = 0
    for name, numel in tensors:
        if expert_marker in name:
            experts += numel
        else:
            dense += numel
    return ParamCount(dense + experts, dense + round(experts * routed_share))


def hf_params(files: Iterable[Path], config: Mapping[str, Any]) -> ParamCount:
    """Parameters of an HF checkpoint from its safetensors headers and config.json."""
    quant = config.get("quantization_config") or {}
    bits = int(quant.get("bits") or quant.get("w_bit") or 4) if quant else 16
    num_experts = next((config[k] for k in _HF_EXPERTS_KEYS if config.get(k)), None)
    share = _routed_share(config.get("num_experts_per_tok"), num_experts) if num_experts else 1.0

    def elements() -> Iterable[tuple[str, int]]:
        for path in files:
            for name, info in read_safetensors_header(path).items():
                if name.endswith(_QUANT_STORAGE_SUFFIXES):
                    continue
                numel = math.prod(info.get("shape") or [1])
                if name.endswith(".qweight") and info.get("dtype") == "I32":
                    numel *= 32 // bits
                yield name, numel

    return count_tensors(elements(), ".experts.", share)


def gguf_params(tensor_shapes: Iterable[tuple[str, tuple[int, ...]]], meta: Mapping[str, Any]
                ) -> ParamCount:
    """Parameters of a GGUF file from its tensor infos and metadata (expert counts per arch)."""
    arch = meta.get("general.architecture", "")
    share = _routed_share(meta.get(f"{arch}.expert_used_count"), meta.get(f"{arch}.expert_count"))
    return count_tensors(((n, math.prod(s or (1,))) for n, s in tensor_shapes), "_exps", share)
