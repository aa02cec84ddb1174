"""Tensor parallelism of the experts: each expert's intermediate dim split evenly over ranks
(shards cover the full tensors), uneven splits refused, and real 2-rank gloo forwards (a tiny
Qwen3-MoE through the paged harness, tiny Qwen3.5-MoE and Qwen3-Next through the whole engine)
equal to 1 rank.

Tolerance for the 2-rank forwards: fp32, the all-reduce only reorders sums; 1e-4 absolute on
logits of O(10) (Qwen3-MoE), 1e-4 of the largest logit (the hybrids); greedy tokens identical.
"""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.parallel import state as parallel
from homelab_llm.engine.layers.moe import ExpertPart, FusedExperts
from homelab_llm.engine.model.config import UnsupportedModelError
from model_reference import chunked_logits, load_ours, two_rank_logits
from moe_reference import make_hf_moe

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5]
DECODE = [35, 89, 79]


def _on_rank(rank: int, tp: int, make):
    parallel.set_parallel_state(rank, tp)
    try:
        return make()
    finally:
        parallel.set_parallel_state(0, 1)


def test_expert_shards_cover_the_full_tensors():
    torch.manual_seed(0)
    e, h, i = 3, 8, 6
    gate_up, down = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    shards = []
    for rank in (0, 1):
        experts = _on_rank(rank, 2, lambda: FusedExperts(e, h, i))
        experts.weight_loader(experts.w13, gate_up, ExpertPart("gate_up"))
        experts.weight_loader(experts.w2, down, ExpertPart("down"))
        shards.append(experts)
    gate = torch.cat([s.w13[:, :3] for s in shards], dim=1)
    up = torch.cat([s.w13[:, 3:] for s in shards], dim=1)
    assert torch.equal(torch.cat([gate, up], dim=1), gate_up)
    assert torch.equal(torch.cat([s.w2 for s in shards], dim=2), down)


def test_uneven_expert_split_is_refused():
    with pytest.raises(UnsupportedModelError,
                       match=r"--tensor-parallel-size 4: the moe_intermediate_size \(6\) is not divisible by 4"):
        _on_rank(0, 4, lambda: FusedExperts(2, 8, 6))


def test_two_rank_forward_equals_one_rank(tmp_path):
    folder = tmp_path / "model"
    make_hf_moe(folder)
    _, single = load_ours(folder)
    expected = chunked_logits(single, PROMPT, DECODE)
    got = two_rank_logits(folder, tmp_path, PROMPT, DECODE)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert parallel.tp_size() == 1


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_hybrid_moe_engine_tp2_equals_tp1(tmp_path, family):
    """The hybrid MoEs through the whole engine on two gloo ranks: experts and the gated shared
    expert split (Qwen3-Next: its per-key-head fused projections cut before the heads split, and
    a dense mlp_only layer), logits equal up to reduction order and greedy tokens exactly."""
    from hybrid_reference import greedy, our_llm
    from moe_reference import make_hf_qwen3_5_moe, make_hf_qwen3_next
    from test_model_qwen3_5 import last_logits

    prompts = [[(7 * i + 3) % 300 + 3 for i in range(n)] for n in (37, 5)]
    {"qwen3_5_moe": make_hf_qwen3_5_moe, "qwen3_next": make_hf_qwen3_next}[family](tmp_path, seed=2)
    results = []
    for tp in (1, 2):
        llm = our_llm(tmp_path, tensor_parallel_size=tp)
        try:
            results.append((last_logits(llm, prompts),
                            [c.token_ids for c in llm.generate(prompts, greedy(4))]))
        finally:
            llm.shutdown()
    (l1, t1), (l2, t2) = results
    assert (l1 - l2).abs().max() <= 1e-4 * l1.abs().max()
    assert t1 == t2
