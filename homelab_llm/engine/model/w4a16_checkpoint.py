"""GPTQ, AutoRound and AWQ safetensors checkpoints loaded as W4A16.

Which checkpoint modules are 4-bit is read from the tensors themselves (a `.qweight` next to
`.scales`, ...); quantization_config (model/quant_config.py) supplies how each one is stored
and is checked against them. A linear of ours whose every fused part is 4-bit keeps 4-bit
weights and never exists densely on the device: its placeholder weight stays on the meta
device, each part is repacked (kernels/w4a16_pack.py) as its tensors stream past, cut to this
rank's shard, and the parts are concatenated along the outputs. Anything else (a part excluded
by a `dynamic` rule, a tied quantized lm_head, fused parts whose act-order permutations differ) is
dequantized into an ordinary dense weight. On a GPU an untied quantized lm_head stays 4-bit
(keeps_head_4bit; ParallelLMHead.install_w4: its vocab shard, the logits through the W4A16
kernels); the CPU dequantizes it (its default then keeps an int8 head, its exact mode fp32).

Tensor parallelism cuts the packed weight on group boundaries: column-parallel layers take
whole output columns (any split), row-parallel ones whole input groups; a split that is not a
multiple of the group size is an UnsupportedModelError naming the layer and the sizes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from homelab_llm.engine.kernels.w4a16_pack import (
    QuantFormatError,
    W4Weight,
    repack_awq,
    repack_gptq,
)
from homelab_llm.engine.layers.linear import LinearBase
from homelab_llm.engine.layers.moe import FusedExperts, expert_target
from homelab_llm.engine.model.config import ModelLoadError, UnsupportedModelError
from homelab_llm.engine.model.quant_config import (
    CheckpointQuant,
    LayerQuant,
    check_layer,
    parse_quant_config,
)
from homelab_llm.engine.model.w4a16_experts import ExpertAssembler, expert_prefixes

log = logging.getLogger(__name__)

QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


def quantized_modules(keys: set[str]) -> dict[str, set[str]]:
    """checkpoint module -> the quantized-tensor suffixes it has, for modules with a qweight."""
    found: dict[str, set[str]] = {}
    for key in sorted(keys):  # sorted: errors name the same module on every run
        prefix, _, suffix = key.rpartition(".")
        if suffix in QUANT_SUFFIXES:
            found.setdefault(prefix, set()).add(suffix)
    return {prefix: suffixes for prefix, suffixes in found.items() if "qweight" in suffixes}


def repack_module(prefix: str, tensors: dict[str, torch.Tensor], layer: LayerQuant,
                  device: torch.device, where: str) -> W4Weight:
    """One checkpoint module's qweight/qzeros/scales/g_idx -> W4Weight of the full weight."""
    t = {k: v.to(device) for k, v in tensors.items()}
    if "scales" not in t:
        raise ModelLoadError(f"{where}: {prefix}.qweight has no {prefix}.scales beside it")
    try:
        if layer.packing == "awq":
            if "qzeros" not in t:
                raise QuantFormatError("AWQ weight without qzeros")
            return repack_awq(t["qweight"], t["qzeros"], t["scales"], layer.group_size)
        return repack_gptq(t["qweight"], t.get("qzeros"), t["scales"], layer.group_size,
                           t.get("g_idx"), layer.sym, zero_offset=layer.packing == "gptq")
    except QuantFormatError as err:
        raise ModelLoadError(f"{where}: {prefix}: {err}") from None


def dense_weight(w: W4Weight) -> torch.Tensor:
    """[out, in] float32 in the checkpoint's input order (act-order permutation undone)."""
    from homelab_llm.engine.kernels.ref import dequantize_w4_ref

    kn = dequantize_w4_ref(w)
    if w.perm is not None:
        restored = torch.empty_like(kn)
        restored[w.perm] = kn
        kn = restored
    return kn.t()


def _span(cut: slice, total: int) -> tuple[int, int]:
    start = cut.start or 0
    return start, (total if cut.stop is None else cut.stop) - start


