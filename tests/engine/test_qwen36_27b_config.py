"""assets/model_configs/Qwen3.6-27B.json: the published shape, in the layout transformers 5
writes for Qwen3_5ForCausalLM, read alike by our parser and by transformers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from hybrid_reference import transformers_config
from homelab_llm.engine.model.config import config_from_hf
from homelab_llm.hwcheck.plan_command import model_configs_dir
from tests.engine.hybrid_shapes import QWEN36_27B

ASSET = model_configs_dir() / "Qwen3.6-27B.json"
SHAPE_FIELDS = [f.name for f in dataclasses.fields(QWEN36_27B)
                if f.name not in ("name", "eos_token_ids", "bos_token_id", "extra", "quantization")]


def test_asset_parses_to_the_published_shape() -> None:
    config = config_from_hf(json.loads(ASSET.read_text()), name="Qwen3.6-27B")
    for field in SHAPE_FIELDS:
        assert getattr(config, field) == getattr(QWEN36_27B, field), field
    assert config.eos_token_ids == (248044,) and not config.tie_word_embeddings
    assert config.full_attention_layers == tuple(range(3, 64, 4))


def test_transformers_reads_the_same_shape(tmp_path: Path) -> None:
    hf = transformers_config(ASSET, tmp_path, "Qwen3_5TextConfig")
    assert (hf.hidden_size, hf.num_hidden_layers, hf.intermediate_size, hf.vocab_size) == (
        5120, 64, 17408, 248320)
    assert (hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == (24, 4, 256)
    assert (hf.linear_num_key_heads, hf.linear_num_value_heads) == (16, 48)
    assert (hf.linear_key_head_dim, hf.linear_value_head_dim, hf.linear_conv_kernel_dim) == (128, 128, 4)
    assert tuple(hf.layer_types) == QWEN36_27B.layer_types
    assert hf.rope_parameters["rope_theta"] == 1e7
    assert hf.rope_parameters["partial_rotary_factor"] == 0.25
