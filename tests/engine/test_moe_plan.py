"""MoE in the memory plan and the dummy loaders: every expert resident, active parameters per
token, the expert TP split, and 4-bit dummy experts (the W4A16 preset's path) on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from homelab_llm.engine import memory
from homelab_llm.engine.layers.moe import FusedExperts
from homelab_llm.engine.model.loader import load_model, load_model_config
from model_reference import PagedHarness
from moe_reference import TINY_MOE


def test_qwen3_30b_a3b_counts_match_the_model_card(model_configs_dir):
    cfg = load_model_config(model_configs_dir / "Qwen3-30B-A3B.json", "dummy")
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (128, 8, 768)
    count = memory.parameter_count(cfg)
    # Published: 30.5B total, 3.3B activated.
    assert 30.4e9 < count.total < 30.6e9 and 3.2e9 < count.active < 3.4e9
    assert memory.parameter_fields(cfg) == {"parameters": count.total, "active_parameters": count.active}


def test_qwen3_30b_a3b_w4a16_fits_two_24gb_cards(model_configs_dir):
    cfg = load_model_config(model_configs_dir / "Qwen3-30B-A3B.json", "dummy")
    bf16 = memory.weight_bytes(cfg, "bfloat16", None, 1)
    assert 60e9 < bf16 < 62e9  # ~30.5B parameters at 2 bytes, all experts resident
    per_card = memory.weight_bytes(cfg, "bfloat16", "w4a16", 2)
    assert 8.0e9 < per_card < 9.0e9
    plan = memory.plan(cfg, gpu_memory_bytes=24 << 30, tensor_parallel_size=2, quantization="w4a16",
                       kv_cache_dtype="int8", max_model_len=32768, max_num_seqs=16,
                       gpu_memory_utilization=0.92, max_num_batched_tokens=8192)
    assert not plan.warnings and plan.max_concurrency["32768"] >= 8


def test_uneven_expert_split_is_refused():
    from homelab_llm.engine.model.config import config_from_hf

    raw = {"model_type": "qwen3_moe", **{k: v for k, v in TINY_MOE.items() if k != "rope_parameters"}}
    cfg = config_from_hf({**raw, "moe_intermediate_size": 30, "intermediate_size": 96})
    with pytest.raises(memory.MemoryPlanError, match=r"expert intermediate size "
                                                      r"\(moe_intermediate_size\) \(30\) is not divisible by 4; "
                                                      r"valid sizes: 1, 2\b"):
        memory.check_tp_shapes(cfg, 4)
    from homelab_llm.engine.sharding import valid_tp_sizes

    assert valid_tp_sizes(cfg) == [1, 2]


def _tiny_config(tmp_path, **over):
    raw = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **TINY_MOE,
           "hidden_size": 128, "moe_intermediate_size": 128, "intermediate_size": 256, **over}
    raw.pop("initializer_range")
    path = tmp_path / "tiny-moe.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize("quantization", [None, "w4a16"])
def test_plan_weights_match_the_built_model(tmp_path, quantization):
    path = _tiny_config(tmp_path)
    cfg = load_model_config(path, "dummy")
    model = load_model(cfg, path, "dummy", torch.float32, "cpu", quantization=quantization)
    built = sum(t.numel() * t.element_size() for t in model.parameters())
    built += sum(t.numel() * t.element_size() for n, t in model.named_buffers()
                 if n.split(".")[-1].startswith(("w13_", "w2_", "w4_")) and "cpu" not in n)
    planned = memory.weight_bytes(cfg, "float32", quantization, 1)
    assert abs(built - planned) / planned < 0.02


def test_w4a16_dummy_experts_run(tmp_path):
    path = _tiny_config(tmp_path)
    cfg = load_model_config(path, "dummy")
    model = load_model(cfg, path, "dummy", torch.float32, "cpu", quantization="w4a16")
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    assert experts and all(m.w4 is not None and m.w13 is None for m in experts)
    assert model.model.layers[0].mlp.gate.w4 is None  # routers stay dense
    logits = PagedHarness(model, page_size=4).step({"s": [1, 2, 3, 4, 5]})
    assert logits.shape == (5, cfg.vocab_size) and torch.isfinite(logits).all()


def test_engine_runs_a_moe_model_and_reports_active_parameters(tmp_path):
    """Through the whole engine (scheduler, paged KV, batching): batched greedy == one at a time,
    and the status config carries the parameter counts."""
    from homelab_llm.engine.llm import LLM
    from homelab_llm.engine.sampling_params import SamplingParams

    path = _tiny_config(tmp_path, vocab_size=320, bos_token_id=1, eos_token_id=2)
    llm = LLM(str(path), load_format="dummy", device="cpu", dtype="float32", page_size=4,
              kv_cache_memory_bytes=1 << 20, seed=0)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    batch = [[5, 6, 7, 8], [9, 10, 11], [40, 41, 42, 43, 44, 45]]
    try:
        together = [o.token_ids for o in llm.generate(batch, params)]
        alone = [llm.generate([p], params)[0].token_ids for p in batch]
        config = llm.engine.status()["config"]
    finally:
        llm.shutdown()
    assert together == alone
    count = memory.parameter_count(load_model_config(path, "dummy"))
    assert (config["parameters"], config["active_parameters"]) == (count.total, count.active)
    assert config["active_parameters"] < config["parameters"]