def shard_for_rank(module: LinearBase, shard_id: Any, w: W4Weight, prefix: str) -> W4Weight:
    """This rank's slice of a full part weight, as the module's weight_loader would cut it."""
    rows, cols, dest = module.shard_slices(module.weight, shard_id)
    start, length = _span(rows, w.out_features)
    if (start, length) != (0, w.out_features):
        w = w.narrow_out(start, length)
    start, length = _span(cols, w.in_features)
    if (start, length) != (0, w.in_features):
        tp = getattr(module, "tp_size", 1)
        if w.perm is not None:
            raise UnsupportedModelError(
                f"{prefix}: act-order (desc_act) weights cannot be split along their input over "
                f"--tensor-parallel-size {tp}; use a checkpoint quantized without desc_act")
        if start % w.group_size or length % w.group_size:
            raise UnsupportedModelError(
                f"{prefix}: --tensor-parallel-size {tp} gives this rank input features "
                f"[{start}, {start + length}) of {w.in_features}, which cut through its "
                f"quantization groups ({w.in_features} inputs in {w.in_features // w.group_size} "
                f"groups of {w.group_size}); a row-parallel shard must hold whole groups")
        w = w.narrow_in(start, length)
    if (w.out_features, w.in_features) != tuple(dest.shape):
        raise ModelLoadError(f"{prefix}: 4-bit weight is {w.out_features}x{w.in_features} "
                             f"(out x in) but this layer's shard is {tuple(dest.shape)}")
    return w


def fuse_parts(parts: list[W4Weight]) -> W4Weight | None:
    """Parts concatenated along the outputs, in the finest group size among them; None when
    their act-order permutations differ (one input order cannot serve them all)."""
    first = parts[0].perm
    for p in parts[1:]:
        if (p.perm is None) != (first is None) or (first is not None and not torch.equal(p.perm, first)):
            return None
    if len(parts) == 1:
        return parts[0]
    group = min(p.group_size for p in parts)
    parts = [p.regroup(group) for p in parts]
    return W4Weight(torch.cat([p.qweight for p in parts], dim=1),
                    torch.cat([p.scales for p in parts], dim=1),
                    torch.cat([p.biases for p in parts], dim=1), group, first)


@dataclass
class _Assembler:
    """Collects each 4-bit linear's parts (full weights, as stored) and installs this rank's
    shard of them once all have arrived."""

    model: nn.Module
    device: torch.device
    dtype: torch.dtype
    pending: dict[str, dict[Any, tuple[str, W4Weight]]] = field(default_factory=dict)

    def add(self, module_name: str, shard_id: Any, w: W4Weight,
            prefix: str) -> list[tuple[str, torch.Tensor]]:
        """Record one part; returns dense (checkpoint name, weight) pairs for the ordinary
        loader when the module has to stay dense after all."""
        module = self.model.get_submodule(module_name)
        parts = self.pending.setdefault(module_name, {})
        parts[shard_id] = (prefix, w)
        if len(parts) < len(module.part_ids()):
            return []
        ordered = [parts[sid] for sid in module.part_ids()]
        del self.pending[module_name]
        shards = [shard_for_rank(module, sid, w, p) for sid, (p, w) in zip(module.part_ids(), ordered)]
        fused = fuse_parts(shards)
        if fused is not None:
            module.set_w4(fused, self.dtype)
            return []
        log.warning("%s: its fused parts have different act-order permutations; loading it "
                    "dequantized to %s", module_name, self.dtype)
        module.materialize(self.device, self.dtype)
        return [(_weight_name(p), dense_weight(w)) for p, w in ordered]


def _weight_name(prefix: str) -> str:
    """`module.weight`, or `module.weight#part` for one part of a split checkpoint tensor."""
    module, _, part = prefix.partition("#")
    return f"{module}.weight#{part}" if part else f"{module}.weight"


def _checkpoint_parts(model: nn.Module, module_name: str, module: LinearBase) -> list[str]:
    from homelab_llm.engine.model.w4a16 import checkpoint_names

    return [n.removesuffix(".weight") for n in checkpoint_names(model, module_name, module)]


def _route(model: nn.Module, prefix: str, w: W4Weight) -> list[tuple[str, Any, W4Weight]]:
    """checkpoint module (our naming) -> [(our module, shard_id, its part of w)], through the
    fused-module table; a tensor holding several parts (split_modules) gives one per part."""
    parts = prefix.split(".")
    if parts[-1] in model.split_modules:
        split = model.split_modules[parts[-1]]
        module = ".".join(parts[:-1] + [split.fused])
        if w.out_features != split.rows:
            raise ModelLoadError(f"{prefix}: {w.out_features} outputs, expected {split.rows}")
        # Grouped parts (Qwen3-Next) gather their column spans; one source, so one act order.
        return [(module, shard_id, fuse_parts([w.narrow_out(s, n) for s, n in spans]))
                for shard_id, spans in split.spans()]
    if parts[-1] in model.packed_modules:
        fused, shard_id = model.packed_modules[parts[-1]]
        return [(".".join(parts[:-1] + [fused]), shard_id, w)]
    return [(prefix, None, w)]


