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


def test_uneven_kv_split_moves_query_heads_with_their_group() -> None:
    # SmolLM2, tp=2: rank 0 holds 2 KV heads (6 query heads), rank 1 holds 1 (3 query heads);
    # the vocab splits into 24576 padded rows each; the MLP splits evenly.
    h, d, inter, layers = 576, 64, 1536, 30
    def rank_bytes(q_heads: int, kv_heads: int) -> int:
        layer = (h * (q_heads + 2 * kv_heads) * d + q_heads * d * h + h * inter + inter // 2 * h
                 + 2 * h)
        return 2 * (layers * layer + 24576 * h + h)
    assert memory.weight_bytes(SMOLLM2_135M, "bf16", None, 2, 0) == rank_bytes(6, 2)
    assert memory.weight_bytes(SMOLLM2_135M, "bf16", None, 2, 1) == rank_bytes(3, 1)


def test_tied_embeddings_counted_once() -> None:
    total = memory.weight_bytes(SMOLLM2_135M, "bfloat16", None, 1)
    # 134,515,008 parameters (SmolLM2-135M) in bf16
    assert total == 134_515_008 * 2


def test_w4a16_shrinks_linears_but_not_embeddings() -> None:
    bf16 = memory.weight_bytes(LLAMA_3_1_8B, "bfloat16", None, 1)
    w4 = memory.weight_bytes(LLAMA_3_1_8B, "bfloat16", "w4a16", 1)
    embed_and_head = 2 * 128256 * 4096 * 2
    linear_params = (bf16 - embed_and_head - (65 * 4096 * 2)) // 2
    # 0.5 byte per weight + an fp16 scale and an fp16 bias per 128-row group = 0.53125 B/weight
    expected = embed_and_head + 65 * 4096 * 2 + linear_params * (0.5 + 4 / 128)
    assert w4 == pytest.approx(expected, rel=1e-4)
    gptq = ModelConfig(**{**LLAMA_3_1_8B.__dict__, "quantization": {"quant_method": "gptq", "bits": 4}})
    assert memory.weight_bytes(gptq, "bfloat16", None, 1) == w4


def test_plan_llama_8b_on_two_24gib_cards() -> None:
    gib = 1 << 30
    p = memory.plan(LLAMA_3_1_8B, gpu_memory_bytes=24 * gib, tensor_parallel_size=2,
                    max_model_len=131072, max_num_seqs=64, page_size=16)
    d0 = p.per_device[0]
    assert p.kv_bytes_per_token == 65536
    free = (d0.budget_bytes - d0.weights_bytes - d0.buffers_bytes - d0.activation_bytes
            - d0.graph_bytes - d0.other_bytes)
    assert d0.buffers_bytes == 131072 * 128 * 4  # float32 RoPE table
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
    ({"tensor_parallel_size": 3}, "not divisible"),  # 14336 MLP rows over 3 ranks
    ({"tensor_parallel_size": 12}, "multiple of the 8 KV heads"),
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


# -- plan vs what the engine measures (CPU, dummy weights) ------------------------------------
ENGINE_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000,
    "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 3,
    "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 32,
    "max_position_embeddings": 1024, "tie_word_embeddings": False, "torch_dtype": "float32",
}


@pytest.mark.parametrize("tp, kv_dtype", [(1, "auto"), (2, "int8")])
def test_plan_agrees_with_the_engine_within_10_percent(tmp_path, tp: int, kv_dtype: str) -> None:
    """Weights and KV bytes per device from `plan` arithmetic vs engine.status()["devices"].

    TP=2 with 3 KV heads is the uneven case (ranks hold 2 and 1 heads). Budget fixed by
    --kv-cache-memory-bytes so both sides size the same pool.
    """
    import json

    from homelab_llm.engine.llm import LLM
    from homelab_llm.engine.model.config import config_from_hf

    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(ENGINE_CONFIG))
    config = config_from_hf(ENGINE_CONFIG)
    budget = 1 << 20
    llm = LLM(str(path), load_format="dummy", device="cpu", dtype="float32", page_size=4,
              tensor_parallel_size=tp, kv_cache_dtype=kv_dtype, kv_cache_memory_bytes=budget)
    try:
        status = llm.engine.status()
    finally:
        llm.shutdown()
    devices = status["devices"]
    assert len(devices) == tp
    per_token = [memory.kv_bytes_per_token(config, kv_dtype, "float32", tp, r) for r in range(tp)]
    assert status["kv"]["bytes_per_token"] == per_token[0]  # exact: same layout arithmetic
    pages = budget // (per_token[0] * 4)
    for rank, device in enumerate(devices):
        planned_weights = memory.weight_bytes(config, "float32", None, tp, rank)
        assert device["weights"] == pytest.approx(planned_weights, rel=0.10)
        # with the RoPE buffer counted the match is exact
        assert device["weights"] == planned_weights + memory.rope_table_bytes(config)
        assert device["kv_cache"] == pytest.approx(pages * 4 * per_token[rank], rel=0.10)
    assert status["kv"]["tokens_capacity"] == pages * 4
