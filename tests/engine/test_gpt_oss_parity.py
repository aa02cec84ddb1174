"""gpt-oss (bf16-style checkpoint, transformers 5 layout) vs transformers on a tiny random model:
attention sinks, alternating sliding (window 8) / full layers, YaRN, biased router and experts with
the clamped SwiGLU. Prompts several windows long, decode far past the window, batched sequences.

Tolerance: fp32 on both sides, 1e-3 absolute on logits of O(10) (a missing sink, bias or clamp
moves them by O(1)).
"""

from __future__ import annotations

import pytest
import torch

from model_reference import PagedHarness, hf_logits, load_ours
from sliding_reference import check_long_prompt_and_decode, make_sliding_model

ATOL = 1e-3
PROMPT = [(7 * i + 3) % 200 for i in range(37)]
DECODE = [(11 * i + 5) % 200 for i in range(16)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt_oss")
    hf = make_sliding_model("gpt_oss", folder)
    config, ours = load_ours(folder)
    return hf, config, ours


def test_config(pair):
    _, config, _ = pair
    assert config.architecture == "gpt_oss" and config.sliding_layers == (0, 2)
    assert config.attention_sinks and config.o_proj_bias and config.num_experts == 4
    assert (config.swiglu_alpha, config.swiglu_limit) == (1.702, 7.0)
    assert config.moe_intermediate_size == 64 and config.rope_scaling["rope_type"] == "yarn"


def test_chunked_prefill_then_decode_past_the_window(pair):
    hf, _, ours = pair
    check_long_prompt_and_decode(hf, ours, PROMPT, DECODE, ATOL)


def test_batched_decode_and_prefill_mix(pair):
    hf, _, ours = pair
    a, b = PROMPT[:30], PROMPT[5:25]
    ref_a, ref_b = hf_logits(hf, a + [70]), hf_logits(hf, b)
    harness = PagedHarness(ours, page_size=4)
    harness.step({"a": a})
    mixed = harness.step({"a": [70], "b": b})
    torch.testing.assert_close(mixed[0], ref_a[30], atol=ATOL, rtol=0)
    torch.testing.assert_close(mixed[1:], ref_b, atol=ATOL, rtol=0)
