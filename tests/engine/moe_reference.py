"""Tiny random transformers Qwen3-MoE checkpoints for the MoE tests (fp32, saved as safetensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Layer 1 is dense (mlp_only_layers) so the mixed sparse/dense stack is exercised; 8 experts,
# top 2, renormalised; a wide initializer so a wrong routing moves the logits visibly.
TINY_MOE: dict[str, Any] = dict(
    vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[1], max_position_embeddings=256, rms_norm_eps=1e-6,
    tie_word_embeddings=False, initializer_range=0.3,
    rope_parameters=dict(rope_type="default", rope_theta=1e6),
)


def make_hf_moe(folder: Path, seed: int = 0, **overrides: Any):
    """A random fp32 Qwen3MoeForCausalLM saved into folder; returned (eval mode)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(**{**TINY_MOE, **overrides})
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():  # q/k norms start at 1; router at 0 in some versions: randomise both
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0.0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def make_hf_hybrid_moe(model_cls: str, config_cls: str, folder: Path, seed: int = 0,
                       **overrides: Any):
    """A random transformers hybrid MoE (hybrid layers + experts + gated shared expert) of
    model_cls / config_cls saved to folder, fp32 eval (an override of None drops that key).
    Norms, decays and routers are randomised so each is exercised."""
    import transformers

    from hybrid_reference import TEXT_SHAPE, perturb_hybrid

    torch.manual_seed(seed)
    shape = dict(TEXT_SHAPE, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                 num_experts=8, num_experts_per_tok=2, initializer_range=0.1)
    shape.update(overrides)
    shape = {k: v for k, v in shape.items() if v is not None}
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**shape))
    perturb_hybrid(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.normal_(0.0, 0.5)
    model.float().eval()
    model.save_pretrained(folder)
    return model


def make_hf_qwen3_5_moe(folder: Path, seed: int = 0, **overrides: Any):
    """Qwen3_5MoeForCausalLM: every layer sparse (the family has no dense MLP size)."""
    overrides.setdefault("intermediate_size", None)
    return make_hf_hybrid_moe("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", folder, seed,
                              **overrides)


def make_hf_qwen3_next(folder: Path, seed: int = 0, **overrides: Any):
    """Qwen3NextForCausalLM: fused per-key-head in_proj_qkvz / in_proj_ba; layer 1 a dense MLP
    (mlp_only_layers) unless overridden."""
    overrides.setdefault("mlp_only_layers", [1])
    return make_hf_hybrid_moe("Qwen3NextForCausalLM", "Qwen3NextConfig", folder, seed, **overrides)
