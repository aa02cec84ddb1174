"""gpt-oss (gpt_oss): Llama's pre-norm decoder with biased q/k/v/o projections, per-head attention
sinks, alternating sliding (128) / full attention layers (config.layer_types), YaRN RoPE, and a
mixture of experts on every layer (layers/moe_gptoss.py: biased router and experts, clamped
SwiGLU). Checkpoint names follow transformers 5 (`mlp.router`, `mlp.experts.gate_up_proj`...).
"""

from __future__ import annotations

from torch import nn

from homelab_llm.engine.layers.moe_gptoss import GptOssMoe
from homelab_llm.engine.model.config import ModelConfig
from homelab_llm.engine.model.llama import LlamaForCausalLM


class GptOssForCausalLM(LlamaForCausalLM):
    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        return GptOssMoe(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                         config.moe_intermediate_size, config.swiglu_alpha, config.swiglu_limit)
