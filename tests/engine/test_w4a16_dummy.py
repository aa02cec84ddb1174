"""`--load-format dummy --quantization w4a16`: random packed 4-bit linears, deterministic, with the
memory the engine reports matching the packed size the memory plan predicts."""

from __future__ import annotations

import json

import pytest
import torch

from homelab_llm.engine import memory
from homelab_llm.engine.model.loader import load_model, load_model_config
from model_reference import PagedHarness, write_tiny_config

# Every input size a multiple of 128, as in Llama-3.1-8B and Qwen3-32B, so group 128 throughout.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2, vocab_size=300)
PROMPT = [5, 17, 42, 7, 99, 3]


@pytest.fixture
def config_path(tmp_path):
    return write_tiny_config(tmp_path, **SHAPE)


def _dummy(path, dtype=torch.float32, quantization="w4a16"):
    return load_model(load_model_config(path), path, "dummy", dtype, "cpu", quantization=quantization)


def _linears(model):
    for layer in model.model.layers:
        yield from (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                    layer.mlp.down_proj)


def test_every_linear_is_packed_group_128_and_the_run_repeats(config_path):
    model = _dummy(config_path)
    for linear in _linears(model):
        assert linear.weight is None and linear.w4.group_size == 128 and linear.w4.perm is None
        assert linear.w4.biases.dtype == torch.float16  # symmetric: -8 * scale, exact in fp16
        torch.testing.assert_close(linear.w4.biases.float(), -8 * linear.w4.scales.float(), rtol=0, atol=0)
    assert model.model.embed_tokens.weight.dtype == torch.float32  # embeddings stay dense
    first = PagedHarness(model).step({"s": PROMPT})
    again = PagedHarness(_dummy(config_path)).step({"s": PROMPT})
    assert torch.isfinite(first).all() and torch.equal(first, again)
    # Different layers draw different weights (each is seeded by its own name).
    a, b = model.model.layers
    assert not torch.equal(a.mlp.down_proj.w4.qweight, b.mlp.down_proj.w4.qweight)


def test_weights_have_the_dense_dummy_spread(config_path):
    """Uniform nibbles minus 8 times ~0.0043: std ~0.02 like loader.DUMMY_STD (within 25%); the
    mean is -scale/2 (~-0.002), since int4 reaches -8 but only +7."""
    from homelab_llm.engine.kernels.ref import dequantize_w4_ref

    w = dequantize_w4_ref(_dummy(config_path).model.layers[0].mlp.gate_up_proj.w4)
    assert 0.015 < float(w.std()) < 0.025 and -0.003 < float(w.mean()) < -0.0015


def test_packed_bytes_match_the_memory_plan(config_path):
    """Parameters plus the 4-bit buffers (the rope table aside) are exactly what
    memory.weight_bytes predicts for w4a16: K*N/2 bytes of nibbles plus fp16 scale and bias."""
    config = load_model_config(config_path)
    for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        model = _dummy(config_path, dtype)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        w4 = sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                 if n.rsplit(".", 1)[-1] in ("w4_qweight", "w4_scales", "w4_biases"))
        assert params + w4 == memory.weight_bytes(config, name, "w4a16", 1)
        dense = memory.weight_bytes(config, name, None, 1)
        assert params + w4 < dense


def test_engine_status_reports_the_packed_size(config_path, monkeypatch):
    """Status counts every weight byte the engine holds: the packed weights (under half the dense
    model's), and, when a small model keeps a dense bf16 copy for prompt rows on the CPU, that too."""
    from homelab_llm.engine.args import EngineArgs
    from homelab_llm.engine.core import LLMEngine
    from homelab_llm.engine.kernels import w4a16_cpu

    def weights(quantization):
        engine = LLMEngine(EngineArgs(model=str(config_path), load_format="dummy", device="cpu",
                                      quantization=quantization, kv_cache_memory_bytes=1 << 20,
                                      max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64))
        try:
            return engine.status()["devices"][0]["weights"], engine.runner.model
        finally:
            engine.shutdown()

    def held(model) -> int:
        return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))

    dense, _ = weights(None)
    with_copy, model = weights("w4a16")
    assert with_copy == held(model)  # the int4 packs and the dense bf16 copy are buffers, counted
    monkeypatch.setattr(w4a16_cpu, "DENSE_CACHE_BYTES", 0)  # no dense copy: the packed weights alone
    packed, model = weights("w4a16")
    assert packed == held(model) and packed < with_copy
    assert packed < 0.5 * dense


def test_quantization_config_in_the_json_implies_w4a16(tmp_path):
    path = write_tiny_config(tmp_path, **SHAPE, quantization_config=dict(
        quant_method="gptq", bits=4, group_size=128, sym=True))
    model = _dummy(path, quantization=None)
    assert all(linear.w4 is not None for linear in _linears(model))
    bad = json.loads(path.read_text())
    bad["quantization_config"]["bits"] = 3
    path.write_text(json.dumps(bad))
    from homelab_llm.engine.model.config import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="3-bit"):
        load_model_config(path)


def test_input_sizes_off_128_take_smaller_groups(tmp_path):
    """The tiny default shape: 96 inputs take groups of 32, down_proj's 128 groups of 128."""
    path = write_tiny_config(tmp_path)
    model = _dummy(path)
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.w4.group_size == layer.mlp.gate_up_proj.w4.group_size == 32
    assert layer.mlp.down_proj.w4.group_size == 128
    assert torch.isfinite(PagedHarness(model).step({"s": PROMPT[:3]})).all()


def test_hybrid_dummy_keeps_in_proj_ba_dense(tmp_path):
    """The Gated DeltaNet's in_proj_b / in_proj_a stay 16-bit (as real AutoRound checkpoints and
    gdn_memory's plan have them); the wide projections are packed."""
    from test_memory_hybrid import ENGINE_CONFIG

    path = tmp_path / "tiny-hybrid.json"
    path.write_text(json.dumps(ENGINE_CONFIG))
    model = _dummy(path)
    gdn = [layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn")]
    assert gdn
    for attn in gdn:
        assert attn.in_proj_ba.w4 is None and attn.in_proj_ba.weight is not None
        assert attn.in_proj_qkvz.w4 is not None and attn.out_proj.w4 is not None
