"""KV store kernel against store_kv_ref: bit-exact, int8 quantization included."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.common import int8_to_fp16
from homelab_llm.engine.kernels.ref import store_kv_ref


def _caches(num_pages: int, page_size: int, heads: int, d: int, dtype: torch.dtype, device: torch.device):
    k = torch.zeros(num_pages, page_size, heads, d, dtype=dtype, device=device)
    v = torch.zeros_like(k)
    if dtype != torch.int8:
        return k, v, None, None
    ks = torch.zeros(num_pages, page_size, heads, dtype=torch.float16, device=device)
    return k, v, ks, torch.zeros_like(ks)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8])
def test_store_matches_reference_exactly(cache_dtype: torch.dtype, device: torch.device, full_shapes: bool) -> None:
    from homelab_llm.engine.kernels.kv_store import store_kv

    gen = torch.Generator().manual_seed(0)
    tokens, heads, d, page_size, pages = (4096, 8, 128, 16, 300) if full_shapes else (37, 3, 32, 4, 12)
    key = (torch.randn(tokens, heads, d, generator=gen) * 3).to(device, torch.bfloat16)
    value = torch.randn(tokens, heads, d, generator=gen).to(device, torch.bfloat16)
    # Exact .5 ties after scaling and an all-zero head, the cases rounding code gets wrong.
    key[0, 0, :4] = torch.tensor([127.0, 0.5, -1.5, 2.5])
    value[1, 0] = 0.0
    slots = torch.randperm(pages * page_size, generator=gen)[:tokens].to(device)
    slots[3] = -1  # padding
    got = _caches(pages, page_size, heads, d, cache_dtype, device)
    want = _caches(pages, page_size, heads, d, cache_dtype, device)
    store_kv(key, value, got[0], got[1], slots, got[2], got[3])
    store_kv_ref(key, value, want[0], want[1], slots, want[2], want[3])
    for g, w in zip(got, want):
        if g is not None:
            assert torch.equal(g, w)


def test_store_to_strided_cache_view(device: torch.device) -> None:
    """Caches are often views into one pool tensor; strides must be honoured."""
    from homelab_llm.engine.kernels.kv_store import store_kv

    gen = torch.Generator().manual_seed(1)
    pool = torch.zeros(2, 6, 4, 2, 32, device=device)  # [k/v, pages, page_size, heads, d]
    key = torch.randn(5, 2, 32, generator=gen).to(device)
    value = torch.randn(5, 2, 32, generator=gen).to(device)
    slots = torch.tensor([0, 5, 9, 23, 11], device=device)
    store_kv(key, value, pool[0], pool[1], slots)
    flat_k = pool[0].reshape(-1, 2, 32)
    torch.testing.assert_close(flat_k[slots], key, atol=0.0, rtol=0.0)
    assert pool[1].reshape(-1, 2, 32)[slots].equal(value)



@triton.jit
def _convert_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, int8_to_fp16(tl.load(x_ptr + offs)))


def test_int8_to_fp16_bit_trick_is_exact(device: torch.device) -> None:
    """The int8 -> fp16 conversion the attention kernels use for int8 KV, over all 256 values."""
    x = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8).to(device)
    out = torch.empty(256, dtype=torch.float16, device=device)
    _convert_kernel[(1,)](x, out, N=256)
    assert torch.equal(out, x.to(torch.float16))
