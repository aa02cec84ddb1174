"""gpt-oss (gpt_oss): Llama's pre-norm decoder with biased q/k/v/o projections, per-head attention
sinks, alternating sliding (128) / full attention layers (config.layer_types), YaRN RoPE, and a
mixture of experts on every layer (layers/moe_gptoss.py: biased router and experts, clamped
SwiGLU). Checkpoint names follow transformers 5 (`mlp.router`, `mlp.experts.gate_up_proj`...).

The published checkpoints hold the experts in MXFP4 (`gate_up_proj_blocks` + `_scales`,
[E, out, in / 32, 16] and [E, out, in / 32], quant_method "mxfp4"): those stay resident in MXFP4
(config.experts_mxfp4; about 13 GB for 20B instead of 42 GB in bf16) and the fused MoE kernels
decode them in registers. combine_checkpoint dequantizes a pair at load only when the config does
not announce MXFP4 (a checkpoint mixing the two layouts).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

from homelab_llm.engine.kernels.moe_gptoss_ref import dequantize_mxfp4_ref

from homelab_llm.engine.layers.moe_gptoss import GptOssMoe
from homelab_llm.engine.model.config import ModelConfig, ModelLoadError
from homelab_llm.engine.model.llama import LlamaForCausalLM


class GptOssForCausalLM(LlamaForCausalLM):
    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        return GptOssMoe(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                         config.moe_intermediate_size, config.swiglu_alpha, config.swiglu_limit,
                         mxfp4=config.experts_mxfp4)

    def combine_checkpoint(self, weights: Iterator[tuple[str, torch.Tensor, Any]]
                           ) -> Iterator[tuple[str, torch.Tensor, Any]]:
        """Each MXFP4 `X_blocks` + `X_scales` pair -> `X` dequantized, unless the experts stay
        MXFP4 (see module docstring)."""
        if self.config.experts_mxfp4:
            yield from weights
            return
        pending: dict[str, dict[str, torch.Tensor]] = {}
        dtype = self.model.embed_tokens.weight.dtype
        for name, tensor, blocks in weights:
            base, _, kind = name.rpartition("_")
            if kind not in ("blocks", "scales") or tensor is None:
                yield name, tensor, blocks
                continue
            pair = pending.setdefault(base, {})
            pair[kind] = tensor
            if len(pair) == 2:
                del pending[base]
                try:
                    dense = dequantize_mxfp4_ref(pair["blocks"], pair["scales"], dtype)
                except ValueError as err:
                    raise ModelLoadError(f"tensor {base}: {err}") from None
                yield base, dense.transpose(-1, -2).contiguous(), None
        if pending:
            raise ModelLoadError(f"MXFP4 tensors without their pair: {sorted(pending)[:3]}")
