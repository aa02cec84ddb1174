"""Gemma 3 and gpt-oss at TP=2 (two gloo ranks on the CPU) give the TP=1 logits: sinks split with
their query heads, o_proj and expert down biases added once, windows kept per layer.
Tolerance: fp32, 1e-4 absolute (only the all-reduce order differs)."""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.parallel import state as parallel
from model_reference import chunked_logits, load_ours, two_rank_logits
from sliding_reference import make_sliding_model

PROMPT = [(7 * i + 3) % 200 for i in range(21)]  # several windows of 8
DECODE = [35, 89, 79, 12]


@pytest.mark.parametrize("kind", ["gemma3", "gpt_oss"])
def test_two_ranks_match_one(kind: str, tmp_path) -> None:
    folder = tmp_path / kind
    make_sliding_model(kind, folder, num_attention_heads=4, num_key_value_heads=2)
    _, single = load_ours(folder)
    expected = chunked_logits(single, PROMPT, DECODE)
    got = two_rank_logits(folder, tmp_path, PROMPT, DECODE)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert parallel.tp_size() == 1
