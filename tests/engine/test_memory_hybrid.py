"""engine/memory.py on hybrid (Gated DeltaNet + attention) models, against hand-computed numbers."""

from __future__ import annotations

import dataclasses

import pytest

from homelab_llm.engine import memory
from homelab_llm.engine.cache.state_layout import StateLayout
from homelab_llm.engine.gdn_memory import GDN_CHUNK_SIZE, gdn_activation_bytes
from homelab_llm.engine.model.config import LAYER_FULL, LAYER_LINEAR
from tests.engine.hybrid_shapes import QWEN36_27B

AUTOROUND = {"quant_method": "auto-round", "bits": 4, "group_size": 128}
STATE_PER_SEQ = 48 * (3 * 5120 * 2 + 24 * 128 * 128 * 4)  # per card at TP=2 (test_state_layout)


def deployment(**kw) -> memory.MemoryPlan:
    """Issue 14's deployment: two 23.98 GiB cards, TP=2, int8 KV, 128K, 8 sequences, W4A16."""
    config = dataclasses.replace(QWEN36_27B, quantization=AUTOROUND)
    args = dict(gpu_memory_bytes=25_753_026_560, tensor_parallel_size=2, kv_cache_dtype="int8",
                max_model_len=131072, max_num_seqs=8, max_num_batched_tokens=8192,
                gpu_memory_utilization=0.97)
    return memory.plan(config, **{**args, **kw})


def test_deployment_kv_bytes_per_token_and_state_per_sequence_per_card() -> None:
    p = deployment()
    # 16 full-attention layers x (K and V) x 2 KV heads per card x (256 int8 + 2 bytes of scale)
    assert p.kv_bytes_per_token == 16 * 2 * 2 * 258 == 16_512
    assert p.state_bytes_per_sequence == STATE_PER_SEQ
    assert p.state_bytes_per_sequence / 1e6 == pytest.approx(77, abs=0.05)
    assert p.quantization == "w4a16"
    for d in p.per_device:
        assert d.kv_bytes_per_token == 16_512
        assert d.state_bytes_per_sequence == STATE_PER_SEQ
        # 8 running sequences + the default snapshot pool of 2 per sequence
        assert d.state_bytes == (8 + 16) * STATE_PER_SEQ
        free = (d.budget_bytes - d.weights_bytes - d.buffers_bytes - d.activation_bytes
                - d.graph_bytes - d.state_bytes - d.other_bytes)
        assert d.num_pages == free // (16_512 * 16)
    assert p.state_snapshots == 16
    # ~9.6 GB of KV per card: the 128K context fits several times over
    assert p.max_concurrency["131072"] >= 4


def test_plan_json_carries_the_state_contract() -> None:
    data = deployment().to_json()
    assert data["state_bytes_per_sequence"] == STATE_PER_SEQ
    assert {"weights_bytes", "buffers_bytes", "activation_bytes", "graph_bytes", "state_bytes",
            "other_bytes", "kv_cache_bytes", "kv_bytes_per_token", "num_pages",
            "tokens_capacity", "state_bytes_per_sequence"} <= set(data["per_device"][0])


def test_snapshot_pool_size_moves_memory_between_state_and_kv() -> None:
    default = deployment()
    none = deployment(max_state_snapshots=0)
    off = deployment(enable_prefix_caching=False)
    budget = deployment(state_snapshot_memory_bytes=4 * STATE_PER_SEQ + 5)
    assert none.per_device[0].state_bytes == off.per_device[0].state_bytes == 8 * STATE_PER_SEQ
    assert budget.per_device[0].state_bytes == (8 + 4) * STATE_PER_SEQ
    assert none.tokens_capacity > budget.tokens_capacity > default.tokens_capacity


def test_qwen36_27b_parameter_count() -> None:
    """26.9B language-model parameters (the published 27B adds the vision tower), in bf16 but
    A_log and dt_bias (float32)."""
    h, inter, vocab = 5120, 17408, 248320
    attention = h * 24 * 256 * 2 + 2 * h * 4 * 256 + 24 * 256 * h + 2 * 256  # gated q, k, v, o, qk-norms
    gdn = (h * (2 * 16 * 128 + 48 * 128) + h * 48 * 128 + 2 * h * 48      # in_proj_qkv, z, b, a
           + (2 * 16 * 128 + 48 * 128) * 4 + 2 * 48 + 128 + 48 * 128 * h)  # conv, A_log, dt_bias, norm, out
    mlp_and_norms = 3 * h * inter + 2 * h
    params = 16 * (attention + mlp_and_norms) + 48 * (gdn + mlp_and_norms) + 2 * vocab * h + h
    assert params == 26_895_998_464
    assert memory.parameter_count(QWEN36_27B) == memory.ParameterCount(params, params)
    assert memory.weight_bytes(QWEN36_27B, "bfloat16", None, 1) == 2 * params + 48 * 2 * 48 * 2


TINY = dataclasses.replace(
    QWEN36_27B, vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
    layer_types=(LAYER_LINEAR, LAYER_FULL), linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=64, linear_value_head_dim=64, quantization=AUTOROUND)


