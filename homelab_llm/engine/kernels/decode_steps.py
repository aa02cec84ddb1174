"""Steps of the decode split kernel (decode_attention.py) that its variants switch on: int8-KV
scale prefetch and score dots, K/V register prefetch, q preparation (late_q: inside the first
tile, so the pipeliner's first K/V loads are not queued behind q's rotation).

Scale prefetch (AttentionTiles.prefetch_scales): the per-token fp16 scales are 2-byte gathers
that Triton's pipeliner leaves synchronous (only loads feeding a tl.dot become async copies), so
each tile used to wait for a page-table load and then a scale load, two round trips the K/V
pipeline does not hide. The prefetching loop carries the next tile's scales and the tile after
that's page indices, so those loads are issued a tile (two for the pages) before they are used.
K/V prefetch (AttentionTiles.prefetch_kv; meant with num_stages 1, Triton's own pipelining off):
the pipeliner keeps one K/V buffer for this gather (the page-table load takes a stage), so a
program waited a whole round trip every tile; this loop requests the next tile's K/V rows into
registers before the current tile's math instead, converting them for the dots a tile later.

int8 score dots (AttentionTiles.int8_dot): K stays int8 and q is split into two int8 halves,
q ~= (254 * hi + lo) * step per row (|error| <= step / 2 = max|q| / 64516, finer than the fp16 q
of the fp16 dots), so q @ k^T is two int8 x int8 -> int32 dots (mma m16n8k32 on sm_80/sm_90,
WMMA iu8 on RDNA3) with no int8 -> fp16 conversion of K. The int32 sum is exact: |254 hi.k +
lo.k| <= 255 * 127 * 127 * D < 2^31 for D <= 256.
"""

from __future__ import annotations

import triton
import triton.language as tl

from homelab_llm.engine.kernels.common import gather_kv, load_token_scales, page_rows, prepare_q


@triton.jit
def split_q_int8(q):
    """q [M, D] float32 -> (hi, lo, step): int8 [M, D] halves and the fp32 [M] step per row, with
    q ~= (254 * hi + lo) * step. An all-zero row gets step 1 and zero halves."""
    amax = tl.max(tl.abs(q), axis=1)
    coarse = tl.where(amax > 0.0, amax / 127.0, 1.0)
    hi = tl.minimum(tl.maximum(tl.floor(q / coarse[:, None] + 0.5), -127.0), 127.0)
    step = coarse / 254.0
    lo = tl.floor((q - hi * coarse[:, None]) / step[:, None] + 0.5)
    lo = tl.minimum(tl.maximum(lo, -127.0), 127.0)
    return hi.to(tl.int8), lo.to(tl.int8), step


@triton.jit
def int8_dot_scores(q_hi, q_lo, q_step, k, ks):
    """Scores of int8 K rows k [N, D] against split_q_int8's halves of the (already scaled) q,
    times K's per-token scales ks [N]: float32 [M, N]."""
    s = tl.dot(q_hi, tl.trans(k), out_dtype=tl.int32)
    s = tl.dot(q_lo, tl.trans(k), acc=s * 254, out_dtype=tl.int32)  # Triton 3.6 wants it named
    return s.to(tl.float32) * q_step[:, None] * ks[None, :]


@triton.jit
def tile_pages(page_table_ptr, row_offset, n0, end, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Page index (int32, as stored: fewer registers to carry a tile ahead) of each token
    n0 .. n0 + BLOCK_N of one sequence (0 past `end`)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    return tl.load(page_table_ptr + row_offset + offs_n // PAGE_SIZE, mask=page_rows(offs_n, end, PAGE_SIZE),
                   other=0)


@triton.jit
def tile_scales(ks_ptr, vs_ptr, page, n0, end, kv_head, stride_sp, stride_ss, stride_sh,
                BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """K and V per-token scales (float32 [BLOCK_N], 0 past `end`) of tokens n0 .. n0 + BLOCK_N
    of one KV head, `page` from tile_pages."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < end
    slot = offs_n % PAGE_SIZE
    page = page.to(tl.int64)
    ks = load_token_scales(ks_ptr, page, slot, kv_head, stride_sp, stride_ss, stride_sh, n_mask)
    vs = load_token_scales(vs_ptr, page, slot, kv_head, stride_sp, stride_ss, stride_sh, n_mask)
    return ks, vs


@triton.jit
def tile_kv(k_ptr, v_ptr, page, n0, end, offs_d, d_mask, kv_head, stride_kp, stride_ks, stride_kh,
            stride_vp, stride_vs, stride_vh, stride_vd, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """K and V rows as stored of tokens n0 .. n0 + BLOCK_N, `page` from tile_pages: the register
    prefetch of AttentionTiles.prefetch_kv (converted for the dots a tile later)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    return gather_kv(k_ptr, v_ptr, page.to(tl.int64), offs_n % PAGE_SIZE, offs_n < end,
                     page_rows(offs_n, end, PAGE_SIZE), offs_d, d_mask, kv_head,
                     stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_vd)


@triton.jit
def prepared_q_zeros(q, INT8_KV: tl.constexpr, DOT_F32: tl.constexpr):
    """Zeros of q's shape in the dtype prepare_q gives it (LATE_Q's placeholder)."""
    z = tl.zeros(q.shape, tl.float32)
    if not DOT_F32:
        if INT8_KV:
            z = z.to(tl.float16)
        else:
            z = z.to(q.dtype)
    return z


@triton.jit
def decode_q(q, offs_d, sm_scale_log2, HEAD_DIM: tl.constexpr, LOG2_D: tl.constexpr, ROTATE: tl.constexpr,
             INT8_KV: tl.constexpr, DOT_F32: tl.constexpr, INT8_DOT: tl.constexpr):
    """(q for the score dots, its int8 halves, their step): with INT8_DOT the halves of the rotated
    fp32 q with the softmax scale folded in (split_q_int8) and zeros for q, else prepare_q's q and
    zero halves."""
    if INT8_DOT:
        qf = prepare_q(q, offs_d, sm_scale_log2, HEAD_DIM, LOG2_D, ROTATE, False, True)
        q_hi, q_lo, q_step = split_q_int8(qf * sm_scale_log2)
        return prepared_q_zeros(q, INT8_KV, DOT_F32), q_hi, q_lo, q_step
    else:
        qp = prepare_q(q, offs_d, sm_scale_log2, HEAD_DIM, LOG2_D, ROTATE, INT8_KV, DOT_F32)
        hi = tl.zeros(q.shape, tl.int8)
        return qp, hi, hi, tl.zeros([q.shape[0]], tl.float32)
