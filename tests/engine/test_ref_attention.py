"""The CPU path's batched decode attention equals the per-sequence reference, bf16/fp32/int8 KV."""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels.ref import INT8_SCALE_DTYPE, paged_attention_ref, store_kv_ref


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
def test_batched_decode_equals_one_sequence_at_a_time(kv_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    pages, ps, hq, hkv, d = 24, 4, 6, 2, 16
    k_cache = torch.zeros(pages, ps, hkv, d, dtype=kv_dtype)
    v_cache = torch.zeros_like(k_cache)
    scales = (None, None)
    if kv_dtype == torch.int8:
        scales = (torch.ones(pages, ps, hkv, dtype=INT8_SCALE_DTYPE),
                  torch.ones(pages, ps, hkv, dtype=INT8_SCALE_DTYPE))
    lengths = [3, 17, 9, 1]
    perm = torch.randperm(pages, generator=g).tolist()  # pages scattered through the pool
    table = torch.zeros(len(lengths), 6, dtype=torch.int32)
    for b, n in enumerate(lengths):
        mine = [perm.pop() for _ in range(-(-n // ps))]
        table[b, :len(mine)] = torch.tensor(mine)
        slots = torch.tensor([mine[i // ps] * ps + i % ps for i in range(n)])
        store_kv_ref(torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g),
                     k_cache, v_cache, slots, *scales)
    q = torch.randn(len(lengths), hq, d, generator=g)
    qsl = torch.arange(len(lengths) + 1, dtype=torch.int32)
    batched = paged_attention_ref(q, k_cache, v_cache, table, qsl, torch.tensor(lengths), 0.25,
                                  *scales)
    for b, n in enumerate(lengths):
        one = paged_attention_ref(q[b:b + 1], k_cache, v_cache, table[b:b + 1],
                                  torch.tensor([0, 1]), torch.tensor([n]), 0.25, *scales)
        torch.testing.assert_close(batched[b:b + 1], one, rtol=1e-5, atol=1e-6)
