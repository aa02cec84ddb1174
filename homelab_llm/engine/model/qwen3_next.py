"""Qwen3-Next (Qwen3-Next-80B-A3B class): the Qwen3.5 hybrid decoder (model/qwen3_5.py: Gated
DeltaNet and gated attention layers, (1 + w) RMSNorms, partial rotary) with the Qwen3-MoE layer
rule (model/qwen3_moe.py: experts with a sigmoid-gated shared expert on config.moe_layers, a dense
MLP on mlp_only_layers / off the decoder_sparse_step), on `model.layers.*` checkpoints.

What differs from Qwen3.5 is only how Gated DeltaNet's projections are stored: `in_proj_qkvz`
holds q|k|v|z and `in_proj_ba` holds b|a, both interleaved per key head (transformers'
fix_query_key_value_ordering: for key head i the rows are q_i, k_i, then the v and z rows of its
num_v_heads / num_k_heads value heads; b|a likewise). They are cut into our contiguous parts as
they load (model/split_tensor.py), dense and 4-bit alike, before any tensor-parallel split, so
the layer itself is Qwen3.5's. `mtp.*` tensors (multi-token prediction) are not loaded.
"""

from __future__ import annotations

from torch import nn

from homelab_llm.engine.model.config import ModelConfig
from homelab_llm.engine.model.qwen3_5_moe import Qwen3_5MoeForCausalLM
from homelab_llm.engine.model.qwen3_moe import moe_or_dense_mlp
from homelab_llm.engine.model.split_tensor import SplitTensor


class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        return moe_or_dense_mlp(config, layer)

    @staticmethod
    def checkpoint_splits(config: ModelConfig) -> dict[str, SplitTensor]:
        kd, vd = config.linear_key_dim, config.linear_value_dim
        hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
        qkvz = (("q", kd), ("k", kd), ("v", vd), ("z", vd))
        return {"in_proj_qkvz": SplitTensor("in_proj_qkvz", qkvz, groups=hk),
                "in_proj_ba": SplitTensor("in_proj_ba", (("b", hv), ("a", hv)), groups=hk)}
