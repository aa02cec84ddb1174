"""Qwen3-MoE (Qwen3-30B-A3B class): the Qwen3 decoder (q/k norm, GQA, RoPE) with a mixture of
experts in place of the dense MLP on the sparse layers (config.moe_layers); other layers keep a
dense MLP of intermediate_size.

Checkpoint names: `mlp.gate.weight` is the router; experts arrive one tensor each
(`mlp.experts.<e>.{gate,up,down}_proj.weight`) or fused (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]); both land in the stacked parameters of layers/moe.py. A shared
expert (`mlp.shared_expert.*`, `mlp.shared_expert_gate.weight`) is built when the config has one.
"""

from __future__ import annotations

from torch import nn

from homelab_llm.engine.layers.moe import SparseMoeBlock
from homelab_llm.engine.model.config import ModelConfig
from homelab_llm.engine.model.llama import LlamaForCausalLM, LlamaMLP


def sparse_moe_block(config: ModelConfig) -> SparseMoeBlock:
    """The MoE MLP of one sparse layer, with the config's shared expert if it has one."""
    shared = (LlamaMLP(config, config.shared_expert_intermediate_size)
              if config.has_shared_expert else None)
    return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                          config.moe_intermediate_size, config.norm_topk_prob, shared)


def moe_or_dense_mlp(config: ModelConfig, layer: int) -> nn.Module:
    """HF's rule for Qwen3-MoE and Qwen3-Next: experts on config.moe_layers, a dense MLP of
    intermediate_size on the others (mlp_only_layers, decoder_sparse_step)."""
    return sparse_moe_block(config) if layer in config.moe_layers else LlamaMLP(config)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Llama's decoder and weight routing; only the MLP of the sparse layers differs (the
    loader routes expert tensors for every family through layers.moe.expert_target)."""

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        return moe_or_dense_mlp(config, layer)
