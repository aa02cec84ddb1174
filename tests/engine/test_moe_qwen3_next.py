"""Qwen3-Next specifics: the per-key-head split of its fused GDN projections, its config layouts,
a bad fused tensor named, MTP tensors skipped, the models screen. Shared with the other hybrid
MoE: parity with transformers (test_moe_qwen3_5.py), TP=2 == TP=1 (test_moe_tp.py), a missing
expert / router shape mismatch (test_moe_errors.py), W4A16 (test_w4a16_qwen3_next.py).
"""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.model.config import LAYER_FULL, LAYER_LINEAR, ModelLoadError, config_from_hf
from homelab_llm.engine.model.loader import load_model, load_model_config
from homelab_llm.engine.model.split_tensor import SplitTensor
from moe_reference import make_hf_qwen3_next
from test_moe_errors import rewrite_checkpoint

@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_next")
    return folder, make_hf_qwen3_next(folder)


def test_grouped_split_matches_the_reference_ordering():
    """SplitTensor with groups cuts rows as transformers' fix_query_key_value_ordering does."""
    hk, r, dk, dv = 2, 3, 2, 4
    rows = torch.arange(hk * (2 * dk + 2 * r * dv)).float().unsqueeze(1)
    split = SplitTensor("in_proj_qkvz", (("q", hk * dk), ("k", hk * dk), ("v", hk * r * dv),
                                         ("z", hk * r * dv)), groups=hk)
    per_head = rows.view(hk, -1)
    want = torch.split(per_head, [dk, dk, r * dv, r * dv], dim=1)
    for (name, got), ref in zip(split.take(rows), want):
        assert torch.equal(got.view(-1), ref.reshape(-1)), name
    with pytest.raises(ValueError, match="do not split into 4 groups"):
        SplitTensor("in_proj_ba", (("b", 6), ("a", 6)), groups=4)


PUBLISHED = {  # the old (transformers 4.57) layout, as Qwen3-Next-80B-A3B's config.json
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 320,
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 8, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "full_attention_interval": 4,
    "partial_rotary_factor": 0.25, "rope_theta": 10000000, "rope_scaling": None,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "num_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
}


def test_old_and_transformers5_config_layouts():
    old = config_from_hf(PUBLISHED)
    assert old.layer_types == (LAYER_LINEAR,) * 3 + (LAYER_FULL,) + (LAYER_LINEAR,) * 3 + (LAYER_FULL,)
    assert (old.rope_theta, old.partial_rotary_factor, old.attn_output_gate) == (1e7, 0.25, True)
    assert old.moe_layers == tuple(range(8)) and old.norm_topk_prob and old.qk_norm
    new = {k: v for k, v in PUBLISHED.items()
           if k not in ("full_attention_interval", "rope_theta", "rope_scaling", "partial_rotary_factor")}
    new.update(layer_types=list(old.layer_types), rope_parameters={
        "rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25})
    assert config_from_hf(new) == old
    sparse_step = config_from_hf({**PUBLISHED, "decoder_sparse_step": 2, "mlp_only_layers": [5]})
    assert sparse_step.moe_layers == (1, 3, 7)


def test_fused_projection_shape_mismatch_is_named(folder, tmp_path):
    src, _ = folder

    def shrink(t):
        name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
        t[name] = t[name][:-8].clone()
    rewrite_checkpoint(src, tmp_path, shrink)
    with pytest.raises(ModelLoadError, match=r"in_proj_qkvz\.weight: 88 rows, expected 96"):
        load_model(load_model_config(tmp_path), tmp_path, "auto", torch.float32, "cpu")


def test_models_screen_describes_it(folder):
    """`homelab-llm models` (and the TUI's models screen) list it as a family the engine runs,
    with its active parameters."""
    from homelab_llm.models.describe import describe_hf

    path, hf = folder
    described = describe_hf(path)
    assert described.family == "qwen3_next" and described.supported, described.reason
    assert described.params_total == sum(p.numel() for p in hf.parameters())
    assert described.params_active < described.params_total


def test_mtp_tensors_are_not_loaded(folder, tmp_path):
    """Multi-token-prediction weights (mtp.*, experts included) ride along in the published
    checkpoints; the model loads without them and ignores them."""
    src, _ = folder

    def add_mtp(t):
        t["mtp.fc.weight"] = torch.zeros(64, 128)
        t["mtp.layers.0.mlp.experts.0.up_proj.weight"] = torch.zeros(32, 64)
    rewrite_checkpoint(src, tmp_path, add_mtp)
    load_model(load_model_config(tmp_path), tmp_path, "auto", torch.float32, "cpu")
