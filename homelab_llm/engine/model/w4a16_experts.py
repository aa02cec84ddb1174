"""GPTQ / AutoRound / AWQ mixture-of-experts checkpoints: 4-bit expert weights stacked for the
fused MoE kernels (kernels/moe_ref.MoeW4), never dense on the device.

A quantized checkpoint stores each expert's projections as their own 4-bit modules
(`mlp.experts.<e>.gate_proj.qweight`, ...). As they stream past (w4a16_checkpoint.py repacks
each into a W4Weight), ExpertAssembler cuts this rank's shard (gate/up: output columns of the
intermediate slice; down: its input rows, whole quantization groups only), and once all 3 * E
parts of a layer have arrived, fuses gate with up per expert and stacks the experts.

Rules: act-order (desc_act) expert weights are refused (one input permutation per expert would
need a gather per expert in the kernel); differing group sizes are regrouped to the finest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from homelab_llm.engine.kernels.moe_ref import MoeW4
from homelab_llm.engine.kernels.w4a16_pack import W4Weight
from homelab_llm.engine.layers.moe import ExpertPart, FusedExperts
from homelab_llm.engine.model.config import ModelLoadError, UnsupportedModelError


def expert_prefixes(name: str, experts: FusedExperts) -> list[str]:
    """The checkpoint modules (per-expert layout) that make up one FusedExperts."""
    return [f"{name}.{e}.{proj}_proj" for e in range(experts.num_experts)
            for proj in ("gate", "up", "down")]


def shard_expert(experts: FusedExperts, part: ExpertPart, w: W4Weight, prefix: str) -> W4Weight:
    """This rank's slice of one expert projection, checked against the layer's shape."""
    if w.perm is not None:
        raise UnsupportedModelError(f"{prefix}: act-order (desc_act) expert weights are not "
                                    "supported; use a checkpoint quantized without desc_act")
    start, inter = experts.inter_start, experts.intermediate_local
    full, hidden = inter * experts.tp_size, experts.hidden_size
    expected = (full, hidden) if part.proj == "down" else (hidden, full)
    if (w.in_features, w.out_features) != expected:
        raise ModelLoadError(f"{prefix}: 4-bit weight is {w.out_features}x{w.in_features} "
                             f"(out x in), expected {expected[1]}x{expected[0]}")
    if part.proj != "down":
        return w.narrow_out(start, inter) if experts.tp_size > 1 else w
    if experts.tp_size == 1:
        return w
    if start % w.group_size or inter % w.group_size:
        raise UnsupportedModelError(
            f"{prefix}: --tensor-parallel-size {experts.tp_size} gives each rank {inter} of the "
            f"expert's {full} intermediate features, which cut through its quantization groups "
            f"of {w.group_size}; a row-parallel shard must hold whole groups")
    return w.narrow_in(start, inter)


def _stack(parts: list[W4Weight]) -> W4Weight:
    """Experts' weights (same shape) on a leading E dimension, in the finest group size."""
    group = min(p.group_size for p in parts)
    parts = [p.regroup(group) for p in parts]
    bias_dtype = torch.float32 if any(p.biases.dtype == torch.float32 for p in parts) else torch.float16
    return W4Weight(torch.stack([p.qweight for p in parts]),
                    torch.stack([p.scales for p in parts]),
                    torch.stack([p.biases.to(bias_dtype) for p in parts]), group)


def _fuse_gate_up(gate: W4Weight, up: W4Weight) -> W4Weight:
    group = min(gate.group_size, up.group_size)
    gate, up = gate.regroup(group), up.regroup(group)
    bias_dtype = torch.promote_types(gate.biases.dtype, up.biases.dtype)
    return W4Weight(torch.cat([gate.qweight, up.qweight], dim=1),
                    torch.cat([gate.scales, up.scales], dim=1),
                    torch.cat([gate.biases.to(bias_dtype), up.biases.to(bias_dtype)], dim=1), group)


@dataclass
class ExpertAssembler:
    model: nn.Module
    pending: dict[str, dict[ExpertPart, W4Weight]] = field(default_factory=dict)

    def add(self, module_name: str, part: ExpertPart, w: W4Weight, prefix: str) -> None:
        experts = self.model.get_submodule(module_name)
        parts = self.pending.setdefault(module_name, {})
        parts[part] = shard_expert(experts, part, w, prefix)
        if len(parts) < 3 * experts.num_experts:
            return
        del self.pending[module_name]
        e_range = range(experts.num_experts)
        w13 = _stack([_fuse_gate_up(parts[ExpertPart("gate", e)], parts[ExpertPart("up", e)])
                      for e in e_range])
        w2 = _stack([parts[ExpertPart("down", e)] for e in e_range])
        experts.set_w4(MoeW4(w13, w2))

    def check_done(self, where: str) -> None:
        """Every started layer got all its experts (else the loader's missing list names them)."""
        for name, parts in self.pending.items():
            experts = self.model.get_submodule(name)
            missing = [f"{name}.{p.expert}.{p.proj}_proj" for p in
                       experts.part_ids("w13") + experts.part_ids("w2") if p not in parts]
            raise ModelLoadError(f"{where}: {len(missing)} 4-bit expert weights are missing "
                                 f"(e.g. {', '.join(missing[:5])})")
