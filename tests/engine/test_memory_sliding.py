"""Plan figures for sliding-window models: KV of sliding layers capped at the window (Gemma 3 27B
W4A16 at TP=2 on two 24 GiB cards at 128K, where the sliding layers have their own page group;
an all-sliding Mistral), arithmetic checked by hand; and the engine allocating what the plan
says for a mixed model."""

from __future__ import annotations

import json

import pytest

from homelab_llm.assets import assets_dir
from homelab_llm.engine import memory
from homelab_llm.engine.model.config import config_from_hf
from sliding_reference import sliding_hf_config

GIB = 1 << 30


def _gemma():
    path = assets_dir() / "model_configs" / "Gemma-3-27B.json"
    return config_from_hf(json.loads(path.read_text()), name="Gemma-3-27B")


def test_gemma3_27b_published_shape() -> None:
    cfg = _gemma()
    assert cfg.architecture == "gemma3" and cfg.num_hidden_layers == 62 and cfg.vocab_size == 262_208
    assert len(cfg.sliding_layers) == 52 and cfg.sliding_window == 1024
    assert cfg.layer_window(5) == 0 and cfg.layer_window(4) == 1024  # every 6th layer is global
    assert cfg.query_pre_attn_scalar == 168 and cfg.rope_local_theta == 10_000.0
    assert cfg.rope_theta == 1_000_000.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert cfg.eos_token_ids == (1, 106) and cfg.tie_word_embeddings


def test_gemma3_27b_w4a16_tp2_128k_capped_kv() -> None:
    plan = memory.plan(_gemma(), gpu_memory_bytes=24 * GIB, tensor_parallel_size=2,
                       quantization="w4a16", max_model_len=131072, max_num_seqs=8)
    # 8 of 16 KV heads per rank, head_dim 128, bf16 K and V: 4 KiB per layer per token; the
    # main page group holds the 10 full-attention layers, the sliding group the other 52
    per_layer_token = 2 * 8 * 128 * 2
    assert plan.kv_bytes_per_token == 10 * per_layer_token
    sw = plan.sliding
    assert sw["window"] == 1024 and sw["sliding_layers"] == 52 and sw["full_layers"] == 10
    assert sw["engine_caps"]
    # the sliding group: 8 sequences x (64 window pages + 2) + one 2048-token step of pages
    assert sw["sliding_group_pages"] == 8 * 66 + 128
    device = plan.per_device[0]
    sliding_bytes = sw["sliding_group_pages"] * 16 * 52 * per_layer_token
    assert device.kv_cache_bytes == device.num_pages * 16 * plan.kv_bytes_per_token + sliding_bytes
    # two whole 128K sequences fit (uncapped, 62 layers, not even a quarter of one would)
    assert plan.tokens_capacity >= 2 * 131072 and plan.max_concurrency["131072"] == 2
    assert not plan.warnings
    # 128K: 10 full layers x 8192 pages of 16, 52 sliding layers x (1024 / 16 + 1) pages
    want = per_layer_token * 16 * (10 * 8192 + 52 * 65)
    assert sw["kv_bytes_per_sequence"]["131072"] == want
    assert sw["kv_bytes_per_sequence_uncapped"]["131072"] == 62 * per_layer_token * 131072
    # about 1/6 of the uncapped KV, which is what lets 128K fit on two 24 GB cards
    assert want < sw["kv_bytes_per_sequence_uncapped"]["131072"] / 5.5
    assert sw["max_concurrency"]["131072"] >= 1
    # int8 KV halves both groups: four 128K sequences
    int8 = memory.plan(_gemma(), gpu_memory_bytes=24 * GIB, tensor_parallel_size=2,
                       quantization="w4a16", max_model_len=131072, max_num_seqs=8,
                       kv_cache_dtype="int8")
    assert int8.max_concurrency["131072"] == 4


def test_small_budget_splits_the_groups_evenly() -> None:
    """When the budget cannot hold every running sequence's window, both groups get the same
    pages (a sequence never needs more sliding pages than full ones)."""
    plan = memory.plan(_gemma(), gpu_memory_bytes=24 * GIB, tensor_parallel_size=2,
                       quantization="w4a16", max_model_len=131072, max_num_seqs=64)
    assert plan.sliding["sliding_group_pages"] == plan.per_device[0].num_pages < 64 * 66


@pytest.mark.parametrize("tp", [1, 2])
def test_engine_allocates_the_planned_page_groups(tmp_path, tp: int) -> None:
    """A tiny Gemma 3 (dummy weights): the engine's page groups are the plan's arithmetic."""
    from homelab_llm.engine.llm import LLM

    raw = sliding_hf_config("gemma3", vocab_size=300, num_attention_heads=4,
                            num_key_value_heads=2).to_dict()
    path = tmp_path / "gemma3.json"
    path.write_text(json.dumps(raw))
    budget, page = 1 << 20, 4
    llm = LLM(str(path), load_format="dummy", device="cpu", dtype="float32", page_size=page,
              tensor_parallel_size=tp, max_num_seqs=4, max_num_batched_tokens=32,
              kv_cache_memory_bytes=budget)
    try:
        status = llm.engine.status()
    finally:
        llm.shutdown()
    groups = [memory.kv_groups(config_from_hf(raw), "auto", "float32", tp, r, page, 4, 32)
              for r in range(tp)]
    pages = min(g.pages_for(budget, page) for g in groups)
    kv = status["kv"]
    assert kv["tokens_capacity"] == pages * page and kv["bytes_per_token"] == groups[0].per_token
    assert kv["sliding_pages"] == groups[0].split.sliding_pages(pages) == 4 * 4 + 8
    for rank, device in enumerate(status["devices"]):
        assert device["kv_cache"] == groups[rank].bytes_for(pages, page)


def test_all_sliding_mistral_is_capped_by_the_engine_and_full_models_have_no_figures() -> None:
    base = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=2)
    mistral = config_from_hf({**base, "model_type": "mistral", "sliding_window": 4096})
    plan = memory.plan(mistral, gpu_memory_bytes=GIB, max_model_len=131072)
    assert plan.sliding["engine_caps"]
    assert plan.sliding["kv_bytes_per_sequence"]["131072"] == plan.kv_bytes_per_token * 16 * 257
    llama = config_from_hf({**base, "model_type": "llama"})
    assert memory.plan(llama, gpu_memory_bytes=GIB).sliding == {}
