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

from homelab_llm.engine.context import ForwardContext, forward_context
from homelab_llm.engine.kernels import dispatch
from homelab_llm.engine.layers.attention import Attention
from homelab_llm.engine.layers.rotary import RotaryEmbedding
from homelab_llm.engine.model.config import ModelConfig
from homelab_llm.engine.model.llama import LlamaAttention
from tests.engine.kernels.launch_count import count_calls

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="counts launches through the Triton interpreter (CPU only)")

HEADS, KV_HEADS, D, PAGE = 4, 2, 32, 4


def _attention(cache_dtype: torch.dtype) -> LlamaAttention:
    config = ModelConfig(architecture="qwen3", vocab_size=8, hidden_size=64, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, head_dim=D, qk_norm=True, name="tiny")
    torch.manual_seed(3)
    attn = LlamaAttention(config)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.2)
    attn = attn.to(torch.bfloat16)
    shape = (4, PAGE, KV_HEADS, D)
    attn.attn.k_cache = torch.randn(shape).to(cache_dtype) if cache_dtype != torch.int8 else \
        torch.randint(-100, 100, shape, dtype=torch.int8)
    attn.attn.v_cache = attn.attn.k_cache.clone()
    if cache_dtype == torch.int8:
        attn.attn.k_scale = torch.full(shape[:3], 0.01, dtype=torch.float16)
        attn.attn.v_scale = attn.attn.k_scale.clone()
    return attn


def _ctx() -> ForwardContext:
    return ForwardContext(
        positions=torch.tensor([5]), slot_mapping=torch.tensor([5]),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([6], dtype=torch.int32),
        page_table=torch.tensor([[2, 1]], dtype=torch.int32), max_query_len=1, max_seq_len=6,
        page_size=PAGE, decode_only=True, query_lens_host=[1], seq_lens_host=[6], num_kv_splits=2)


def _step(cache_dtype: torch.dtype, fused: bool, monkeypatch):
    attn = _attention(cache_dtype)
    rotary = RotaryEmbedding(D, 64, 1000000.0, None)
    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    if not fused:
        monkeypatch.setattr(Attention, "norms_in_store", lambda self, q, rope: False)
    qkv = (torch.randn(1, (HEADS + 2 * KV_HEADS) * D, generator=torch.Generator().manual_seed(9))
           * 2).to(torch.bfloat16)
    ctx = _ctx()
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
