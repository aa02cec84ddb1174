"""engine/memory.py against hand-computed numbers (exact integers unless a tolerance is stated)."""

from __future__ import annotations

import pytest

from homelab_llm.engine import memory
from homelab_llm.engine.model.config import ModelConfig

LLAMA_3_1_8B = ModelConfig(
    architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=131072, torch_dtype="bfloat16", name="Llama-3.1-8B",
)
SMOLLM2_135M = ModelConfig(
    architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    tie_word_embeddings=True, torch_dtype="bfloat16", name="SmolLM2-135M",
)


def test_llama_8b_tp2_bf16_weights_per_card() -> None:
    per_card = [memory.weight_bytes(LLAMA_3_1_8B, "bfloat16", None, 2, r) for r in (0, 1)]
    # 8,030,261,248 parameters (Meta's model card: 8.03B) x 2 bytes, split over 2 cards; only the
    # three RMSNorm weights per layer-ish (2 per layer + final) are replicated.
    replicated_norms = (32 * 2 + 1) * 4096 * 2
    assert sum(per_card) - replicated_norms == 8_030_261_248 * 2
    assert per_card[0] == per_card[1]
    assert per_card[0] / 1e9 == pytest.approx(8.03, abs=0.005)


def test_llama_8b_tp2_kv_bytes_per_token() -> None:
    # 32 layers x (K and V) x 4 heads per card x 128 dims x 2 bytes
    assert memory.kv_bytes_per_token(LLAMA_3_1_8B, "auto", "bfloat16", 2) == 65536
    assert memory.kv_bytes_per_token(LLAMA_3_1_8B, "auto", "bfloat16", 1) == 131072


def test_int8_kv_counts_one_fp16_scale_per_token_per_head() -> None:
    # 32 x 2 x 4 x (128 x 1 byte + 2 bytes of scale)
    assert memory.kv_bytes_per_token(LLAMA_3_1_8B, "int8", "bfloat16", 2) == 32 * 2 * 4 * 130


def test_kv_heads_split_unevenly_and_replicated_past_num_heads() -> None:
    # SmolLM2: 3 KV heads. tp=2 -> ranks hold 2 and 1; tp=9 -> each rank keeps 1 replica.
    per = 30 * 2 * 64 * 2
    assert memory.kv_bytes_per_token(SMOLLM2_135M, "bf16", "auto", 2, 0) == 2 * per
    assert memory.kv_bytes_per_token(SMOLLM2_135M, "bf16", "auto", 2, 1) == 1 * per
    assert memory.kv_bytes_per_token(SMOLLM2_135M, "bf16", "auto", 9, 8) == 1 * per


def test_tied_embeddings_counted_once() -> None:
    total = memory.weight_bytes(SMOLLM2_135M, "bfloat16", None, 1)
    # 134,515,008 parameters (SmolLM2-135M) in bf16
    assert total == 134_515_008 * 2


def test_w4a16_shrinks_linears_but_not_embeddings() -> None:
    bf16 = memory.weight_bytes(LLAMA_3_1_8B, "bfloat16", None, 1)
    w4 = memory.weight_bytes(LLAMA_3_1_8B, "bfloat16", "w4a16", 1)
    embed_and_head = 2 * 128256 * 4096 * 2
    linear_params = (bf16 - embed_and_head - (65 * 4096 * 2)) // 2
    # 0.5 byte per weight + fp16 scale and 4-bit zero per 128-column group = 0.51953125 B/weight
    expected = embed_and_head + 65 * 4096 * 2 + linear_params * (0.5 + 2.5 / 128)
    assert w4 == pytest.approx(expected, rel=1e-4)
    gptq = ModelConfig(**{**LLAMA_3_1_8B.__dict__, "quantization": {"quant_method": "gptq", "bits": 4}})
    assert memory.weight_bytes(gptq, "bfloat16", None, 1) == w4


def test_plan_llama_8b_on_two_24gib_cards() -> None:
    gib = 1 << 30
    p = memory.plan(LLAMA_3_1_8B, gpu_memory_bytes=24 * gib, tensor_parallel_size=2,
                    max_model_len=131072, max_num_seqs=64, page_size=16)
    d0 = p.per_device[0]
    assert p.kv_bytes_per_token == 65536
    free = d0.budget_bytes - d0.weights_bytes - d0.activation_bytes - d0.graph_bytes - d0.other_bytes
    assert d0.num_pages == free // (65536 * 16)
    assert p.tokens_capacity == d0.num_pages * 16
    # 23.19 GB budget - 8.03 GB weights - ~1 GB working memory = ~14.1 GB of KV per card;
    # at 64 KiB a token that is ~216K tokens: one 128K sequence, 26 at 8K
    assert 200_000 < p.tokens_capacity < 230_000
    assert d0.activation_bytes + d0.graph_bytes + d0.other_bytes < 1.5e9
    assert p.max_concurrency["131072"] == 1
    assert p.max_concurrency["8192"] == d0.num_pages // 512
    assert set(p.max_concurrency) == {"8192", "32768", "131072"}


def test_plan_int8_kv_roughly_doubles_capacity() -> None:
    kw = dict(gpu_memory_bytes=24 << 30, tensor_parallel_size=2, max_model_len=32768)
    auto = memory.plan(LLAMA_3_1_8B, kv_cache_dtype="auto", **kw)
    int8 = memory.plan(LLAMA_3_1_8B, kv_cache_dtype="int8", **kw)
    assert int8.tokens_capacity / auto.tokens_capacity == pytest.approx(256 / 130, rel=0.01)
    assert "32768" in int8.max_concurrency


def test_plan_too_small_warns_and_has_no_capacity() -> None:
    p = memory.plan(LLAMA_3_1_8B, gpu_memory_bytes=8 << 30, tensor_parallel_size=1)
    assert p.tokens_capacity == 0
    assert any("no room for KV" in w for w in p.warnings)


@pytest.mark.parametrize("kwargs, needle", [
    ({"tensor_parallel_size": 3}, "does not divide"),
    ({"gpu_memory_utilization": 1.5}, "gpu-memory-utilization"),
    ({"dtype": "float64"}, "unknown dtype"),
    ({"quantization": "nf4"}, "not supported"),
])
def test_plan_bad_input_is_a_user_error(kwargs: dict, needle: str) -> None:
    with pytest.raises(memory.MemoryPlanError, match=needle):
        memory.plan(LLAMA_3_1_8B, gpu_memory_bytes=24 << 30, **kwargs)


def test_graphs_cost_nothing_when_eager() -> None:
    assert memory.graph_bytes(LLAMA_3_1_8B, 64, "bf16", 2, enforce_eager=True) == 0
    assert memory.graph_capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert memory.graph_bytes(LLAMA_3_1_8B, 64, "bf16", 2) > 8 * memory.GRAPH_OVERHEAD_BYTES
