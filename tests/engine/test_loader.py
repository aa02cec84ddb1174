"""Weight loading: sharded safetensors, GGUF (F32 and quantized, Q/K permutation), dummy weights,
and the errors a user sees for missing, truncated or unsupported files."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from homelab_llm.engine.model.config import ModelLoadError, UnsupportedModelError
from homelab_llm.engine.model.loader import load_model, load_model_config
from homelab_llm.errors import HomelabError
from model_reference import (
    PagedHarness,
    hf_logits,
    hf_to_gguf,
    load_ours,
    make_hf_model,
    write_tiny_config,
)

PROMPT = [1, 2, 3, 4, 5, 6, 7]
DEFAULT_ROPE = dict(rope_type="default", rope_theta=10000.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    return folder, make_hf_model("llama", folder, rope_parameters=DEFAULT_ROPE)


def test_sharded_safetensors_index(tiny, tmp_path):
    folder, hf = tiny
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    _, ours = load_ours(tmp_path)
    torch.testing.assert_close(PagedHarness(ours).step({"s": PROMPT}), hf_logits(hf, PROMPT),
                               atol=2e-4, rtol=0)
    shards[-1].unlink()
    with pytest.raises(ModelLoadError, match=shards[-1].name):
        load_ours(tmp_path)


def test_missing_weight_is_named(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = tiny
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight\[k\]"):
        load_ours(tmp_path)


def test_gguf_f32_undoes_the_rope_permutation(tiny, tmp_path):
    """llama.cpp stores Llama Q/K rows interleaved for its rope; loaded back they match HF."""
    _, hf = tiny
    path = hf_to_gguf(hf, tmp_path / "tiny.gguf")
    config, ours = load_ours(path)
    assert config.architecture == "llama" and config.eos_token_ids == (1,)
    torch.testing.assert_close(PagedHarness(ours).step({"s": PROMPT}), hf_logits(hf, PROMPT),
                               atol=2e-4, rtol=0)


def test_gguf_llama3_rope_freqs_tensor(tmp_path):
    """Llama 3.1 GGUFs carry the llama3 rope scaling as a rope_freqs tensor, not as metadata."""
    hf = make_hf_model("llama", tmp_path / "hf")  # llama3 rope scaling
    config, ours = load_ours(hf_to_gguf(hf, tmp_path / "l3.gguf"))
    assert config.rope_scaling == {"rope_type": "freq_factors"}
    prompt = list(range(40, 70))  # long enough for the scaled low frequencies to matter
    torch.testing.assert_close(PagedHarness(ours).step({"s": prompt}), hf_logits(hf, prompt),
                               atol=2e-4, rtol=0)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_quantized_weights_are_exact_dequantizations(tiny, tmp_path, qtype):
    import gguf

    _, hf = tiny
    _, ours = load_ours(hf_to_gguf(hf, tmp_path / f"{qtype}.gguf", qtype))
    qt = gguf.GGMLQuantizationType[qtype]

    def roundtrip(t: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(t.numpy(), qt), qt))

    layer = hf.model.layers[1]
    qkv = ours.model.layers[1].self_attn.qkv_proj.weight
    q_rows = hf.config.num_attention_heads * hf.config.head_dim
    # Exact: the same bytes dequantized the same way, rows put back in HF order.
    assert torch.equal(qkv[:q_rows], roundtrip(layer.self_attn.q_proj.weight.detach()))
    assert torch.equal(ours.model.layers[1].mlp.down_proj.weight,
                       roundtrip(layer.mlp.down_proj.weight.detach()))
    blocks = ours.model.layers[1].mlp.down_proj.gguf_blocks.get(None)
    assert (blocks is not None) == (qtype != "Q8_0")  # records only for 4-bit types


def test_w4a16_from_gguf_blocks(tiny, tmp_path):
    """Q4 linears stay 4-bit (no dense weight at all) and compute what the dequantized model
    computes: the W4A16 reference accumulates in fp32 over the same values, so ~exact."""
    _, hf = tiny
    path = hf_to_gguf(hf, tmp_path / "q4.gguf", "Q4_1")
    config = load_model_config(path)
    dense = load_model(config, path, "gguf", torch.float32, "cpu")
    w4 = load_model(config, path, "gguf", torch.float32, "cpu", quantization="w4a16")
    qkv = w4.model.layers[0].self_attn.qkv_proj
    assert qkv.weight is None and qkv.w4.out_features == qkv.out_features
    assert all(not p.is_meta for p in w4.parameters())
    torch.testing.assert_close(PagedHarness(w4).step({"s": PROMPT}),
                               PagedHarness(dense).step({"s": PROMPT}), atol=1e-4, rtol=0)
    with pytest.raises(UnsupportedModelError, match="GGUF"):
        load_model(load_model_config(tiny[0]), tiny[0], "auto", torch.float32, "cpu",
                   quantization="w4a16")


def test_w4a16_keeps_non_4bit_linears_dense(tiny, tmp_path):
    """Mixed files (Q4_0 with a Q8_0 part): a fused linear with any non-4-bit part stays dense."""
    _, hf = tiny
    q8 = {}
    import gguf

    down = hf.model.layers[0].mlp.down_proj.weight.detach().numpy()
    q8["blk.0.ffn_down.weight"] = (gguf.quants.quantize(down, gguf.GGMLQuantizationType.Q8_0)
                                   .tobytes(), "Q8_0")
    path = hf_to_gguf(hf, tmp_path / "mixed.gguf", "Q4_0", raw_override=q8)
    model = load_model(load_model_config(path), path, "gguf", torch.float32, "cpu",
                       quantization="w4a16")
    assert model.model.layers[0].mlp.down_proj.w4 is None
    assert model.model.layers[0].mlp.down_proj.weight is not None
    assert model.model.layers[1].mlp.down_proj.w4 is not None
    assert torch.isfinite(PagedHarness(model).step({"s": PROMPT})).all()


def test_truncated_gguf_names_the_file(tiny, tmp_path):
    _, hf = tiny
    whole = hf_to_gguf(hf, tmp_path / "whole.gguf").read_bytes()
    for cut in (len(whole) // 2, 40):  # inside the tensor data, inside the header
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(whole[:cut])
        with pytest.raises(ModelLoadError, match=f"cut{cut}.gguf") as err:
            load_model_config(path)
        assert "truncated" in str(err.value)


def test_unsupported_tensor_type(tiny, tmp_path):
    _, hf = tiny
    # IQ4_NL: 32 weights per 18-byte block; down_proj is [96, 128] -> 96 rows of 4 blocks.
    raw = {"blk.0.ffn_down.weight": (bytes(96 * 4 * 18), "IQ4_NL")}
    path = hf_to_gguf(hf, tmp_path / "iq.gguf", raw_override=raw)
    with pytest.raises(UnsupportedModelError, match=r"IQ4_NL.*supported: F32.*Q4_K"):
        load_model_config(path)


def test_unknown_architecture(tiny, tmp_path):
    _, hf = tiny
    with pytest.raises(UnsupportedModelError, match=r"'falcon'.*supported: llama"):
        load_model_config(hf_to_gguf(hf, tmp_path / "falcon.gguf", arch="falcon"))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    with pytest.raises(UnsupportedModelError, match=r"gpt_neox.*llama, mistral, qwen2, qwen3"):
        load_model_config(tmp_path / "hf")


def test_missing_paths_are_user_errors(tmp_path):
    for path in (tmp_path / "nope.gguf", tmp_path / "nope"):
        with pytest.raises(HomelabError, match="nope"):
            load_model_config(path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model_config(tmp_path / "empty")


def test_dummy_weights_are_deterministic_and_finite(tmp_path):
    path = write_tiny_config(tmp_path)
    config = load_model_config(path, "dummy")
    a = load_model(config, path, "dummy", torch.float32, "cpu")
    b = load_model(config, path, "dummy", torch.float32, "cpu")
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    logits = PagedHarness(a).step({"s": PROMPT})
    assert torch.isfinite(logits).all() and logits.std() > 0
    assert np.isclose(a.model.layers[0].mlp.down_proj.weight.std().item(), 0.02, rtol=0.1)
