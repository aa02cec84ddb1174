"""Paged prefill/extend attention against paged_attention_ref (same causal + prefix semantics)."""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels.ref import paged_attention_ref


def _cases(full: bool) -> list[tuple[list[int], list[int], int, int, int, int]]:
    # (query_lens, seq_lens, q_heads, kv_heads, head_dim, page_size); seq_len - q_len = cached prefix
    if full:
        return [([512], [512], 32, 8, 128, 16),
                ([300, 1, 0, 2048], [4396, 17, 40, 2048], 32, 8, 128, 16),
                ([128] * 8, [16384] * 8, 32, 8, 128, 64)]
    # head_dim 48: int8 rows stored unrotated (ref.kv_rotation is None)
    return [([5, 1, 0, 19], [5, 9, 3, 40], 4, 2, 32, 4), ([17], [30], 3, 1, 32, 8), ([3], [11], 2, 1, 48, 4)]


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16, torch.int8])
def test_prefill_matches_reference(kv_dtype: torch.dtype, device: torch.device, full_shapes: bool,
                                   paged_kv) -> None:
    from homelab_llm.engine.kernels.prefill_attention import paged_prefill_attention

    gen = torch.Generator().manual_seed(0)
    q_dtype = torch.float16 if kv_dtype == torch.float16 else torch.bfloat16
    for q_lens, seq_lens, hq, hkv, d, page_size in _cases(full_shapes):
        k_cache, v_cache, ks, vs, page_table = paged_kv(seq_lens, hkv, d, page_size, kv_dtype, device, gen)
        q = torch.randn(sum(q_lens), hq, d, generator=gen).to(device, q_dtype)
        qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
        sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        scale = d ** -0.5
        kc = k_cache if kv_dtype == torch.int8 else k_cache.float()
        vc = v_cache if kv_dtype == torch.int8 else v_cache.float()
        want = paged_attention_ref(q.float(), kc, vc, page_table, qsl, sl, scale, ks, vs)
        for max_q in (None, max(q_lens)):
            got = paged_prefill_attention(q, k_cache, v_cache, page_table, qsl, sl, scale, ks, vs,
                                          max_query_len=max_q)
            # bf16/fp16 operands and output on unit-variance data: 2e-2 absolute and relative.
            torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2,
                                       msg=lambda m: f"{q_lens=} {seq_lens=}: {m}")


def test_prefill_is_causal(device: torch.device, paged_kv) -> None:
    """Changing a later token's K/V must not change an earlier query's output."""
    from homelab_llm.engine.kernels.prefill_attention import paged_prefill_attention

    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, _, _, page_table = paged_kv([20], 2, 32, 4, torch.float32, device, gen)
    q = torch.randn(20, 2, 32, generator=gen).to(device)
    qsl = torch.tensor([0, 20], dtype=torch.int32, device=device)
    sl = torch.tensor([20], dtype=torch.int32, device=device)
    before = paged_prefill_attention(q, k_cache, v_cache, page_table, qsl, sl, 0.2)
    last_page = int(page_table[0, 19 // 4])
    k_cache[last_page, 19 % 4] += 5.0
    after = paged_prefill_attention(q, k_cache, v_cache, page_table, qsl, sl, 0.2)
    torch.testing.assert_close(after[:19], before[:19], atol=0.0, rtol=0.0)
    assert (after[19] - before[19]).abs().max().item() > 1e-3
