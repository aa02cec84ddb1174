"""Context limits: --max-model-len beyond the model's positions is refused at startup with the way
out; --hf-overrides rope scaling extends them; the RoPE table covers every allowed position and
its frequencies match transformers' rope init functions."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch

from homelab_llm.engine.args import EngineArgs
from homelab_llm.engine.core import LLMEngine
from homelab_llm.engine.layers.rotary import RotaryEmbedding
from homelab_llm.engine.model.context_limit import (ContextLimitError, check_max_model_len,
                                                    max_positions, model_max_positions)
from homelab_llm.engine.model.loader import load_model_config
from homelab_llm.engine.sampling_params import SamplingParams
from tests.engine.engine_fixtures import assert_all_pages_free, write_config

REPO = Path(__file__).resolve().parents[2]
QWEN3_8B = REPO / "assets" / "model_configs" / "Qwen3-8B.json"
YARN_4 = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                           "original_max_position_embeddings": 32768}}


@pytest.mark.parametrize("scaling, expected", [
    (None, 4096),
    ({"rope_type": "linear", "factor": 2.0}, 8192),
    ({"rope_type": "dynamic", "factor": 4.0}, 16384),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}, 4096),
    ({"rope_type": "yarn", "factor": 2.0}, 8192),  # no original: max_position_embeddings
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 512}, 4096),  # llama3 configs state the long length
])
def test_positions_derived_like_vllm(scaling, expected) -> None:
    assert max_positions(4096, scaling) == expected


def test_qwen3_8b_refuses_131072_and_names_both_numbers_and_the_fix() -> None:
    config = load_model_config(QWEN3_8B, "dummy")
    with pytest.raises(ContextLimitError) as err:
        check_max_model_len(131072, config)
    message = str(err.value)
    assert "\n" not in message
    assert "--max-model-len 131072" in message and "40960 positions" in message
    assert "--hf-overrides" in message and "rope_scaling" in message
    assert "--max-model-len 40960 or less" in message
    # The suggested override is valid JSON that, applied, admits the asked length.
    hint = json.loads(message.split("--hf-overrides '")[1].split("'")[0])
    assert check_max_model_len(131072, load_model_config(QWEN3_8B, "dummy", hint)) == 131072
    assert check_max_model_len(None, config) == 40960
    assert check_max_model_len(8192, config) == 8192


def test_hf_overrides_yarn_extends_qwen3_8b() -> None:
    config = load_model_config(QWEN3_8B, "dummy", YARN_4)
    assert config.rope_scaling["rope_type"] == "yarn"
    assert model_max_positions(config) == 131072
    assert check_max_model_len(131072, config) == 131072
    with pytest.raises(ContextLimitError, match="131073 is beyond the model's 131072 positions"):
        check_max_model_len(131073, config)


def test_hf_overrides_flag_parses_json_and_rejects_bad_input() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--hf-overrides", json.dumps(YARN_4), "--max-model-len", "100"])
    args = EngineArgs.from_cli(argparse.Namespace(model="m", **vars(ns)))
    assert args.hf_overrides == YARN_4
    for bad, why in (("{not json", "not valid JSON"), ("[1, 2]", "must be a JSON object")):
        ns = parser.parse_args(["--hf-overrides", bad])
        with pytest.raises(ContextLimitError, match=why):
            EngineArgs.from_cli(argparse.Namespace(model="m", **vars(ns)))


def test_bad_rope_scaling_override_is_one_clear_error() -> None:
    from homelab_llm.engine.model.config import ModelLoadError, UnsupportedModelError

    with pytest.raises(ModelLoadError, match="needs factor"):
        load_model_config(QWEN3_8B, "dummy", {"rope_scaling": {"rope_type": "yarn"}})
    with pytest.raises(ModelLoadError, match="factor must be a number >= 1"):
        load_model_config(QWEN3_8B, "dummy", {"rope_scaling": {"rope_type": "linear", "factor": 0}})
    with pytest.raises(UnsupportedModelError, match="longrope"):
        load_model_config(QWEN3_8B, "dummy", {"rope_scaling": {"rope_type": "longrope", "factor": 2}})


def test_smollm2_gguf_refuses_16384_and_takes_an_override() -> None:
    from homelab_llm.assets import default_model_path

    try:
        gguf = default_model_path()
    except FileNotFoundError:
        pytest.skip("the embedded SmolLM2 GGUF is not installed")
    config = load_model_config(gguf)
    assert config.max_position_embeddings == 8192
    with pytest.raises(ContextLimitError, match="16384 is beyond the model's 8192 positions"):
        check_max_model_len(16384, config)
    linear = load_model_config(gguf, hf_overrides={"rope_scaling": {"type": "linear", "factor": 2}})
    assert check_max_model_len(16384, linear) == 16384
    with pytest.raises(ContextLimitError, match="a GGUF model takes only"):
        load_model_config(gguf, hf_overrides={"vocab_size": 5})


def test_engine_refuses_before_loading_and_serves_past_the_native_length(tmp_path) -> None:
    path = str(write_config(tmp_path))  # tiny Llama: 512 positions
    base = dict(model=path, load_format="dummy", device="cpu", dtype="float32", page_size=4,
                kv_cache_memory_bytes=1 << 20, max_num_batched_tokens=256)
    with pytest.raises(ContextLimitError, match="1024 is beyond the model's 512 positions"):
        LLMEngine(EngineArgs(**base, max_model_len=1024))
    engine = LLMEngine(EngineArgs(**base, max_model_len=1024, hf_overrides=json.dumps(
        {"rope_scaling": {"rope_type": "yarn", "factor": 2.0,
                          "original_max_position_embeddings": 512}})))
    assert engine.max_model_len == 1024
    assert engine.runner.model.model.rotary.length >= 1024
    prompt = [(7 * i) % 300 + 3 for i in range(700)]  # positions past 512
    engine.add_request("long", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 4
    assert_all_pages_free(engine)


def _hf_inv_freq(rope_type: str, scaling: dict, dim: int, max_pos: int, seq_len: int | None):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(hidden_size=dim * 4, num_attention_heads=4, head_dim=dim,
                                   max_position_embeddings=max_pos,
                                   rope_parameters={"rope_theta": 10000.0, "rope_type": rope_type,
                                                    **scaling})
    kwargs = {"seq_len": seq_len} if seq_len is not None else {}
    return ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu", **kwargs)


@pytest.mark.parametrize("rope_type, scaling", [
    ("linear", {"factor": 3.0}),
    ("dynamic", {"factor": 2.0}),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 64}),
    ("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}),
])
def test_rope_table_matches_transformers_init_functions(rope_type, scaling) -> None:
    dim, max_pos = 32, 256 if rope_type != "yarn" else 64
    rotary = RotaryEmbedding(dim, max_pos, 10000.0, {"rope_type": rope_type, **scaling})
    assert rotary.length == max(max_pos, max_positions(max_pos, {"rope_type": rope_type, **scaling}))
    # Dynamic NTK: one table fixed at its full length, i.e. transformers' base at seq_len = length.
    inv_freq, attention = _hf_inv_freq(rope_type, scaling, dim, max_pos,
                                       rotary.length if rope_type == "dynamic" else None)
    angles = torch.outer(torch.arange(rotary.length, dtype=torch.float32), inv_freq.float())
    expected = torch.cat((angles.cos(), angles.sin()), dim=-1) * attention
    # fp32 angles up to ~length radians: the error bound is a few ulps of that.
    torch.testing.assert_close(rotary.cos_sin, expected, atol=2e-4 * math.log2(rotary.length), rtol=0)


def test_serve_refuses_in_one_line_before_loading() -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "homelab_llm", "serve", str(REPO / "assets/model_configs/SmolLM2-135M.json"),
         "--load-format", "dummy", "--device", "cpu", "--max-model-len", "16384", "--port", "0"],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("homelab-llm serve: error: --max-model-len 16384 is beyond the "
                               "model's 8192 positions")
    assert "--hf-overrides" in lines[0]
