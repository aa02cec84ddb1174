"""assets/model_configs/Qwen3-Next-80B-A3B.json: the published shape (config.json of
Qwen/Qwen3-Next-80B-A3B-Instruct, transformers 4.57 layout) read alike by our parser and by
transformers 5; its parameter counts, tensor-parallel sizes and `plan`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from hybrid_reference import transformers_config
from homelab_llm.engine import memory
from homelab_llm.engine.model.config import LAYER_FULL, LAYER_LINEAR, config_from_hf
from homelab_llm.engine.sharding import ShardingError, check_tp_size, required_splits, valid_tp_sizes
from homelab_llm.hwcheck.plan_command import model_configs_dir, render_plan

ASSET = model_configs_dir() / "Qwen3-Next-80B-A3B.json"


@pytest.fixture(scope="module")
def config():
    return config_from_hf(json.loads(ASSET.read_text()), name=ASSET.stem)


def test_asset_parses_to_the_published_shape(config) -> None:
    assert config.architecture == "qwen3_next" and config.is_hybrid and config.is_moe
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (2048, 48, 151936)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (16, 2, 256)
    assert (config.linear_num_key_heads, config.linear_num_value_heads) == (16, 32)
    assert (config.linear_key_head_dim, config.linear_value_head_dim) == (128, 128)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (512, 10, 512)
    assert config.shared_expert_intermediate_size == 512 and config.norm_topk_prob
    assert config.layer_types == (LAYER_LINEAR, LAYER_LINEAR, LAYER_LINEAR, LAYER_FULL) * 12
    assert config.moe_layers == tuple(range(48))
    assert (config.partial_rotary_factor, config.rope_theta, config.attn_output_gate) == (0.25, 1e7, True)
    assert config.eos_token_ids == (151645,) and not config.tie_word_embeddings


def test_transformers_reads_the_same_shape(tmp_path: Path, config) -> None:
    hf = transformers_config(ASSET, tmp_path, "Qwen3NextConfig")
    assert tuple(hf.layer_types) == config.layer_types
    assert (hf.num_experts, hf.num_experts_per_tok, hf.head_dim) == (512, 10, 256)
    assert hf.rope_parameters["rope_theta"] == config.rope_theta
    assert hf.rope_parameters["partial_rotary_factor"] == config.partial_rotary_factor


def test_parameter_counts_match_the_model_card(config) -> None:
    """Published: 80B in total (79B without embeddings), 3B activated (3.25B without them)."""
    count = memory.parameter_count(config)
    embeddings = 2 * config.vocab_size * config.hidden_size
    assert 79.0e9 < count.total - embeddings < 79.1e9
    assert 3.2e9 < count.active - embeddings < 3.3e9
    fp32_extra = 36 * 2 * 32 * 2  # A_log and dt_bias of the 36 GDN layers are float32
    assert 2 * count.total == memory.weight_bytes(config, "bfloat16", None, 1) - fp32_extra


def test_tensor_parallel_sizes(config) -> None:
    assert valid_tp_sizes(config) == [1, 2, 4, 8, 16]
    # Every layer is sparse: the dense MLP size is not split, whatever it is.
    odd = dataclasses.replace(config, intermediate_size=5121)
    assert "MLP intermediate size" not in [s.name for s in required_splits(odd)]
    assert valid_tp_sizes(odd) == [1, 2, 4, 8, 16]
    dense_layer = dataclasses.replace(odd, mlp_only_layers=(0,))
    assert valid_tp_sizes(dense_layer) == [1]
    with pytest.raises(ShardingError, match=r"--tensor-parallel-size 3 cannot split this model: .*"
                                            r"the linear-attention key heads \(16\) is not divisible by 3.*"
                                            r"valid sizes: 1, 2, 4, 8, 16"):
        check_tp_size(config, 3)


def test_plan_w4a16_tp2_shows_active_parameters(config) -> None:
    plan = memory.plan(config, gpu_memory_bytes=48 << 30, tensor_parallel_size=2,
                       quantization="w4a16", kv_cache_dtype="int8", max_model_len=32768,
                       max_num_seqs=8)
    assert 20e9 < plan.per_device[0].weights_bytes < 23e9  # all 512 experts resident, 4-bit
    assert not plan.warnings and plan.max_concurrency["32768"] >= 8
    assert plan.to_json()["active_parameters"] == memory.parameter_count(config).active
    text = render_plan(plan)
    assert "parameters: 79.7B, 3.9B active per token (all experts resident)" in text
