"""Paged prefill / extend attention: variable-length batch, causal, over the paged KV cache.

Same semantics as `paged_attention_ref`: sequence b's q_len new tokens are the last q_len positions
of its seq_len-token KV (cached prefix + the new tokens, already stored by `store_kv`), and query i
sees keys 0..seq_len - q_len + i. So one kernel covers a fresh prefill, a chunk of a chunked
prefill, and new turns on top of a radix-cache hit. A program owns BLOCK_M queries of one sequence
and one query head; keys are gathered through the page table; each program stops at its last
query's position, which skips the upper triangle. A sliding-window layer (window > 0) also starts
each program at its first query's oldest visible key; sinks (gpt-oss) seed every row's running
max and sum with the head's sink logit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.common import (accumulate_pv, attention_extras, dot_in_fp32,
                                               kv_cache_args, load_paged_kv, next_pow2, page_rows, per_tile,
                                               prepare_q, sink_start, tile_scores, unrotate_out)
from homelab_llm.engine.kernels.launch_fit import launch_fitting_stages
from homelab_llm.engine.kernels.tuning import prefill_tiles, q_each_tile

_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, page_table_ptr, seq_lens_ptr, query_start_ptr,
    sinks_ptr, sm_scale_log2, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_vd,
    stride_sp, stride_ss, stride_sh,
    stride_pt,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    INT8_KV: tl.constexpr, DOT_F32: tl.constexpr,
    ROTATE: tl.constexpr, LOG2_D: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    KV_ALIGN: tl.constexpr = 1, KV_CVT: tl.constexpr = 0, KS_UNMASKED: tl.constexpr = False,
    TILE_Q: tl.constexpr = False,
):
    m_block = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - q_len
    kv_head = head // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q = prepare_q(q, offs_d, sm_scale_log2, HEAD_DIM, LOG2_D, ROTATE, INT8_KV, DOT_F32)
    q_pos = prefix + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:
        m_i, l_i = sink_start(sinks_ptr, head + 0 * offs_m, m_mask, True, m_i, l_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    # Keys past the block's last query are never visible: stop there; with a window, keys
    # before its first query's window are not either.
    hi = tl.minimum(seq_len, prefix + (m_block + 1) * BLOCK_M)
    lo = 0
    if HAS_WINDOW:  # from its page's first key: tiles start at multiples of KV_ALIGN (decode's)
        lo = tl.maximum(prefix + m_block * BLOCK_M - window + 1, 0) // PAGE_SIZE * PAGE_SIZE
    for n0 in range(lo, hi, BLOCK_N):
        n0 = tl.multiple_of(n0, KV_ALIGN)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        k, v, page, slot = load_paged_kv(
            k_ptr, v_ptr, page_table_ptr, b * stride_pt, offs_n, n_mask, page_rows(offs_n, hi, PAGE_SIZE),
            offs_d, d_mask, kv_head,
            stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_vd, q,
            PAGE_SIZE, INT8_KV, DOT_F32, False, KV_CVT)
        # (TILE_Q: q enters the score dot's operand layout in this tile, common.per_tile)
        scores = tile_scores(per_tile(q, n0 < hi, TILE_Q), k, ks_ptr, page, slot, kv_head, stride_sp, stride_ss,
                             stride_sh, n_mask, sm_scale_log2, INT8_KV, DOT_F32, KS_UNMASKED)
        visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # Rows past q_len may see nothing yet; keep their exponent finite.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = accumulate_pv(acc, alpha, p, v, vs_ptr, page, slot, kv_head, stride_sp, stride_ss,
                            stride_sh, n_mask, INT8_KV)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out = unrotate_out(out, offs_d, HEAD_DIM, LOG2_D, ROTATE, DOT_F32)
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [B, max_pages] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32
    softmax_scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """max_query_len sizes the grid; without it the grid assumes one sequence could hold every
    token (correct, just more empty programs), so no device-to-host sync is needed.
    window > 0: a sliding-window layer; sinks [Hq] float32 logits (see paged_attention_ref)."""
    batch = seq_lens.shape[0]
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not divide into {num_kv_heads} KV heads")
    if q.stride(2) != 1:
        raise ValueError("q head_dim axis must be contiguous")
    kv = kv_cache_args(k_cache, v_cache, k_scale, v_scale, head_dim)
    extras = attention_extras(window, sinks, num_q_heads, q)
    out = torch.empty_like(q) if out is None else out
    if batch == 0 or num_tokens == 0:
        return out
    tiles = prefill_tiles(q.device, head_dim)
    max_q = num_tokens if max_query_len is None else max_query_len
    grid = (triton.cdiv(max_q, tiles.block_m), num_q_heads, batch)

    def launch(num_stages: int) -> None:
        _prefill_kernel[grid](
            q, k_cache, v_cache, kv.k_scale, kv.v_scale, out,
            page_table, seq_lens, query_start_loc, extras.sinks,
            softmax_scale * _LOG2E, window,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), *kv.strides,
            page_table.stride(0),
            PAGE_SIZE=page_size, GROUP=num_q_heads // num_kv_heads,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=next_pow2(head_dim),
            BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
            INT8_KV=kv.int8, DOT_F32=dot_in_fp32(),
            ROTATE=kv.rotate, LOG2_D=kv.log2_d, HAS_WINDOW=extras.has_window, HAS_SINKS=extras.has_sinks,
            KV_ALIGN=min(tiles.block_n, page_size), KV_CVT=kv.int8_convert(q.device),
            KS_UNMASKED=tiles.unmasked_key_scales, TILE_Q=q_each_tile(tiles, head_dim, kv.int8),
            num_warps=tiles.num_warps, num_stages=num_stages,
        )

    # the table is tuned for 16-bit KV: fp32 KV at large heads may need fewer stages
    launch_fitting_stages(launch, (q.device, q.dtype, k_cache.dtype, head_dim, tiles), tiles.num_stages)
    return out
