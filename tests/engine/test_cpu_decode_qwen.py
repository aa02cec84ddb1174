"""The CPU decode plan (model/cpu_decode_layer.py) on Qwen2 and Qwen3 GGUFs: the qkv projection's
bias (Qwen2) and each q / k head's RMSNorm (Qwen3) happen inside our attention call.

Tiny random transformers models written as GGUF the way llama.cpp's converter writes them
(model_reference.hf_to_gguf): as F32 our loader reproduces transformers' logits (2e-4, the
loader's Qwen mapping: biases, q / k norms, head_dim from key_length); as Q4_1 under the CPU
default the plan's steps (one token, 5 verify tokens, several sequences, a short prompt) match the
general path's from the same cache contents. Both paths run the same 4-bit kernel on the same
int8 activation codes at these row counts, so they differ by fp32 rounding order and the int8
codes that flips: relative < 0.02 and max < 0.03 of max |logit| (observed ~1e-6; dropping the
bias or the norms moves them 10-60%), greedy picks equal on all but at most 2 rows."""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels import decode_attention_native, q4_native
from homelab_llm.engine.model.cpu_decode_layer import CpuDecodePlan
from homelab_llm.engine.model.loader import load_model, load_model_config
from model_reference import PagedHarness, hf_logits, hf_to_gguf, load_ours, make_hf_model, plan_and_general

PROMPT = [1, 2, 3, 4, 5, 6, 7]
ROPE = dict(rope_type="default", rope_theta=1e6)


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def qwen(tmp_path_factory, request):
    """(kind, the transformers model, a folder for its GGUFs)."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(request.param, folder / "hf", rope_parameters=ROPE)
    with torch.no_grad():  # Qwen2's biases start at zero: make them count (the GGUFs read hf)
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                if proj.bias is not None:
                    proj.bias.normal_(0.0, 0.5)
    return request.param, hf, folder


def test_gguf_f32_matches_transformers(qwen):
    kind, hf, folder = qwen
    config, ours = load_ours(hf_to_gguf(hf, folder / "f32.gguf", arch=kind))
    assert config.architecture == kind
    assert config.attention_bias == (kind == "qwen2") and config.qk_norm == (kind == "qwen3")
    torch.testing.assert_close(PagedHarness(ours).step({"s": PROMPT}), hf_logits(hf, PROMPT),
                               atol=2e-4, rtol=0)


@pytest.mark.skipif(not q4_native.available() or not decode_attention_native.available(6, 2, 16),
                    reason="our C kernels do not run here")
def test_plan_with_bias_and_qk_norms_matches_the_general_path(qwen):
    kind, hf, folder = qwen
    path = hf_to_gguf(hf, folder / "q4.gguf", "Q4_1", arch=kind)
    model = load_model(load_model_config(path), path, "gguf", torch.float32, "cpu", fast_cpu=True)
    plan = model.model.cpu_decode
    assert isinstance(plan, CpuDecodePlan) and plan.native_attention is not None
    first = plan.layers[0]
    assert (first.qkv_bias is not None) == (kind == "qwen2") and (first.q_norm is not None) == (kind == "qwen3")
    steps = [{"a": PROMPT * 3, "b": PROMPT[:5] * 4},  # 41 rows: the general path for both runs
             {"a": [5]},
             {"a": [7, 8, 9, 10, 11], "b": [6]},
             {"a": [12], "b": [13, 14, 15], "c": PROMPT}]
    ref, got = plan_and_general(model, steps, num_pages=32, seed=2)
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 0.02
    assert float((got - ref).abs().max()) < 0.03 * float(ref.abs().max())
    assert int((got.argmax(-1) == ref.argmax(-1)).sum()) >= got.shape[0] - 2
