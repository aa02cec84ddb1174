"""Sliding-window and attention-sink variants of the decode and prefill kernels against
paged_attention_ref, and the reference itself against a dense masked softmax written out here."""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels.ref import paged_attention_ref


def _dense(q, k, v, q_pos, scale, window, sinks):
    """q [Lq, Hq, D] at positions q_pos over k/v [Lk, Hkv, D], the formula spelled out."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    kp = torch.arange(k.shape[0])[None, :]
    vis = kp <= q_pos[:, None]
    if window:
        vis &= kp > q_pos[:, None] - window
    s = s.masked_fill(~vis[None], float("-inf"))
    e = torch.exp(s)
    denom = e.sum(-1)
    if sinks is not None:
        denom = denom + torch.exp(sinks.double())[:, None]
    return torch.einsum("hqk,khd->qhd", e / denom[..., None], v.double()).float()


@pytest.mark.parametrize("window,with_sinks", [(5, False), (0, True), (7, True)])
def test_reference_matches_dense_formula(window: int, with_sinks: bool, paged_kv) -> None:
    gen = torch.Generator().manual_seed(4)
    seq_lens, q_lens = [23, 9], [6, 1]
    k_cache, v_cache, _, _, pt = paged_kv(seq_lens, 2, 16, 4, torch.float32, torch.device("cpu"), gen)
    q = torch.randn(sum(q_lens), 4, 16, generator=gen)
    sinks = torch.randn(4, generator=gen) if with_sinks else None
    qsl = torch.tensor([0, 6, 7], dtype=torch.int32)
    got = paged_attention_ref(q, k_cache, v_cache, pt, qsl, torch.tensor(seq_lens), 0.25,
                              window=window, sinks=sinks)
    start = 0
    for b, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        k = k_cache[pt[b].long()].flatten(0, 1)[:sl]
        v = v_cache[pt[b].long()].flatten(0, 1)[:sl]
        want = _dense(q[start:start + ql], k, v, torch.arange(sl - ql, sl), 0.25, window, sinks)
        # float32 reference vs float64 formula: 1e-5.
        torch.testing.assert_close(got[start:start + ql], want, atol=1e-5, rtol=1e-5)
        start += ql


def _poison_outside_window(k_cache, v_cache, page_table, seq_lens, q_lens, window, page_size):
    """NaN in every page wholly below each sequence's oldest visible key (in the int8 cache's
    scales): a kernel that reads a page it may not (a freed page) turns its output NaN."""
    for b, (sl, ql) in enumerate(zip(seq_lens, q_lens)):
        oldest = max(0, sl - ql - window + 1)
        for p in range(oldest // page_size):
            k_cache[int(page_table[b, p])] = float("nan")
            v_cache[int(page_table[b, p])] = float("nan")


def _ref_view(cache: torch.Tensor) -> torch.Tensor:
    return cache if cache.dtype == torch.int8 else cache.float()


@pytest.mark.parametrize("kv_dtype,window,with_sinks", [
    (torch.bfloat16, 6, False), (torch.bfloat16, 0, True), (torch.bfloat16, 9, True),
    (torch.float32, 6, False), (torch.float32, 9, True), (torch.int8, 9, True)])
def test_decode_window_and_sinks(kv_dtype, window, with_sinks, device, paged_kv) -> None:
    from homelab_llm.engine.kernels.decode_attention import paged_decode_attention

    gen = torch.Generator().manual_seed(5)
    seq_lens, hq, hkv, d, page_size = [1, 7, 40, 29], 4, 2, 32, 4
    k_cache, v_cache, ks, vs, pt = paged_kv(seq_lens, hkv, d, page_size, kv_dtype, device, gen)
    if window:
        poisoned = (ks, vs) if kv_dtype == torch.int8 else (k_cache, v_cache)
        _poison_outside_window(*poisoned, pt, seq_lens, [1] * 4, window, page_size)
    q_dtype = torch.bfloat16 if kv_dtype == torch.int8 else kv_dtype
    q = torch.randn(4, hq, d, generator=gen).to(device, q_dtype)
    sinks = (2.0 * torch.randn(hq, generator=gen)).to(device) if with_sinks else None
    qsl = torch.arange(5, dtype=torch.int32, device=device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    want = paged_attention_ref(q.float(), _ref_view(k_cache), _ref_view(v_cache), pt, qsl, sl,
                               d ** -0.5, ks, vs, window=window, sinks=sinks)
    assert torch.isfinite(want).all()
    for splits in (1, 4):
        got = paged_decode_attention(q, k_cache, v_cache, pt, qsl, sl, d ** -0.5, ks, vs,
                                     num_splits=splits, window=window, sinks=sinks)
        # bf16 operands/output on unit-variance values: 2e-2 (int8 KV: the same dequantized rows
        # on both sides); fp32 (tf32 dot on a GPU): 5e-3.
        tol = 5e-3 if kv_dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("window,with_sinks", [(5, False), (0, True), (11, True)])
def test_prefill_window_and_sinks(window, with_sinks, device, paged_kv) -> None:
    from homelab_llm.engine.kernels.prefill_attention import paged_prefill_attention

    gen = torch.Generator().manual_seed(6)
    q_lens, seq_lens, hq, hkv, d, page_size = [5, 1, 0, 19], [5, 9, 3, 40], 4, 2, 32, 4
    k_cache, v_cache, _, _, pt = paged_kv(seq_lens, hkv, d, page_size, torch.bfloat16, device, gen)
    if window:
        _poison_outside_window(k_cache, v_cache, pt, seq_lens, q_lens, window, page_size)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(device, torch.bfloat16)
    sinks = (2.0 * torch.randn(hq, generator=gen)).to(device) if with_sinks else None
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    want = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), pt, qsl, sl, d ** -0.5,
                               window=window, sinks=sinks)
    assert torch.isfinite(want).all()
    got = paged_prefill_attention(q, k_cache, v_cache, pt, qsl, sl, d ** -0.5, max_query_len=19,
                                  window=window, sinks=sinks)
    # bf16 operands and output on unit-variance data: 2e-2 absolute and relative.
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_bad_sinks_are_rejected(device, paged_kv) -> None:
    from homelab_llm.engine.kernels.decode_attention import paged_decode_attention

    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache, _, _, pt = paged_kv([4], 1, 32, 4, torch.float32, device, gen)
    q = torch.randn(1, 2, 32, generator=gen).to(device)
    qsl = torch.arange(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="sinks"):
        paged_decode_attention(q, k_cache, v_cache, pt, qsl, qsl[1:], 0.2,
                               sinks=torch.zeros(3, device=device))
    with pytest.raises(ValueError, match="window"):
        paged_decode_attention(q, k_cache, v_cache, pt, qsl, qsl[1:], 0.2, window=-1)
