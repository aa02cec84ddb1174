"""kernels/attention_cpu.py against the references it stands in for (kernels/ref.py).

Bounds: the decode attention is the same SDPA computation as the reference on the same keys, so
fp32 results agree to 1e-5 (absolute and relative); the store writes the same rows bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels import attention_cpu, dispatch, ref


def _paged(seq_len: int, page_size: int, hkv: int, d: int, dtype: torch.dtype,
           gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cache of 8 pages holding one sequence on shuffled pages, and its page table [1, 6]."""
    k_cache = torch.randn(8, page_size, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(8, page_size, hkv, d, generator=gen).to(dtype)
    pages = torch.randperm(8, generator=gen)[:6].to(torch.int32)
    assert seq_len <= 6 * page_size
    return k_cache, v_cache, pages.unsqueeze(0)


@pytest.mark.parametrize("seq_len,hq,hkv", [(1, 4, 4), (13, 9, 3), (40, 8, 1), (33, 6, 2)])
def test_decode_one_sequence_matches_reference(seq_len: int, hq: int, hkv: int) -> None:
    gen = torch.Generator().manual_seed(seq_len * 100 + hq)
    d, page_size = 16, 8
    k_cache, v_cache, table = _paged(seq_len, page_size, hkv, d, torch.float32, gen)
    q = torch.randn(1, hq, d, generator=gen)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    sl = torch.tensor([seq_len], dtype=torch.int32)
    want = ref.paged_attention_ref(q, k_cache, v_cache, table, qsl, sl, 0.25, None, None, [1], [seq_len])
    got = attention_cpu.decode_one_sequence(q, k_cache, v_cache, table, seq_len, 0.25)
    assert got is not None and got.shape == (1, hq, d)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # dispatch routes a one-sequence decode here (host lengths known) and agrees.
    routed = dispatch.paged_attention(q, k_cache, v_cache, table, qsl, sl, 0.25, None, None, [1], [seq_len])
    torch.testing.assert_close(routed, want, atol=1e-5, rtol=1e-5)


def test_decode_reads_a_bf16_cache_in_the_query_dtype() -> None:
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, table = _paged(20, 4, 2, 16, torch.bfloat16, gen)
    q = torch.randn(1, 4, 16, generator=gen)
    got = attention_cpu.decode_one_sequence(q, k_cache, v_cache, table, 20, 0.25)
    want = ref.paged_attention_ref(q, k_cache, v_cache, table, torch.tensor([0, 1]),
                                   torch.tensor([20]), 0.25, None, None, [1], [20])
    assert got is not None and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_int8_cache_is_left_to_the_reference() -> None:
    cache = torch.zeros(2, 4, 1, 16, dtype=torch.int8)
    q = torch.randn(1, 2, 16)
    assert attention_cpu.decode_one_sequence(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32), 3, 1.0) is None
    kv = torch.randn(1, 1, 16)
    assert not attention_cpu.store_kv(kv, kv, cache, cache, torch.tensor([2]))


def test_store_kv_matches_reference_and_skips_padding() -> None:
    gen = torch.Generator().manual_seed(4)
    key, value = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, 16, generator=gen)
    slots = torch.tensor([5, 0, 11])
    caches = [torch.zeros(4, 4, 2, 16) for _ in range(4)]
    assert attention_cpu.store_kv(key, value, caches[0], caches[1], slots)
    ref.store_kv_ref(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    # A padded row (slot -1) is the reference's job: nothing is written here.
    before = caches[0].clone()
    assert not attention_cpu.store_kv(key, value, caches[0], caches[1], torch.tensor([1, -1, 2]))
    assert torch.equal(caches[0], before)
    dispatch.store_kv(key, value, caches[0], caches[1], torch.tensor([1, -1, 2]))
    flat = caches[0].view(16, 2, 16)
    assert torch.equal(flat[1], key[0]) and torch.equal(flat[2], key[2])
