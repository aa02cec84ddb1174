"""The CPU decode-step attention in one C call (kernels/decode_attention_native.py) against torch:
rotate-half RoPE, the cache store at the new token's row, and SDPA over the sequence's pages with
GQA. fp32 throughout, the exponential a polynomial: bound 1e-5 relative (Frobenius) on the
output (observed ~1e-7), the stored k within 1e-6 of the rotated one (FMA rounding), v exact.
Head shapes (6 q / 2 kv x 64, 4 / 4 x 128, 16 / 1 x 32) and sequences of 1 to 600 positions
cover one chunk, several chunks merged by their maxima, and the threaded split; pages are
shuffled, so the page table is read, not assumed consecutive.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from homelab_llm.engine.kernels import decode_attention_native as native

PAGE = 4

pytestmark = pytest.mark.skipif(not native.available(6, 2, 64), reason="the C attention does not run here")


def _rotate(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos_sin.chunk(2)
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), -1)


@pytest.mark.parametrize("heads", [(6, 2, 64), (4, 4, 128), (16, 1, 32)])
@pytest.mark.parametrize("seq_len", [1, 7, 300, 600])
def test_matches_rotary_and_sdpa_over_shuffled_pages(seq_len, heads):
    HQ, HKV, D = heads  # noqa: N806 - the shapes' usual names
    g = torch.Generator().manual_seed(seq_len)
    n_pages = (seq_len + PAGE - 1) // PAGE + 3
    k_cache = torch.randn(n_pages, PAGE, HKV, D, generator=g)
    v_cache = torch.randn(n_pages, PAGE, HKV, D, generator=g)
    pages = torch.randperm(n_pages, generator=g)[: (seq_len + PAGE - 1) // PAGE].to(torch.int32)
    pos = seq_len - 1
    slot = int(pages[pos // PAGE]) * PAGE + pos % PAGE
    qkv = torch.randn(1, (HQ + 2 * HKV) * D, generator=g) * 2
    angles = torch.rand(D // 2, generator=g) * 6
    cos_sin = torch.cat((angles.cos(), angles.sin()))
    scale = D ** -0.5
    # the reference: rotate, store, gather the sequence's rows, SDPA with each KV head repeated
    q = _rotate(qkv[0, : HQ * D].view(HQ, D), cos_sin)
    k_new = _rotate(qkv[0, HQ * D: (HQ + HKV) * D].view(HKV, D), cos_sin)
    v_new = qkv[0, (HQ + HKV) * D:].view(HKV, D)
    k_ref, v_ref = k_cache.clone().view(-1, HKV, D), v_cache.clone().view(-1, HKV, D)
    k_ref[slot], v_ref[slot] = k_new, v_new
    rows = (pages.long().repeat_interleave(PAGE) * PAGE + torch.arange(PAGE).repeat(len(pages)))[:seq_len]
    keys = k_ref[rows].transpose(0, 1).repeat_interleave(HQ // HKV, dim=0)  # [HQ, S, D]
    values = v_ref[rows].transpose(0, 1).repeat_interleave(HQ // HKV, dim=0)
    want = F.scaled_dot_product_attention(q.unsqueeze(1), keys, values, scale=scale).reshape(1, HQ * D)
    out = torch.full((1, HQ * D), float("nan"))
    native.DecodeAttention(HQ, HKV, D, scale)(qkv, cos_sin, k_cache, v_cache, pages, slot, seq_len, out)
    assert float((out - want).norm() / want.norm()) < 1e-5
    assert torch.allclose(k_cache.view(-1, HKV, D)[slot], k_new, atol=1e-6, rtol=1e-6)
    assert torch.equal(v_cache.view(-1, HKV, D)[slot], v_new)
    others = torch.ones(n_pages * PAGE, dtype=torch.bool)
    others[slot] = False
    assert torch.equal(k_cache.view(-1, HKV, D)[others], k_ref[others])  # nothing else written


def test_shapes_it_does_not_take_are_declined():
    assert not native.available(6, 2, 40)  # head dim not a multiple of 16
    assert not native.available(64, 2, 64)  # 32 query heads a KV head
    assert not native.available(6, 4, 64)  # heads not a multiple
