"""Decode attention over speculative verify groups (rows_per_seq = K+1 rows of one sequence, one
program per group) against paged_attention_ref over the same rows taken one by one.

Row j of a group sees the first seq_len_j keys (the causal mask inside the block); rows past a
short draft repeat row 0's length (step_plan padding); a whole group of CUDA-graph padding has
seq_len 1 over page 0. Each case again with the split kernel's switches on (int8 score dots,
prefetches). Bounds as in test_decode_attention: 5e-3 for fp32 queries (tf32 dots on a
GPU), 2e-2 for bf16 inputs and outputs, on unit-variance values; the same with a sliding window
and with sinks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from homelab_llm.engine.kernels.ref import paged_attention_ref
from homelab_llm.engine.kernels.tuning import decode_tiles


def _rows(ctx_lens: list[int], drafts: list[int], width: int) -> tuple[list[int], list[int]]:
    """(seq_len per row, owning sequence per row) for groups of `width` rows; sequence -1: padding."""
    lens, owner = [], []
    for s, (ctx, k) in enumerate(zip(ctx_lens, drafts)):
        lens += [ctx + 1 + j for j in range(k + 1)] + [ctx + 1] * (width - k - 1)
        owner += [s] * width
    return lens + [1] * width, owner + [-1] * width


@pytest.mark.parametrize("kv_dtype,window,sinks", [(torch.float32, 0, False), (torch.bfloat16, 0, False),
                                                  (torch.int8, 0, False), (torch.bfloat16, 9, False),
                                                  (torch.float32, 0, True)])
def test_verify_groups_match_reference(kv_dtype, window, sinks, device: torch.device, full_shapes: bool,
                                       paged_kv) -> None:
    from homelab_llm.engine.kernels.decode_attention import paged_decode_attention

    gen = torch.Generator().manual_seed(7)
    width = 5
    if full_shapes:
        ctx_lens, hq, hkv, d, page_size = [500, 3000, 17], 24, 4, 256, 16
    else:
        ctx_lens, hq, hkv, d, page_size = [6, 37, 2], 6, 2, 32, 4
    drafts = [4, 1, 2]
    q_dtype = torch.float32 if kv_dtype == torch.float32 else torch.bfloat16
    k_cache, v_cache, ks, vs, tables = paged_kv([n + width for n in ctx_lens], hkv, d, page_size, kv_dtype,
                                                device, gen)
    lens, owner = _rows(ctx_lens, drafts, width)
    rows = len(lens)
    page_table = torch.stack([tables[s] if s >= 0 else torch.zeros_like(tables[0]) for s in owner])
    q = torch.randn(rows, hq, d, generator=gen).to(device, q_dtype)
    qsl = torch.arange(rows + 1, dtype=torch.int32, device=device)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    sink_logits = torch.randn(hq, generator=gen).to(device) if sinks else None
    scale = d ** -0.5
    want = paged_attention_ref(q.float(), k_cache if kv_dtype == torch.int8 else k_cache.float(),
                               v_cache if kv_dtype == torch.int8 else v_cache.float(), page_table, qsl, sl,
                               scale, ks, vs, window=window, sinks=sink_logits)
    tol = 5e-3 if q_dtype == torch.float32 else 2e-2
    # the table's tiles, and the split kernel's switches on (fused_merge is for one-row groups only)
    switched = dataclasses.replace(decode_tiles(device, kv_dtype == torch.int8), int8_dot=True,
                                   prefetch_scales=True, prefetch_kv=True, fused_merge=True, late_q=True)
    for splits, tiles in ((None, None), (1, None), (4, None), (None, switched), (1, switched)):
        got = paged_decode_attention(q, k_cache, v_cache, page_table, qsl, sl, scale, ks, vs, num_splits=splits,
                                     window=window, sinks=sink_logits, rows_per_seq=width, tiles=tiles)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol, msg=lambda m: f"{splits=} {tiles=}: {m}")


def test_rows_must_fill_whole_groups(device: torch.device, paged_kv) -> None:
    from homelab_llm.engine.kernels.decode_attention import paged_decode_attention

    gen = torch.Generator().manual_seed(8)
    k_cache, v_cache, _, _, table = paged_kv([8], 2, 32, 4, torch.float32, device, gen)
    q = torch.randn(3, 2, 32, generator=gen).to(device)
    qsl = torch.arange(4, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="rows_per_seq=2"):
        paged_decode_attention(q, k_cache, v_cache, table.expand(3, -1), qsl, qsl[1:] + 4, 0.2, rows_per_seq=2)


def test_groups_too_wide_for_one_tile_run_row_by_row(device: torch.device, paged_kv) -> None:
    """17 rows x 8 query heads per KV head exceed MAX_TILE_ROWS: same result, one row a program."""
    from homelab_llm.engine.kernels.decode_attention import paged_decode_attention

    gen = torch.Generator().manual_seed(9)
    width = 17
    k_cache, v_cache, _, _, table = paged_kv([30], 1, 32, 4, torch.float32, device, gen)
    lens = list(range(14, 14 + width))
    q = torch.randn(width, 8, 32, generator=gen).to(device)
    qsl = torch.arange(width + 1, dtype=torch.int32, device=device)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    tables = table.expand(width, -1).contiguous()
    want = paged_attention_ref(q, k_cache, v_cache, tables, qsl, sl, 0.2)
    got = paged_decode_attention(q, k_cache, v_cache, tables, qsl, sl, 0.2, rows_per_seq=width)
    torch.testing.assert_close(got, want, atol=5e-3, rtol=5e-3)
