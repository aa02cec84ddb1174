"""Tensor parallelism in the layers: head partitioning, weight sharding, and a real 2-rank gloo
forward (uneven 9 q / 3 kv heads, tied vocab-parallel embedding) equal to the 1-rank model.

Tolerance for the 2-rank forward: fp32, the all-reduce only reorders sums; 1e-4 absolute on
logits of O(10) (observed ~5e-6).
"""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.parallel import state as parallel
from homelab_llm.engine.layers.embedding import VocabParallelEmbedding
from homelab_llm.engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from homelab_llm.engine.model.config import UnsupportedModelError
from homelab_llm.engine.sharding import head_shard
from model_reference import chunked_logits, load_ours, make_hf_model, two_rank_logits

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5]
DECODE = [35, 89, 79]


def test_head_shards():
    # uneven: 9 q / 3 kv heads over 2 ranks -> 6+3 q, 2+1 kv, whole groups
    shards = [head_shard(9, 3, 2, r) for r in (0, 1)]
    assert [(s.q_start, s.q_heads, s.kv_start, s.kv_heads) for s in shards] == [
        (0, 6, 0, 2), (6, 3, 2, 1)]
    # more ranks than kv heads: each kv head replicated on tp/num_kv ranks
    shards = [head_shard(8, 2, 4, r) for r in range(4)]
    assert [(s.q_start, s.q_heads, s.kv_start, s.kv_heads) for s in shards] == [
        (0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)]
    with pytest.raises(UnsupportedModelError, match="tensor-parallel-size 3"):
        head_shard(8, 2, 3, 0)


@pytest.fixture
def two_ranks():
    def build(rank: int, make):
        parallel.set_parallel_state(rank, 2)
        try:
            return make()
        finally:
            parallel.set_parallel_state(0, 1)
    return build


def test_weight_loaders_split_and_cover_the_full_tensors(two_ranks):
    torch.manual_seed(0)
    d = 4
    q, k, v = torch.randn(9 * d, 8), torch.randn(3 * d, 8), torch.randn(3 * d, 8)
    gate, up, down = torch.randn(6, 8), torch.randn(6, 8), torch.randn(8, 6)
    vocab = torch.randn(7, 8)
    got = {"q": [], "k": [], "v": [], "gate": [], "up": [], "down": [], "vocab": []}
    for rank in (0, 1):
        qkv = two_ranks(rank, lambda: QKVParallelLinear(8, d, 9, 3))
        for sid, t in (("q", q), ("k", k), ("v", v)):
            qkv.weight_loader(qkv.weight, t, sid)
        got["q"].append(qkv.weight[: qkv.q_size])
        got["k"].append(qkv.weight[qkv.q_size: qkv.q_size + qkv.kv_size])
        got["v"].append(qkv.weight[qkv.q_size + qkv.kv_size:])
        gu = two_ranks(rank, lambda: MergedColumnParallelLinear(8, [6, 6]))
        gu.weight_loader(gu.weight, gate, 0)
        gu.weight_loader(gu.weight, up, 1)
        got["gate"].append(gu.weight[:3])
        got["up"].append(gu.weight[3:])
        row = two_ranks(rank, lambda: RowParallelLinear(6, 8))
        row.weight_loader(row.weight, down)
        got["down"].append(row.weight)
        emb = two_ranks(rank, lambda: VocabParallelEmbedding(7, 8))
        emb.weight_loader(emb.weight, vocab)
        got["vocab"].append(emb.weight)
    assert [t.shape[0] for t in got["q"]] == [6 * d, 3 * d]
    assert [t.shape[0] for t in got["k"]] == [2 * d, 1 * d]
    for name, full in (("q", q), ("k", k), ("v", v), ("gate", gate), ("up", up)):
        assert torch.equal(torch.cat(got[name]), full), name
    assert torch.equal(torch.cat(got["down"], dim=1), down)
    # vocab 7 over 2 ranks: 4 rows each, the last one padding (zero)
    assert torch.equal(torch.cat(got["vocab"])[:7], vocab) and not got["vocab"][1][3].any()


def test_two_rank_forward_equals_one_rank(tmp_path):
    folder = tmp_path / "model"
    make_hf_model("llama", folder, num_attention_heads=9, num_key_value_heads=3,
                  hidden_size=144, tie_word_embeddings=True,
                  rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    _, single = load_ours(folder)
    expected = chunked_logits(single, PROMPT, DECODE)
    got = two_rank_logits(folder, tmp_path, PROMPT, DECODE)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert parallel.tp_size() == 1  # the parent's state was never touched