def test_w4a16_quantizes_gdn_qkv_z_out_but_not_b_a_conv_or_norms() -> None:
    def q4(k: int, n: int) -> int:  # 4-bit weights + fp16 scale and bias per 128-row group
        return k * n // 2 + -(-k // 128) * n * 4
    h = 256
    mlp = q4(h, 2 * 512) + q4(512, h) + 2 * h * 2
    attention = q4(h, (2 * 4 + 2 * 2) * 64) + q4(4 * 64, h) + 2 * 64 * 2  # gated q_proj doubles
    gdn = (q4(h, 512) + q4(h, 256) + q4(256, h)           # in_proj_qkv, in_proj_z, out_proj
           + 2 * h * 4 * 2                                # in_proj_b, in_proj_a stay 16-bit
           + (512 * 4 + 64) * 2 + 2 * 4 * 4)              # conv1d, norm; A_log, dt_bias fp32
    embed_head_norm = 2 * 1000 * h * 2 + h * 2
    assert memory.weight_bytes(TINY, "bfloat16", None, 1) == mlp * 2 + attention + gdn + embed_head_norm


def test_gdn_prefill_working_set_grows_per_token_and_per_chunk() -> None:
    layout = StateLayout.for_model(QWEN36_27B, 2, "bfloat16")
    one_chunk = gdn_activation_bytes(QWEN36_27B, layout, GDN_CHUNK_SIZE, 2)
    two_chunks = gdn_activation_bytes(QWEN36_27B, layout, GDN_CHUNK_SIZE + 1, 2)
    per_token = (one_chunk - layout.recurrent_bytes_per_layer) // GDN_CHUNK_SIZE
    # one more token opens a second chunk: one more fp32 state of 24 x 128 x 128 per card
    assert two_chunks - one_chunk == per_token + 24 * 128 * 128 * 4
    # at 8192 tokens the GDN layer, not the MLP, is the widest point of a forward
    plain = dataclasses.replace(QWEN36_27B, layer_types=())
    assert (memory.activation_bytes(QWEN36_27B, 8192, "bfloat16", 2, 8)
            > memory.activation_bytes(plain, 8192, "bfloat16", 2, 8))


def test_gdn_heads_that_do_not_split_are_a_plan_error() -> None:
    odd = dataclasses.replace(QWEN36_27B, intermediate_size=17409 * 3, linear_num_key_heads=16)
    with pytest.raises(memory.MemoryPlanError, match="linear-attention key heads"):
        memory.plan(odd, gpu_memory_bytes=24 << 30, tensor_parallel_size=3)


def test_plain_models_keep_no_state() -> None:
    plain = dataclasses.replace(QWEN36_27B, layer_types=(), attn_output_gate=False)
    p = memory.plan(plain, gpu_memory_bytes=48 << 30, tensor_parallel_size=2)
    assert p.state_bytes_per_sequence == 0 and p.per_device[0].state_bytes == 0
    assert p.kv_bytes_per_token == 64 * 2 * 2 * 256 * 2


# -- plan vs what the engine measures (CPU, dummy weights) ------------------------------------
ENGINE_CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 1000,
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "layer_types": ["linear_attention", "full_attention"] * 2, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4, "attn_output_gate": True, "mamba_ssm_dtype": "float32",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "max_position_embeddings": 1024, "tie_word_embeddings": False, "dtype": "float32",
}


@pytest.mark.parametrize("tp, snapshots", [(1, None), (2, 3)])
def test_plan_agrees_with_the_hybrid_engine(tmp_path, tp: int, snapshots: int | None) -> None:
    """Weights, KV bytes per token and state bytes per device: `plan` arithmetic vs
    engine.status() on a tiny Qwen3.5-layout hybrid with dummy weights."""
    import json

    from homelab_llm.engine.llm import LLM
    from homelab_llm.engine.model.config import config_from_hf

    path = tmp_path / "tiny-hybrid.json"
    path.write_text(json.dumps(ENGINE_CONFIG))
    config = config_from_hf(ENGINE_CONFIG)
    llm = LLM(str(path), load_format="dummy", device="cpu", dtype="float32", page_size=4,
              tensor_parallel_size=tp, max_num_seqs=4, max_state_snapshots=snapshots,
              kv_cache_memory_bytes=1 << 20)
    try:
        status = llm.engine.status()
    finally:
        llm.shutdown()
    p = memory.plan(config, gpu_memory_bytes=1 << 30, tensor_parallel_size=tp, dtype="float32",
                    max_num_seqs=4, page_size=4, max_state_snapshots=snapshots)
    assert status["kv"]["bytes_per_token"] == p.kv_bytes_per_token == 2 * 2 * (2 // tp) * 32 * 4
    assert p.state_snapshots == (8 if snapshots is None else snapshots)
    for rank, device in enumerate(status["devices"]):
        planned = p.per_device[rank]
        assert device["state"] == planned.state_bytes == (4 + p.state_snapshots) * p.state_bytes_per_sequence
        assert device["weights"] == planned.weights_bytes + memory.rope_table_bytes(config)
