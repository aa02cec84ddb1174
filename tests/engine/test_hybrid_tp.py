"""Tensor parallelism on the Qwen3.5 hybrid: Gated DeltaNet key/value heads and conv channels split
with the attention heads, two gloo ranks on the CPU equal one rank (logits up to reduction order,
greedy tokens exactly), and a prefix reuse whose state copies must run on every rank."""

from __future__ import annotations

import pytest
import torch

from hybrid_reference import greedy, make_hf_qwen3_5, our_llm
from homelab_llm.engine.args import EngineArgsError
from test_model_qwen3_5 import last_logits

PROMPTS = [[(7 * i + 3) % 300 + 3 for i in range(n)] for n in (70, 5, 23)]


def run(folder, tp: int) -> tuple[torch.Tensor, list[list[int]], list[int], int]:
    llm = our_llm(folder, tensor_parallel_size=tp)
    try:
        logits = last_logits(llm, PROMPTS)
        tokens = [c.token_ids for c in llm.generate(PROMPTS, greedy(5))]
        # Extends PROMPTS[0]: resumes from its snapshot, copied into the new slot on each rank.
        again = llm.generate([PROMPTS[0] + [9, 8, 7]], greedy(5))[0]
        devices = llm.engine.status()["devices"]
        assert len(devices) == tp and all(d["state"] > 0 for d in devices)
        return logits, tokens, again.token_ids, again.num_cached_tokens
    finally:
        llm.shutdown()


def test_tp2_equals_tp1(tmp_path):
    make_hf_qwen3_5(tmp_path, seed=4)
    l1, t1, a1, c1 = run(tmp_path, 1)
    l2, t2, a2, c2 = run(tmp_path, 2)
    assert (l1 - l2).abs().max() <= 1e-3 * l1.abs().max()
    assert t1 == t2 and a1 == a2
    assert c1 == c2 == len(PROMPTS[0])


def test_invalid_size_is_a_clear_error(tmp_path):
    make_hf_qwen3_5(tmp_path, seed=5)
    # 4 attention heads allow 4 ranks; the 2 linear-attention key heads do not.
    with pytest.raises(EngineArgsError, match=r"linear-attention key heads \(2\) is not divisible "
                                               r"by 4; valid sizes: 1, 2$"):
        our_llm(tmp_path, tensor_parallel_size=4)
