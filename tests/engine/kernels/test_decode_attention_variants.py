"""The decode split kernel's variants (tuning.AttentionTiles: int8 score dots, scale and K/V
prefetch, fused merge, q prepared in the first tile, several pages per inner step) against paged_attention_ref: GQA groups of 1-8 query heads,
tails that end inside a page and inside a step, int8 rows with their per-token scales (rotated
head_dim 32/64 and unrotated 48), sinks and windows, empty splits and empty sequences."""

from __future__ import annotations

import pytest
import torch

import triton
import triton.language as tl

from homelab_llm.engine.kernels.decode_steps import split_q_int8
from homelab_llm.engine.kernels.ref import paged_attention_ref
from homelab_llm.engine.kernels.tuning import AttentionTiles

VARIANTS = {
    "int8dot": AttentionTiles(16, 1, 1, int8_dot=True),
    "scales.b32": AttentionTiles(32, 1, 1, prefetch_scales=True),
    "kv.b16": AttentionTiles(16, 1, 1, prefetch_kv=True),
    "fused.b16": AttentionTiles(16, 1, 1, fused_merge=True),
    "lateq.dot.b16": AttentionTiles(16, 1, 1, int8_dot=True, late_q=True),
    "split_unrotates.b16": AttentionTiles(16, 1, 1, merge_unrotates=False),
    "split_unrotates.fused.b16": AttentionTiles(16, 1, 1, merge_unrotates=False, fused_merge=True),
    "all.b32": AttentionTiles(32, 1, 1, int8_dot=True, prefetch_scales=True, prefetch_kv=True, fused_merge=True,
                              late_q=True),
}
# (seq_lens, q_heads, kv_heads, head_dim, page_size): page 4 with block_n 16/32 gathers 4-8 pages a
# step; lengths end mid-page and mid-step; groups of 4, 8, 1 and 2 query heads.
SHAPES = [([1, 7, 40, 101], 8, 2, 32, 4), ([70, 5], 8, 1, 64, 8), ([33], 3, 3, 32, 4),
          ([9, 3], 2, 1, 48, 4)]
# bf16 q/out on unit-variance values: 2e-2, as test_decode_attention.
TOL = 2e-2


def _run(paged_kv, device, kv_dtype, shape, tiles, splits, seed, **kw):
    from homelab_llm.engine.kernels.decode_attention import paged_decode_attention

    seq_lens, hq, hkv, d, page_size = shape
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, ks, vs, page_table = paged_kv(seq_lens, hkv, d, page_size, kv_dtype, device, gen)
    batch = len(seq_lens)
    q = torch.randn(batch, hq, d, generator=gen).to(device, torch.bfloat16)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    kc = k_cache if kv_dtype == torch.int8 else k_cache.float()
    vc = v_cache if kv_dtype == torch.int8 else v_cache.float()
    want = paged_attention_ref(q.float(), kc, vc, page_table, qsl, sl, d ** -0.5, ks, vs, **kw)
    got = paged_decode_attention(q, k_cache, v_cache, page_table, qsl, sl, d ** -0.5, ks, vs,
                                 num_splits=splits, tiles=tiles, **kw)
    return got.float(), want


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8], ids=["bf16", "int8"])
def test_variant_matches_reference(name: str, kv_dtype: torch.dtype, device: torch.device, paged_kv) -> None:
    for i, shape in enumerate(SHAPES):
        for splits in (1, 2, 8):  # 8: splits past the short sequences' ends (empty splits)
            got, want = _run(paged_kv, device, kv_dtype, shape, VARIANTS[name], splits, seed=10 * i + splits)
            torch.testing.assert_close(got, want, atol=TOL, rtol=TOL,
                                       msg=lambda m: f"{name} {shape=} {splits=}: {m}")


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8], ids=["bf16", "int8"])
def test_fused_merge_with_sinks_window_and_empty_rows(kv_dtype: torch.dtype, device: torch.device,
                                                      paged_kv) -> None:
    """Sinks ride on split 0 even when it has no keys; a window leaves leading splits empty; both
    must reach the ticket so the group's last program merges."""
    tiles = VARIANTS["all.b32"]
    shape = ([50, 3, 90], 8, 2, 32, 4)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(5)).float().to(device)
    for splits in (2, 8):
        got, want = _run(paged_kv, device, kv_dtype, shape, tiles, splits, seed=splits, window=20, sinks=sinks)
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)


def test_fused_merge_leaves_tickets_at_zero_and_empty_rows_zero(device: torch.device, paged_kv) -> None:
    """A replayed launch (a decode graph) needs the counters back at zero; a padded row of
    length 0 (every split empty) comes out as zeros."""
    from homelab_llm.engine.kernels.decode_attention import paged_decode_attention
    from homelab_llm.engine.kernels.decode_merge import decode_tickets

    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache, ks, vs, page_table = paged_kv([40, 1], 2, 32, 4, torch.int8, device, gen)
    q = torch.randn(2, 8, 32, generator=gen).to(device, torch.bfloat16)
    qsl = torch.arange(3, dtype=torch.int32, device=device)
    sl = torch.tensor([40, 0], dtype=torch.int32, device=device)
    outs = [paged_decode_attention(q, k_cache, v_cache, page_table, qsl, sl, 0.2, ks, vs, num_splits=4,
                                   tiles=VARIANTS["all.b32"]) for _ in range(2)]
    assert torch.equal(outs[0], outs[1])
    assert outs[0][1].abs().max().item() == 0.0 and torch.isfinite(outs[0]).all()
    assert int(decode_tickets(device, 2, 2).abs().sum()) == 0


@triton.jit
def _split_probe(q_ptr, hi_ptr, lo_ptr, step_ptr, M: tl.constexpr, D: tl.constexpr):
    offs = tl.arange(0, M)[:, None] * D + tl.arange(0, D)[None, :]
    hi, lo, step = split_q_int8(tl.load(q_ptr + offs))
    tl.store(hi_ptr + offs, hi)
    tl.store(lo_ptr + offs, lo)
    tl.store(step_ptr + tl.arange(0, M), step)


def test_split_q_int8_error_bound(device: torch.device) -> None:
    """q ~= (254 hi + lo) * step within step / 2 (+ fp32 rounding), halves in [-127, 127]."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(16, 32, generator=gen) * torch.logspace(-3, 2, 16)[:, None]
    q[5] = 0.0  # an all-zero (padded) row
    q = q.to(device)
    hi = torch.empty(16, 32, dtype=torch.int8, device=device)
    lo = torch.empty_like(hi)
    step = torch.empty(16, device=device)
    _split_probe[(1,)](q, hi, lo, step, M=16, D=32)
    back = (254 * hi.int() + lo.int()).float() * step[:, None]
    assert hi.abs().max() <= 127 and lo.abs().max() <= 127
    assert ((back - q).abs() <= step[:, None] * 0.5 + q.abs() * 1e-6).all()
    assert torch.equal(back[5], torch.zeros(32, device=device))
