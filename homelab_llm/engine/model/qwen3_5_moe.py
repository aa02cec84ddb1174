"""Qwen3.5 / Qwen3.6 MoE (35B-A3B class): the Qwen3.5 hybrid decoder (Gated DeltaNet and gated
attention layers, model/qwen3_5.py) with a mixture of experts and a sigmoid-gated shared expert
as every layer's MLP (layers/moe.py). The router always renormalises its top-k.

Checkpoint names are Qwen3.5's (`model.language_model.*` or `model.*`) plus `mlp.gate`,
`mlp.experts.*` (per expert or fused), `mlp.shared_expert.{gate,up,down}_proj` and
`mlp.shared_expert_gate`; the loader routes the expert tensors for every family.
"""

from __future__ import annotations

from torch import nn

from homelab_llm.engine.model.config import ModelConfig
from homelab_llm.engine.model.qwen3_5 import Qwen3_5ForCausalLM
from homelab_llm.engine.model.qwen3_moe import sparse_moe_block


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        return sparse_moe_block(config)
