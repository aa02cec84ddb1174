"""What a quantized HF checkpoint says about its weights: config.json's quantization_config for
GPTQ (AutoGPTQ / GPTQModel), AutoRound and AWQ, read into one `CheckpointQuant`.

Per-module rules follow the tools that wrote the checkpoint (and vLLM, which reads them):
- GPTQModel `dynamic`: {pattern: overrides}, tried in order, first match wins, `re.match` on the
  module name. "-:pattern" leaves matching modules unquantized (they are stored as plain
  weights); "+:pattern" or a bare pattern overrides bits / group_size / sym / desc_act.
- AutoRound `extra_config`: {module name or regex: {bits, group_size, sym, data_type}}; an exact
  name wins, then regex keys in order (`re.search`); bits >= 16 means unquantized.
Rules are matched against checkpoint (unfused) names, e.g. model.layers.0.self_attn.q_proj,
since that is what the quantizer saw when it wrote the tensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from homelab_llm.engine.model.config import ModelLoadError, UnsupportedModelError

SUPPORTED_METHODS = ("gptq", "auto-round", "awq")
SUPPORTED_BITS = (4,)
GPTQ_CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
_METHOD_ALIASES = {"gptq": "gptq", "auto-round": "auto-round", "intel/auto-round": "auto-round",
                   "autoround": "auto-round", "awq": "awq"}
_DENSE_BITS = 16


@dataclass(frozen=True)
class LayerQuant:
    """How one checkpoint module's weight is stored. packing: "gptq" (GPTQ v1: zeros stored
    minus one), "gptq_v2" (zeros as they are) or "awq" (AWQ GEMM layout)."""

    bits: int
    group_size: int  # -1: one group per output column
    sym: bool
    desc_act: bool
    packing: str


@dataclass(frozen=True)
class _Rule:
    pattern: re.Pattern[str]
    exclude: bool
    overrides: Mapping[str, Any]
    search: bool  # AutoRound regex keys search anywhere; GPTQModel patterns match at the start


@dataclass(frozen=True)
class CheckpointQuant:
    method: str  # one of SUPPORTED_METHODS
    default: LayerQuant
    rules: tuple[_Rule, ...] = ()
    exact: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # AutoRound by name
    skip: tuple[str, ...] = ()  # AWQ modules_to_not_convert (substrings)

    def layer(self, name: str) -> LayerQuant | None:
        """The storage of checkpoint module `name` (no .weight suffix); None: unquantized."""
        if any(s and s in name for s in self.skip):
            return None
        overrides: Mapping[str, Any] | None = self.exact.get(name)
        if overrides is None:
            for rule in self.rules:
                hit = rule.pattern.search(name) if rule.search else rule.pattern.match(name)
                if hit:
                    if rule.exclude:
                        return None
                    overrides = rule.overrides
                    break
        if not overrides:
            return self.default
        d = self.default
        bits = int(overrides.get("bits", d.bits))
        if bits >= _DENSE_BITS:
            return None
        data_type = str(overrides.get("data_type", "int"))
        if not data_type.startswith("int"):
            raise UnsupportedModelError(
                f"{name}: data_type {data_type!r} is not supported; W4A16 loads int weights")
        return LayerQuant(bits, int(overrides.get("group_size", d.group_size)),
                          bool(overrides.get("sym", d.sym)),
                          bool(overrides.get("desc_act", d.desc_act)), d.packing)


def _int(raw: Mapping[str, Any], keys: tuple[str, ...], default: int, where: str) -> int:
    for key in keys:
        if raw.get(key) is not None:
            try:
                return int(raw[key])
            except (TypeError, ValueError):
                raise ModelLoadError(f"{where}: quantization_config.{key} must be an integer, "
                                     f"got {raw[key]!r}") from None
    return default


def _compile(pattern: str, where: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as err:
        raise ModelLoadError(f"{where}: quantization rule {pattern!r} is not a valid regex ({err})") from None


def check_layer(name: str, layer: LayerQuant) -> None:
    """Raise for a module stored in a way W4A16 cannot load."""
    if layer.bits not in SUPPORTED_BITS:
        raise UnsupportedModelError(
            f"{name}: {layer.bits}-bit weights are not supported; W4A16 loads 4-bit GPTQ, "
            "AutoRound and AWQ weights (exclude the module from quantization to keep it 16-bit)")
    if layer.group_size != -1 and (layer.group_size <= 0 or layer.group_size % 32):
        raise UnsupportedModelError(
            f"{name}: group_size {layer.group_size} is not supported; use 32, 64, 128, "
            "another multiple of 32, or -1")


def parse_quant_config(raw: Mapping[str, Any] | None, where: str = "config.json",
                       module_names: set[str] | None = None) -> CheckpointQuant | None:
    """quantization_config -> CheckpointQuant; None when there is none (or it is GGUF's marker).
    module_names (the checkpoint's linear modules) tells AutoRound's exact extra_config keys
    from its regex keys, as auto-round does; without it only exact keys apply."""
    if not raw or raw.get("format") == "gguf":
        return None
    method_raw = str(raw.get("quant_method") or "").lower().replace("_", "-")
    method = _METHOD_ALIASES.get(method_raw)
    if method is None:
        raise UnsupportedModelError(
            f"{where}: quantization method {raw.get('quant_method')!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_METHODS)} (4-bit, as W4A16)")
    bits = _int(raw, ("bits", "w_bit"), 4, where)
    group = _int(raw, ("group_size", "q_group_size"), 128, where)
    sym = bool(raw.get("sym", True))
    desc_act = bool(raw.get("desc_act", False))
    rules: list[_Rule] = []
    exact: dict[str, Mapping[str, Any]] = {}
    skip: tuple[str, ...] = ()
    if method == "gptq":
        fmt = str(raw.get("checkpoint_format") or raw.get("format") or "gptq").lower()
        if fmt not in GPTQ_CHECKPOINT_FORMATS:
            raise UnsupportedModelError(
                f"{where}: GPTQ checkpoint_format {fmt!r} is not supported; "
                f"supported: {', '.join(GPTQ_CHECKPOINT_FORMATS)}")
        packing = fmt
        for pattern, overrides in (raw.get("dynamic") or {}).items():
            exclude = pattern.startswith("-:")
            body = pattern[2:] if pattern.startswith(("-:", "+:")) else pattern
            rules.append(_Rule(_compile(body, where), exclude, dict(overrides or {}), False))
    elif method == "auto-round":
        data_type = str(raw.get("data_type") or "int")
        if not data_type.startswith("int"):
            raise UnsupportedModelError(
                f"{where}: AutoRound data_type {data_type!r} is not supported; W4A16 loads int weights")
        from homelab_llm.engine.kernels.w4a16_pack import QuantFormatError, autoround_packing

        try:
            packing = autoround_packing(raw.get("packing_format") or raw.get("backend"))
        except QuantFormatError as err:
            raise UnsupportedModelError(f"{where}: {err}") from None
        for key, overrides in (raw.get("extra_config") or {}).items():
            exact[key] = dict(overrides or {})
            if module_names is not None and key not in module_names:  # a regex key
                rules.append(_Rule(_compile(key, where), False, exact[key], True))
    else:  # awq
        version = str(raw.get("version") or "gemm").lower()
        if version != "gemm":
            raise UnsupportedModelError(
                f"{where}: AWQ version {version!r} is not supported; supported: gemm")
        if not raw.get("zero_point", True):
            raise UnsupportedModelError(f"{where}: AWQ without zero points is not supported")
        packing, sym = "awq", False
        skip = tuple(raw.get("modules_to_not_convert") or ())
    default = LayerQuant(bits, group, sym, desc_act, packing)
    check_layer(f"{where}: quantization_config", default)
    return CheckpointQuant(method, default, tuple(rules), exact, skip)
