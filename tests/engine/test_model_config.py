"""ModelConfig from HF config.json dicts, GGUF metadata and the shipped model_configs assets."""

from __future__ import annotations

import json

import pytest

from homelab_llm.engine.model.config import (
    ModelLoadError,
    UnsupportedModelError,
    config_from_gguf,
    config_from_hf,
)
from homelab_llm.engine.model.loader import load_model_config, resolve_format

BASE = dict(model_type="llama", vocab_size=1000, hidden_size=256, intermediate_size=512,
            num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2)


def test_llama_defaults_and_derived_head_dim():
    cfg = config_from_hf({**BASE, "eos_token_id": 7, "bos_token_id": 1})
    assert cfg.architecture == "llama" and cfg.head_dim == 32
    assert cfg.eos_token_ids == (7,) and cfg.bos_token_id == 1
    assert cfg.rope_scaling is None and not cfg.attention_bias and not cfg.qk_norm


def test_eos_list_explicit_head_dim_and_llama3_scaling():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = config_from_hf({**BASE, "head_dim": 64, "eos_token_id": [128001, 128009],
                          "rope_theta": 500000.0, "rope_scaling": scaling})
    assert cfg.head_dim == 64 and cfg.q_size == 512 and cfg.kv_size == 128
    assert cfg.eos_token_ids == (128001, 128009)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"


