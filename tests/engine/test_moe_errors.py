"""Bad MoE checkpoints and configs: one clear error naming the tensor or key."""

from __future__ import annotations

import shutil

import pytest
import torch

from homelab_llm.engine.model.config import ModelLoadError, config_from_hf
from model_reference import load_ours
from moe_reference import TINY_MOE, make_hf_moe, make_hf_qwen3_next


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_next"])
def folder(tmp_path_factory, request):
    """Every layer sparse, router [8, 64], experts of 32 (Qwen3-Next: hybrid, fused GDN)."""
    path = tmp_path_factory.mktemp(f"{request.param}_src")
    if request.param == "qwen3_moe":
        make_hf_moe(path, num_hidden_layers=2, mlp_only_layers=[])
    else:
        make_hf_qwen3_next(path, mlp_only_layers=[])
    return path


def rewrite_checkpoint(src, dst, edit):
    """src's checkpoint with edit(tensors) applied, written to dst with src's config."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(tensors, str(dst / "model.safetensors"))


def test_missing_expert_tensor_is_named(folder, tmp_path):
    rewrite_checkpoint(folder, tmp_path, lambda t: t.pop("model.layers.1.mlp.experts.5.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.experts\.w13\[up_proj of expert 5\]"):
        load_ours(tmp_path)


def test_router_shape_mismatch_is_named(folder, tmp_path):
    def shrink(t):
        t["model.layers.0.mlp.gate.weight"] = t["model.layers.0.mlp.gate.weight"][:6].clone()
    rewrite_checkpoint(folder, tmp_path, shrink)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mlp\.gate\.weight: router weight "
                                             r"is \(6, 64\), expected \(8, 64\)"):
        load_ours(tmp_path)


def test_expert_shape_mismatch_is_named(folder, tmp_path):
    def widen(t):
        name = "model.layers.0.mlp.experts.2.down_proj.weight"
        t[name] = torch.zeros(64, 40)
    rewrite_checkpoint(folder, tmp_path, widen)
    with pytest.raises(ModelLoadError, match=r"experts\.2\.down_proj\.weight: down_proj of expert 2"):
        load_ours(tmp_path)


def _raw(**over):
    raw = {"model_type": "qwen3_moe", **{k: v for k, v in TINY_MOE.items() if k != "rope_parameters"}}
    raw.update(over)
    return raw


def test_transformers5_num_local_experts_and_text_config_layouts():
    raw = _raw()
    raw["num_local_experts"] = raw.pop("num_experts")
    assert config_from_hf(raw).num_experts == 8
    nested = {"architectures": ["Qwen3MoeForCausalLM"], "text_config": _raw(),
              "quantization_config": None}
    cfg = config_from_hf(nested)
    assert cfg.architecture == "qwen3_moe" and cfg.moe_intermediate_size == 32
    old = config_from_hf(_raw(rope_theta=1e6))
    new = config_from_hf(_raw(rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert old.rope_theta == new.rope_theta == 1e6


@pytest.mark.parametrize("key,value,message", [
    ("num_experts_per_tok", 0, "num_experts_per_tok must be positive"),
    ("num_experts_per_tok", 9, r"num_experts_per_tok \(9\) exceeds num_experts \(8\)"),
    ("moe_intermediate_size", 0, "moe_intermediate_size must be positive"),
])
def test_bad_moe_config_values(key, value, message):
    with pytest.raises(ModelLoadError, match=message):
        config_from_hf(_raw(**{key: value}))


def test_sparse_step_and_dense_layers():
    cfg = config_from_hf(_raw(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert cfg.moe_layers == (1,)
    assert not config_from_hf(_raw(norm_topk_prob=False)).norm_topk_prob
