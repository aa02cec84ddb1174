"""Sliding-window families (Gemma 3 text, Mistral with a window, Qwen2 with use_sliding_window) vs
transformers on tiny random checkpoints, through paged KV: prompts several windows long, decode far
past the window, batched sequences.

Tolerance: fp32 on both sides, 1e-3 absolute on logits of O(10) (observed ~1e-5): a wrong window
edge, rope base or norm moves them by O(1).
"""

from __future__ import annotations

import pytest
import torch

from model_reference import PagedHarness, hf_logits, load_ours
from sliding_reference import check_long_prompt_and_decode, SLIDING_KINDS, WINDOW, WindowedHarness, make_sliding_model

ATOL = 1e-3
PROMPT = [(7 * i + 3) % 200 for i in range(37)]  # > 4 windows
DECODE = [(11 * i + 5) % 200 for i in range(20)]


@pytest.fixture(scope="module", params=SLIDING_KINDS)
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_sliding_model(request.param, folder)
    config, ours = load_ours(folder)
    return request.param, hf, config, ours


def test_config_reads_the_window(pair):
    kind, _, config, _ = pair
    assert config.sliding_window == WINDOW
    want = {"gemma3": (0, 1, 3), "mistral": (0, 1, 2), "qwen2": (1, 2)}[kind]
    assert config.sliding_layers == want
    assert config.full_attention_layers == tuple(range(config.num_hidden_layers))


def test_chunked_prefill_then_decode_past_the_window(pair):
    _, hf, _, ours = pair
    check_long_prompt_and_decode(hf, ours, PROMPT, DECODE, ATOL)


def test_batched_decode_and_prefill_mix(pair):
    _, hf, _, ours = pair
    a, b = PROMPT[:30], PROMPT[5:25]
    ref_a, ref_b = hf_logits(hf, a + [70, 71]), hf_logits(hf, b)
    harness = PagedHarness(ours, page_size=4)
    harness.step({"a": a})
    mixed = harness.step({"a": [70], "b": b})
    both = harness.step({"a": [71], "b": [9]})
    torch.testing.assert_close(mixed[0], ref_a[30], atol=ATOL, rtol=0)
    torch.testing.assert_close(mixed[1:], ref_b, atol=ATOL, rtol=0)
    torch.testing.assert_close(both[0], ref_a[31], atol=ATOL, rtol=0)


def test_all_sliding_model_runs_on_freed_pages(pair):
    """Mistral slides on every layer: pages below the window are freed (and NaN-poisoned) after
    every step; logits stay exact and the sequence holds about WINDOW tokens of pages."""
    kind, hf, config, ours = pair
    if config.sliding_layers != config.full_attention_layers:
        pytest.skip("a full-attention layer keeps every page")
    ref = hf_logits(hf, PROMPT + DECODE)
    harness = WindowedHarness(ours, WINDOW, page_size=4)
    got = [harness.step({"s": PROMPT[:13]}), harness.step({"s": PROMPT[13:]})]
    got += [harness.step({"s": [t]}) for t in DECODE]
    torch.testing.assert_close(torch.cat(got), ref, atol=ATOL, rtol=0)
    assert harness.held_pages("s") <= WINDOW // 4 + 1

