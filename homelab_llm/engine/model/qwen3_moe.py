"""Qwen3-MoE (Qwen3-30B-A3B class): the Qwen3 decoder (q/k norm, GQA, RoPE) with a mixture of
experts in place of the dense MLP on the sparse layers (config.moe_layers); other layers keep a
dense MLP of intermediate_size.

Checkpoint names: `mlp.gate.weight` is the router; experts arrive one tensor each
(`mlp.experts.<e>.{gate,up,down}_proj.weight`) or fused (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]); both land in the stacked parameters of layers/moe.py. A shared
expert (`mlp.shared_expert.*`, `mlp.shared_expert_gate.weight`) is built when the config has one.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from homelab_llm.engine.layers.moe import ExpertPart, FusedExperts, SparseMoeBlock
from homelab_llm.engine.model.config import ModelConfig
from homelab_llm.engine.model.llama import LlamaForCausalLM, LlamaMLP

# checkpoint leaf under mlp.experts -> (our stacked parameter, its projection)
_EXPERT_PROJ = {"gate_proj": ("w13", "gate"), "up_proj": ("w13", "up"), "down_proj": ("w2", "down"),
                "gate_up_proj": ("w13", "gate_up")}


def sparse_moe_block(config: ModelConfig) -> SparseMoeBlock:
    """The MoE MLP of one sparse layer, with the config's shared expert if it has one."""
    shared = (LlamaMLP(config, config.shared_expert_intermediate_size)
              if config.has_shared_expert else None)
    return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                          config.moe_intermediate_size, config.norm_topk_prob, shared)


def expert_weight_target(name: str) -> tuple[str, ExpertPart] | None:
    """`...mlp.experts.3.gate_proj.weight` / `...mlp.experts.gate_up_proj` -> (param, part);
    None for a tensor that is not an expert weight."""
    parts = name.split(".")
    if "experts" not in parts:
        return None
    at = parts.index("experts")
    rest = parts[at + 1:]
    if len(rest) == 3 and rest[0].isdigit() and rest[2] == "weight" and rest[1] in _EXPERT_PROJ:
        param, proj = _EXPERT_PROJ[rest[1]]
        return ".".join(parts[:at + 1] + [param]), ExpertPart(proj, int(rest[0]))
    if len(rest) == 1 and rest[0] in ("gate_up_proj", "down_proj"):
        param, proj = _EXPERT_PROJ[rest[0]]
        return ".".join(parts[:at + 1] + [param]), ExpertPart(proj)
    return None


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        if layer in config.moe_layers:
            return sparse_moe_block(config)
        return LlamaMLP(config)

    def weight_target(self, name: str) -> tuple[str, Any]:
        return expert_weight_target(name) or super().weight_target(name)

    def weight_parts(self, param_name: str) -> list[Any]:
        module_name, _, leaf = param_name.rpartition(".")
        module = self.get_submodule(module_name)
        if isinstance(module, FusedExperts):
            return list(module.part_ids(leaf))
        return super().weight_parts(param_name)

    def loaded_parts(self, param_name: str, shard_id: Any) -> list[Any]:
        if isinstance(shard_id, ExpertPart):
            return shard_id.covers(self.config.num_experts)
        return super().loaded_parts(param_name, shard_id)
