"""Hybrid (Gated DeltaNet + attention) model shapes for planner and layout tests, built directly
as ModelConfig so the tests do not depend on config.json parsing."""

from __future__ import annotations

from homelab_llm.engine.model.config import LAYER_FULL, LAYER_LINEAR, ModelConfig

# Qwen3.6-27B as published: 64 layers, every 4th full attention (3, 7, ..., 63).
QWEN36_27B = ModelConfig(
    architecture="qwen3_5", vocab_size=248320, hidden_size=5120, intermediate_size=17408,
    num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
    rope_theta=1e7, max_position_embeddings=262144, qk_norm=True, torch_dtype="bfloat16",
    name="Qwen3.6-27B",
    layer_types=tuple(LAYER_FULL if (i + 1) % 4 == 0 else LAYER_LINEAR for i in range(64)),
    linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, partial_rotary_factor=0.25,
    attn_output_gate=True, state_dtype="float32", mtp_num_hidden_layers=1,
)