def keeps_head_4bit(model: nn.Module, device: torch.device) -> bool:
    """A checkpoint's 4-bit lm_head is installed as it is (not dequantized): an untied head on
    a GPU."""
    return device.type != "cpu" and not model.config.tie_word_embeddings


def load_quantized_checkpoint(model: nn.Module, folder: Path, quant_config: dict[str, Any],
                              device: torch.device, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor, Any]]:
    """Prepare `model` (built under deferred_weights) and return what the ordinary loader should
    load: every dense checkpoint tensor, plus dequantized weights for 4-bit modules that stay
    dense. 4-bit linears are repacked and installed as their tensors go by."""
    from homelab_llm.engine.model.safetensors_files import safetensors_keys, safetensors_weights

    where = str(folder)
    keys = safetensors_keys(folder)
    quantized = quantized_modules(keys)
    names = {k.rpartition(".")[0] for k in keys}
    quant: CheckpointQuant | None = parse_quant_config(quant_config, f"{folder}/config.json", names)
    if quant is None:
        raise ModelLoadError(f"{where}: no quantization_config in config.json")
    layers: dict[str, LayerQuant] = {}
    for prefix in quantized:
        layer = quant.layer(prefix)
        if layer is None:
            raise ModelLoadError(f"{where}: {prefix} is stored 4-bit (qweight) but its "
                                 "quantization_config rules leave it unquantized")
        check_layer(prefix, layer)
        layers[prefix] = layer

    # Checkpoint module names in our naming (e.g. Qwen3.5's model.language_model.* -> model.*).
    ours = {model.checkpoint_name(p): p for p in quantized}
    four_bit: set[str] = set()  # our modules whose every part is 4-bit
    for name, module in model.named_modules():
        if isinstance(module, FusedExperts):  # stacked experts: all 4-bit, or all dense
            if all(p in ours for p in expert_prefixes(name, module)):
                four_bit.add(name)
            else:
                module.materialize(device, dtype)
            continue
        if not isinstance(module, LinearBase):
            continue
        if all(p in ours for p in _checkpoint_parts(model, name, module)):
            four_bit.add(name)
        else:
            module.materialize(device, dtype)
    if not four_bit:
        raise ModelLoadError(f"{where}: quantization_config is set but no linear layer of the "
                             "model is stored 4-bit (no *.qweight tensors for them)")
    assembler = _Assembler(model, device, dtype)
    experts = ExpertAssembler(model)

    def tensors() -> Iterator[tuple[str, torch.Tensor, Any]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in safetensors_weights(folder):
            prefix, _, suffix = name.rpartition(".")
            if prefix not in quantized or suffix not in QUANT_SUFFIXES:
                yield name, tensor, None
                continue
            got = pending.setdefault(prefix, {})
            got[suffix] = tensor
            if len(got) < len(quantized[prefix]):
                continue
            w = repack_module(prefix, pending.pop(prefix), layers[prefix], device, where)
            our_prefix = model.checkpoint_name(prefix)
            if our_prefix is None:
                continue  # not ours to load (a vision tower, an MTP head)
            if our_prefix == "lm_head" and keeps_head_4bit(model, device):
                model.lm_head.install_w4(w)
                continue
            expert = expert_target(f"{our_prefix}.weight")
            if expert is not None and expert[0].rpartition(".")[0] in four_bit:
                experts.add(expert[0].rpartition(".")[0], expert[1], w, prefix)
                continue
            routes = _route(model, our_prefix, w)
            if routes[0][0] not in four_bit:
                # A 4-bit part of a dense layer (or lm_head): dequantize, load as usual.
                yield f"{prefix}.weight", dense_weight(w), None
                continue
            for module_name, shard_id, part in routes:
                label = f"{prefix}#{shard_id}" if len(routes) > 1 else prefix
                for dense_name, dense in assembler.add(module_name, shard_id, part, label):
                    yield dense_name, dense, None
        experts.check_done(where)

    # The model is ready (dense placeholders materialized) before the caller looks at its
    # parameters; the tensors stream when it iterates.
    return tensors()
