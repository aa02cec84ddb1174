"""What a Gated DeltaNet layer (Qwen3.5/3.6 hybrids) costs one rank: parameters and working memory.

engine/memory.py sums these next to the attention and MLP terms; shapes per rank come from the
same StateLayout the state pool uses (key/value heads split evenly across ranks).

Parameters of one GDN layer (HF names):
- in_proj_qkv (hidden -> q, k, v channels of the conv; column-parallel by heads),
  in_proj_z (hidden -> value_dim), in_proj_b and in_proj_a (hidden -> one scalar per value head),
  out_proj (value_dim -> hidden; row-parallel);
- conv1d (one kernel of W taps per channel), A_log and dt_bias (one per value head), and the gated
  RMSNorm weight (one value head wide, replicated).

W4A16 assumption (AutoRound/GPTQ builds of this family): in_proj_qkv, in_proj_z and out_proj are
4-bit; in_proj_b and in_proj_a (one output column per value head: too narrow for 4-bit to pay, so
assumed left 16-bit by the checkpoint's extra_config/dynamic rules), conv1d, A_log, dt_bias and the
norms stay dense. A build that quantizes b/a too is ~17 MB per card smaller than planned (27B, TP=2);
so is `--load-format dummy --quantization w4a16`, which packs every linear. A_log and dt_bias are float32 (the engine keeps the decay math in fp32); every
other parameter is in the model dtype.

Working memory of a prefill of T tokens (an estimate; the engine measures the real peak):
- model-dtype tensors per token: residual and normed input, the qkv projection and its conv
  output, z, the core output and its gated norm, the out-projection, a and b;
- float32 per token and value head, for the chunked delta rule: q, k, v (k heads broadcast to the
  value heads), the WY factors w and u, the corrected values, one row of the chunk's attention
  matrix, the cumulative decay and beta;
- float32 per chunk: the recurrent state at every chunk boundary (value heads x Dk x Dv).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from homelab_llm.engine.cache.state_layout import StateLayout
from homelab_llm.engine.model.config import ModelConfig

# Tokens per chunk of the chunked gated-delta-rule prefill kernel.
GDN_CHUNK_SIZE = 64
FP32_BYTES = 4


@dataclass(frozen=True)
class LinearShape:
    name: str
    in_features: int
    out_features: int
    quantized: bool  # 4-bit under W4A16


def gdn_linears(config: ModelConfig, layout: StateLayout) -> list[LinearShape]:
    """The projections of one GDN layer as one rank holds them."""
    h = config.hidden_size
    channels = layout.conv_shape[1]
    hv = layout.value_heads_per_rank
    value = hv * config.linear_value_head_dim
    return [
        LinearShape("in_proj_qkv", h, channels, True),
        LinearShape("in_proj_z", h, value, True),
        LinearShape("in_proj_b", h, hv, False),
        LinearShape("in_proj_a", h, hv, False),
        LinearShape("out_proj", value, h, True),
    ]


def gdn_small_param_bytes(config: ModelConfig, layout: StateLayout, dtype_size: int) -> int:
    """conv1d taps and the gated-norm weight (model dtype), A_log and dt_bias (float32) of one
    GDN layer on one rank."""
    channels = layout.conv_shape[1]
    model_dtype = channels * config.linear_conv_kernel_dim + config.linear_value_head_dim
    return model_dtype * dtype_size + 2 * layout.value_heads_per_rank * FP32_BYTES


def gdn_param_count(config: ModelConfig) -> int:
    """Parameters of one whole GDN layer (all ranks together): the projections, conv taps,
    A_log, dt_bias and the gated-norm weight."""
    layout = StateLayout.for_model(config, 1, "float32")
    linears = sum(p.in_features * p.out_features for p in gdn_linears(config, layout))
    return (linears + layout.conv_shape[1] * config.linear_conv_kernel_dim
            + 2 * layout.value_heads_per_rank + config.linear_value_head_dim)


def gdn_activation_bytes(config: ModelConfig, layout: StateLayout, tokens: int,
                         dtype_size: int) -> int:
    """Peak working memory of one GDN layer's prefill of `tokens` tokens on one rank."""
    h = config.hidden_size
    hv = layout.value_heads_per_rank
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    channels = layout.conv_shape[1]
    value = hv * dv
    model_dtype_elems = 2 * h + 2 * channels + 3 * value + h + 2 * hv
    fp32_elems = hv * ((2 * dk + dv) + dk + 2 * dv + GDN_CHUNK_SIZE + 2)
    per_token = model_dtype_elems * dtype_size + fp32_elems * FP32_BYTES
    chunk_states = math.ceil(tokens / GDN_CHUNK_SIZE) * layout.recurrent_bytes_per_layer
    return tokens * per_token + chunk_states
