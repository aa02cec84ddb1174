"""A tiny Llama decoder layer for the fused-decode-path tests (test_dense_gemv_layer.py,
test_w4a16_layer.py): random weights, norms near 1, and its attention replaced by a fixed map of
qkv, so a test isolates the norm / projection wiring (attention has its own kernel tests)."""

from __future__ import annotations

import torch

from homelab_llm.engine.model.config import ModelConfig
from homelab_llm.engine.model.llama import LlamaDecoderLayer


def stub_layer(hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, seed: int,
               **flags) -> LlamaDecoderLayer:
    """The bf16 layer (on the CPU; `flags`: ModelConfig's hidden_act, attention_bias, qk_norm)."""
    config = ModelConfig(
        architecture="llama", vocab_size=64, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=64, torch_dtype="bfloat16", name="tiny", **flags)
    layer = LlamaDecoderLayer(config)
    gen = torch.Generator().manual_seed(seed)
    for name, p in layer.named_parameters():
        if "norm" in name:
            p.data = torch.rand(p.shape, generator=gen) + 0.5
        else:
            p.data = torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5
    layer = layer.to(torch.bfloat16)
    attn = layer.self_attn

    def attend(qkv: torch.Tensor, rope, o_proj=None):  # stands in for rope + attention (LlamaAttention.attend)
        q = qkv[:, :attn.q_size] * 0.5 + qkv[:, attn.q_size:attn.q_size + head_dim].repeat(1, heads)
        return (o_proj or attn.o_proj)(q.contiguous())

    attn.attend = attend
    return layer
