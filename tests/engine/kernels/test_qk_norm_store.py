"""QK-norm attention (Qwen3, Qwen3-MoE, Gemma 3's layers) on the GPU path, interpreted: the q/k
norms inside the kernel that rotates q and k and stores K/V (Attention.norms_in_store) against
the separate q/k norm launch, through LlamaAttention.attend over a bound paged cache: the layer
output and the K/V written, bf16 and int8 caches, and the launches each path takes.

Bounds: the two paths differ only in the order of each head's fp32 sum of squares, which can
move a bf16 rounding by an ulp: K/V caches and the output agree to 1e-2 (row-relative); int8
codes differ by at most one step on few entries. A missing or misplaced norm is of order 1.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

from homelab_llm.engine.context import forward_context
from homelab_llm.engine.kernels import dispatch
from homelab_llm.engine.layers.attention import Attention
from homelab_llm.engine.layers.rotary import RotaryEmbedding
from homelab_llm.engine.model.config import ModelConfig
from homelab_llm.engine.model.llama import LlamaAttention
from tests.engine.kernels.launch_count import bind_cache, count_calls, decode_context, random_weights

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="counts launches through the Triton interpreter (CPU only)")

HEADS, KV_HEADS, D, PAGE = 4, 2, 32, 4


def _attention(cache_dtype: torch.dtype) -> LlamaAttention:
    config = ModelConfig(architecture="qwen3", vocab_size=8, hidden_size=64, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, head_dim=D, qk_norm=True, name="tiny")
    torch.manual_seed(3)
    attn = random_weights(LlamaAttention(config), 0.2).to(torch.bfloat16)
    bind_cache(attn.attn, cache_dtype, page_size=PAGE)
    return attn


def _step(cache_dtype: torch.dtype, fused: bool, monkeypatch):
    attn = _attention(cache_dtype)
    rotary = RotaryEmbedding(D, 64, 1000000.0, None)
    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    if not fused:
        monkeypatch.setattr(Attention, "norms_in_store", lambda self, q, rope: False)
    qkv = (torch.randn(1, (HEADS + 2 * KV_HEADS) * D, generator=torch.Generator().manual_seed(9))
           * 2).to(torch.bfloat16)
    ctx = decode_context()
    with forward_context(ctx):
        rope = rotary.lookup(ctx.positions, torch.bfloat16)
        attn.attend(qkv, rope)  # first-use buffers (GEMV tickets) outside the count; the store
        counts, out = count_calls(monkeypatch, lambda: attn.attend(qkv, rope))  # is idempotent
    monkeypatch.undo()
    return counts, out, attn.attn


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.int8])
def test_norms_in_the_store_kernel_match_the_separate_launch(cache_dtype, monkeypatch) -> None:
    want_counts, want, want_attn = _step(cache_dtype, False, monkeypatch)
    got_counts, got, got_attn = _step(cache_dtype, True, monkeypatch)
    assert want_counts["triton._qk_norm_kernel"] == 1
    assert "triton._qk_norm_kernel" not in got_counts
    assert sum(got_counts.values()) == sum(want_counts.values()) - 1
    assert got_counts["triton._rope_store_kv_kernel"] == 1
    assert _rel(got, want) < 1e-2
    new_k, new_v = got_attn.k_cache[1, 1], got_attn.v_cache[1, 1]  # slot 5: page 1, offset 1
    if cache_dtype == torch.int8:
        for g, w in ((new_k, want_attn.k_cache[1, 1]), (new_v, want_attn.v_cache[1, 1])):
            assert int((g.int() - w.int()).abs().max()) <= 1
        torch.testing.assert_close(got_attn.k_scale, want_attn.k_scale, rtol=1e-3, atol=0)
    else:
        assert _rel(new_k, want_attn.k_cache[1, 1]) < 1e-2
        assert torch.equal(new_v, want_attn.v_cache[1, 1])
    untouched = torch.ones(4, PAGE, dtype=torch.bool)
    untouched[1, 1] = False
    assert torch.equal(got_attn.k_cache[untouched], want_attn.k_cache[untouched])
    assert Counter(got_counts) != Counter(want_counts)