def test_old_and_new_rope_spellings():
    old = config_from_hf({**BASE, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert old.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    # transformers >= 5 writes rope_parameters with the theta inside
    new = config_from_hf({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert new.rope_theta == 1e6 and new.rope_scaling is None
    with pytest.raises(UnsupportedModelError, match="longrope.*supported: default"):
        config_from_hf({**BASE, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})


def test_family_flags():
    qwen2 = config_from_hf({**BASE, "model_type": "qwen2", "tie_word_embeddings": True})
    assert qwen2.attention_bias and qwen2.tie_word_embeddings and not qwen2.qk_norm
    qwen3 = config_from_hf({**BASE, "model_type": "qwen3", "attention_bias": False})
    assert qwen3.qk_norm and not qwen3.attention_bias
    mistral = config_from_hf({**BASE, "model_type": None, "architectures": ["MistralForCausalLM"]})
    assert mistral.architecture == "mistral"


def test_bad_configs_are_user_errors():
    with pytest.raises(ModelLoadError, match="'hidden_size' is missing"):
        config_from_hf({k: v for k, v in BASE.items() if k != "hidden_size"})
    with pytest.raises(ModelLoadError, match="not a multiple"):
        config_from_hf({**BASE, "num_key_value_heads": 3})
    with pytest.raises(UnsupportedModelError, match="hidden activation 'relu'"):
        config_from_hf({**BASE, "model_type": "qwen2", "use_sliding_window": True,
                        "sliding_window": 64, "hidden_act": "relu"})


def test_sliding_window_layers_follow_each_family():
    qwen2 = config_from_hf({**BASE, "model_type": "qwen2", "use_sliding_window": True,
                            "sliding_window": 64, "max_window_layers": 1, "num_hidden_layers": 3})
    assert qwen2.sliding_layers == (1, 2) and qwen2.layer_window(0) == 0 and qwen2.layer_window(2) == 64
    off = config_from_hf({**BASE, "model_type": "qwen2", "use_sliding_window": False, "sliding_window": 64})
    assert off.sliding_layers == () and off.sliding_window == 0
    mistral = config_from_hf({**BASE, "model_type": "mistral", "sliding_window": 32, "num_hidden_layers": 2})
    assert mistral.sliding_layers == (0, 1) == mistral.full_attention_layers
    assert config_from_hf({**BASE, "model_type": "mistral", "sliding_window": None}).sliding_layers == ()


def test_gguf_metadata_keys():
    meta = {"general.architecture": "qwen3", "qwen3.embedding_length": 1024,
            "qwen3.attention.head_count": 16, "qwen3.attention.head_count_kv": 8,
            "qwen3.attention.key_length": 128, "qwen3.feed_forward_length": 3072,
            "qwen3.block_count": 28, "qwen3.context_length": 40960,
            "qwen3.rope.freq_base": 1e6, "qwen3.attention.layer_norm_rms_epsilon": 1e-6,
            "qwen3.rope.scaling.type": "yarn", "qwen3.rope.scaling.factor": 4.0,
            "qwen3.rope.scaling.original_context_length": 32768,
            "tokenizer.ggml.tokens": range(151936), "tokenizer.ggml.eos_token_id": 151645,
            "tokenizer.ggml.eot_token_id": 151645}
    cfg = config_from_gguf(meta, {"token_embd.weight", "blk.0.attn_q_norm.weight"}, "q.gguf")
    assert (cfg.architecture, cfg.head_dim, cfg.vocab_size) == ("qwen3", 128, 151936)
    assert cfg.qk_norm and cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.eos_token_ids == (151645,)
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 32768}
    with pytest.raises(ModelLoadError, match="qwen3.block_count is missing"):
        config_from_gguf({k: v for k, v in meta.items() if k != "qwen3.block_count"}, set(), "q")


def test_smollm2_gguf_config(smollm2_path):
    cfg = load_model_config(smollm2_path)
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.vocab_size, cfg.intermediate_size) == (49152, 1536)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert cfg.eos_token_ids == (2,) and cfg.quantization["format"] == "gguf"


@pytest.mark.parametrize("name,shape", [
    ("SmolLM2-135M", (30, 576, 9, 3, 64, 49152)),
    ("Qwen3-0.6B", (28, 1024, 16, 8, 128, 151936)),
    ("Qwen3-8B", (36, 4096, 32, 8, 128, 151936)),
    ("Llama-3.1-8B", (32, 4096, 32, 8, 128, 128256)),
    ("Qwen3-32B", (64, 5120, 64, 8, 128, 151936)),
])
def test_shipped_model_configs(model_configs_dir, name, shape):
    path = model_configs_dir / f"{name}.json"
    assert resolve_format(path) == "dummy"
    cfg = load_model_config(path, "dummy")
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == shape
    assert json.loads(path.read_text())["model_type"] == cfg.architecture


QWEN35_TEXT = dict(model_type="qwen3_5_text", vocab_size=128, hidden_size=64, intermediate_size=96,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                   linear_value_head_dim=8, linear_conv_kernel_dim=4)


def test_qwen3_5_transformers5_layout_with_text_config():
    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    raw = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
           "tie_word_embeddings": True, "vision_config": {"depth": 2},
           "text_config": {**QWEN35_TEXT, "rope_parameters": rope, "mamba_ssm_dtype": "float32",
                           "full_attention_interval": 2, "eos_token_id": 5}}
    cfg = config_from_hf(raw)
    assert cfg.architecture == "qwen3_5" and cfg.is_hybrid and cfg.tie_word_embeddings
    assert cfg.layer_types == ("linear_attention", "full_attention") * 2
    assert cfg.full_attention_layers == (1, 3) and cfg.linear_attention_layers == (0, 2)
    assert cfg.rope_theta == 1e7 and cfg.rope_scaling is None and cfg.partial_rotary_factor == 0.25
    assert cfg.qk_norm and cfg.attn_output_gate and cfg.state_dtype == "float32"
    assert cfg.linear_conv_dim == 2 * 16 + 32 and cfg.eos_token_ids == (5,)


def test_qwen3_5_old_layout_and_bad_layer_type():
    old = config_from_hf({**QWEN35_TEXT, "rope_theta": 5e6, "partial_rotary_factor": 0.5,
                          "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]},
                          "layer_types": ["linear_attention"] * 3 + ["full_attention"]})
    assert old.rope_theta == 5e6 and old.partial_rotary_factor == 0.5 and old.rope_scaling is None
    assert old.full_attention_layers == (3,)
    with pytest.raises(UnsupportedModelError, match="layer type 'sliding_attention'"):
        config_from_hf({**QWEN35_TEXT, "layer_types": ["sliding_attention"] * 4})
    with pytest.raises(ModelLoadError, match="linear_num_value_heads"):
        config_from_hf({**QWEN35_TEXT, "linear_num_value_heads": 3})
