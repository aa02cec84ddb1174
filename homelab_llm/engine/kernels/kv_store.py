"""Write new tokens' K/V into the paged cache at `slot_mapping`, quantizing to int8 on the way
when the cache is int8 (per token, per head, symmetric, fp16 scale). `rope_store_kv` also applies
the rotary embedding first (q in place, k on its way into the cache): one launch per layer
instead of two, and k is never written back rotated.

When head_dim is a power of two the int8 rows are Hadamard-rotated first (`ref.quantize_kv`),
in the kernel by fp32 butterflies (common.fwht); the rotated rows then match the reference's to
fp32 rounding, and
their quantization is bit-exact with `ref.quantize_per_token_head`: IEEE division (`div_rn`,
since Triton's plain `/` on fp32 may be approximate), round-half-to-even done by hand (portable
to ROCm, no libdevice), and the fp16 scale is rounded before it divides, like the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.common import fwht, kv_cache_args, next_pow2
from homelab_llm.engine.kernels.elementwise import rotate_half
from homelab_llm.engine.kernels.pdl import pdl_args, pdl_enter
from homelab_llm.engine.kernels.ref import MIN_AMAX
from homelab_llm.engine.kernels.tuning import tiles_for

# q heads a rope_store_kv program rotates (and normalizes): a token's heads spread over several
# programs (SMs), beside the one that stores its k and v
Q_GROUP_HEADS = 8


@triton.jit
def _round_half_even(y):
    r = tl.floor(y)
    frac = y - r  # exact: |y| <= 127.5 leaves plenty of mantissa
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, r + 1.0, r)


@triton.jit
def _head_scale(amax, min_amax):
    """fp16 scale per head from each head's max |x|, rounded to fp16 as the reference does."""
    amax = tl.maximum(amax, min_amax)
    return tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32)).to(tl.float16)


@triton.jit
def _quantize(xf, scale):
    y = tl.math.div_rn(xf, scale.to(tl.float32)[:, None])
    return tl.minimum(tl.maximum(_round_half_even(y), -127.0), 127.0).to(tl.int8)


@triton.jit
def _quantize_rows_store(x, dst, scale_dst, mask, h_mask, min_amax):
    """One token's [heads, head_dim] -> int8 rows and one fp16 scale per head."""
    xf = x.to(tl.float32)
    scale = _head_scale(tl.max(tl.abs(xf), axis=1), min_amax)
    tl.store(dst, _quantize(xf, scale), mask=mask)
    tl.store(scale_dst, scale, mask=h_mask)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, slot_ptr,
    stride_kt, stride_kh_in, stride_vt, stride_vh_in,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_vd,
    stride_sp, stride_ss, stride_sh,
    min_amax,
    PAGE_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, INT8_KV: tl.constexpr,
    ROTATE: tl.constexpr, LOG2_D: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot < 0:  # padding token
        return
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    key = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh_in + offs_d[None, :], mask=mask, other=0.0)
    value = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh_in + offs_d[None, :], mask=mask, other=0.0)
    k_dst = k_ptr + page * stride_kp + offset * stride_ks + offs_h[:, None] * stride_kh + offs_d[None, :]
    v_dst = (v_ptr + page * stride_vp + offset * stride_vs + offs_h[:, None] * stride_vh
             + offs_d[None, :] * stride_vd)
    if INT8_KV:
        s_off = page * stride_sp + offset * stride_ss + offs_h * stride_sh
        h_mask = offs_h < NUM_HEADS
        if ROTATE:  # rows @ H (ref.quantize_kv) by fp32 butterflies: a D x D matrix for a dot
            # needed 128 KB of shared memory at head_dim 256 (over sm_80's and RDNA3's limits)
            key = fwht(key.to(tl.float32), LOG2_D)
            value = fwht(value.to(tl.float32), LOG2_D)
        _quantize_rows_store(key, k_dst, ks_ptr + s_off, mask, h_mask, min_amax)
        _quantize_rows_store(value, v_dst, vs_ptr + s_off, mask, h_mask, min_amax)
    else:
        tl.store(k_dst, key.to(k_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, value.to(v_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; negative = skip
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key/value head_dim axis must be contiguous")
    kv = kv_cache_args(k_cache, v_cache, k_scale, v_scale, head_dim)
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, kv.k_scale, kv.v_scale, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), *kv.strides,
        MIN_AMAX,
        PAGE_SIZE=k_cache.shape[1], NUM_HEADS=num_heads, HEADS_PAD=next_pow2(num_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=next_pow2(head_dim), INT8_KV=kv.int8,
        ROTATE=kv.rotate, LOG2_D=kv.log2_d,
        num_warps=tiles_for(key.device).elementwise_warps, **pdl_args(key.device),
    )


@triton.jit
def _head_norm(x1, x2, tail, w_ptr, offs_d, d_mask, offs_r, r_mask, eps, HALF: tl.constexpr,
               HEAD_DIM: tl.constexpr):
    """Heads held as their two rotary halves and the tail past rotary_dim ([heads, *] fp32),
    RMSNorm-ed over the whole head with weight w (elementwise.qk_norm's formula, x * rsqrt(mean(
    x^2) + eps) * w), in fp32: the caller rounds them as qk_norm's stored output is rounded."""
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(tail * tail, axis=1)
    rstd = tl.math.rsqrt(ss / HEAD_DIM + eps)[:, None]
    w1 = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    wt = tl.load(w_ptr + offs_r, mask=r_mask, other=0.0).to(tl.float32)[None, :]
    return x1 * rstd * w1, x2 * rstd * w2, tail * rstd * wt


@triton.jit
def _load_head_parts(base, h_mask, offs_d, d_mask, offs_r, r_mask, HALF: tl.constexpr):
    """[heads, HALF_PAD] x2 and [heads, TAIL_PAD] of the heads at base + head offsets (fp32)."""
    half_mask = h_mask[:, None] & d_mask[None, :]
    x1 = tl.load(base + offs_d[None, :], mask=half_mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + offs_d[None, :], mask=half_mask, other=0.0).to(tl.float32)
    tail = tl.load(base + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :],
                   other=0.0).to(tl.float32)
    return x1, x2, tail


@triton.jit
def _rope_store_kv_kernel(
    q_ptr, key_ptr, value_ptr, pos_ptr, cos_sin_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, slot_ptr,
    q_src_ptr, qw_ptr, kw_ptr, eps, scratch_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh_in, stride_vt, stride_vh_in, stride_c,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_vd,
    stride_sp, stride_ss, stride_sh, stride_qst, stride_qsh,
    min_amax,
    PAGE_SIZE: tl.constexpr, NUM_Q_HEADS: tl.constexpr, NUM_Q_HEADS_PAD: tl.constexpr,
    Q_GROUP: tl.constexpr,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    TAIL_PAD: tl.constexpr, INT8_KV: tl.constexpr,
    ROTATE: tl.constexpr, LOG2_D: tl.constexpr, QK_NORM: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HALF
    cos, sin = rope_cos_sin(pos_ptr, cos_sin_ptr, t, stride_c, offs_d, d_mask, HALF)
    offs_r = 2 * HALF + tl.arange(0, TAIL_PAD)
    r_mask = offs_r < HEAD_DIM
    dtype = key_ptr.dtype.element_ty

    # q, every token (padding included: its output is simply unused), Q_GROUP heads a program:
    # rotated in place, or (QK_NORM) read from the projection at q_src, normalized per head
    # (rounded to its dtype, as elementwise.qk_norm stores it), rotated and stored at q. The
    # last program of the token stores its k and v: at batch 1 the heads spread over several
    # SMs instead of one program walking them all.
    g = tl.program_id(1)
    if g < NUM_Q_HEADS_PAD // Q_GROUP:
        offs_qh = g * Q_GROUP + tl.arange(0, Q_GROUP)
        qh_mask = offs_qh < NUM_Q_HEADS
        if QK_NORM:
            q1, q2, q_tail = _load_head_parts(
                q_src_ptr + t * stride_qst + offs_qh[:, None] * stride_qsh, qh_mask, offs_d,
                d_mask, offs_r, r_mask, HALF)
            q1, q2, q_tail = _head_norm(q1, q2, q_tail, qw_ptr, offs_d, d_mask, offs_r, r_mask,
                                        eps, HALF, HEAD_DIM)
            q1 = q1.to(dtype).to(tl.float32)
            q2 = q2.to(dtype).to(tl.float32)
            q_dst = q_ptr + t * stride_qt + offs_qh[:, None] * stride_qh
            q_half = qh_mask[:, None] & d_mask[None, :]
            tl.store(q_dst + offs_d[None, :], (q1 * cos - q2 * sin).to(dtype), mask=q_half)
            tl.store(q_dst + HALF + offs_d[None, :], (q2 * cos + q1 * sin).to(dtype), mask=q_half)
            tl.store(q_dst + offs_r[None, :], q_tail.to(dtype),
                     mask=qh_mask[:, None] & r_mask[None, :])
        else:
            q_base = q_ptr + t * stride_qt + offs_qh[:, None] * stride_qh + offs_d[None, :]
            rotate_half(q_base, qh_mask[:, None] & d_mask[None, :], cos, sin, HALF)
        return

    slot = tl.load(slot_ptr + t)
    if slot < 0:  # padding token: nothing to store
        return
    offs_h = tl.arange(0, HEADS_PAD)
    store_rotated_kv(t, slot, offs_h, offs_h < NUM_HEADS, key_ptr, value_ptr, k_ptr, v_ptr, ks_ptr,
                     vs_ptr, kw_ptr, eps, scratch_ptr, cos, sin, offs_d, d_mask, offs_r, r_mask,
                     stride_kt, stride_kh_in, stride_vt, stride_vh_in, stride_kp, stride_ks,
                     stride_kh, stride_vp, stride_vs, stride_vh, stride_vd, stride_sp, stride_ss, stride_sh,
                     min_amax, PAGE_SIZE, NUM_HEADS, HEAD_DIM, HEAD_DIM_PAD, HALF, INT8_KV, ROTATE,
                     LOG2_D, QK_NORM)


@triton.jit
def store_rotated_kv(t, slot, offs_h, h_mask, key_ptr, value_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
                     kw_ptr, eps, scratch_ptr, cos, sin, offs_d, d_mask, offs_r, r_mask,
                     stride_kt, stride_kh_in, stride_vt, stride_vh_in,
                     stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_vd,
                     stride_sp, stride_ss, stride_sh, min_amax,
                     PAGE_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEAD_DIM_PAD: tl.constexpr, HALF: tl.constexpr, INT8_KV: tl.constexpr,
                     ROTATE: tl.constexpr, LOG2_D: tl.constexpr, QK_NORM: tl.constexpr):
    """Token t's K heads offs_h (h_mask) rotated (cos, sin [1, HALF_PAD]; with QK_NORM first
    normalized by kw) and its V heads into the cache at `slot` (>= 0), quantized to int8 on an
    int8 cache: rope_store_kv's store, also run by a decode attention program for its own KV
    head (decode_attention.py, new_kv)."""
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    dtype = key_ptr.dtype.element_ty
    half_mask = h_mask[:, None] & d_mask[None, :]
    # k in three parts: the two rotated halves and the dims past rotary_dim (partial rotary).
    x1f, x2f, tail = _load_head_parts(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh_in,
                                      h_mask, offs_d, d_mask, offs_r, r_mask, HALF)
    if QK_NORM:  # normalized and rounded as elementwise.qk_norm stores k
        x1f, x2f, tail = _head_norm(x1f, x2f, tail, kw_ptr, offs_d, d_mask, offs_r, r_mask, eps,
                                    HALF, HEAD_DIM)
        x1f = x1f.to(dtype).to(tl.float32)
        x2f = x2f.to(dtype).to(tl.float32)
        tail = tail.to(dtype).to(tl.float32)
    # Rounded to k's dtype first: the unfused path stores the rotated k tensor, then quantizes it.
    r1 = (x1f * cos - x2f * sin).to(dtype).to(tl.float32)
    r2 = (x2f * cos + x1f * sin).to(dtype).to(tl.float32)
    tail_mask = h_mask[:, None] & r_mask[None, :]
    k_dst = k_ptr + page * stride_kp + offset * stride_ks + offs_h[:, None] * stride_kh
    offs_v = tl.arange(0, HEAD_DIM_PAD)
    v_mask = h_mask[:, None] & (offs_v[None, :] < HEAD_DIM)
    value = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh_in + offs_v[None, :],
                    mask=v_mask, other=0.0)
    v_dst = (v_ptr + page * stride_vp + offset * stride_vs + offs_h[:, None] * stride_vh
             + offs_v[None, :] * stride_vd)
    if INT8_KV and ROTATE:
        # The rotated row, rounded to k's dtype as the unfused rope stores it, goes through
        # scratch (this program's own row, read back after a barrier) to be transformed whole by
        # store_kv's butterflies: the same bits as rope then store_kv, any rotary width. (Two
        # Hadamard dots of the rotated halves needed full rotary, and the sign matrices they
        # built spilled 365 registers on gfx1100 at head_dim 128.)
        row = scratch_ptr + t * NUM_HEADS * HEAD_DIM + offs_h[:, None] * HEAD_DIM
        tl.store(row + offs_d[None, :], r1.to(dtype), mask=half_mask)
        tl.store(row + HALF + offs_d[None, :], r2.to(dtype), mask=half_mask)
        tl.store(row + offs_r[None, :], tail.to(dtype), mask=tail_mask)
        tl.debug_barrier()  # every thread's part of the row is written before any reads it
        k_row = tl.load(row + offs_v[None, :], mask=v_mask, other=0.0).to(tl.float32)
        s_off = page * stride_sp + offset * stride_ss + offs_h * stride_sh
        _quantize_rows_store(fwht(k_row, LOG2_D), k_dst + offs_v[None, :], ks_ptr + s_off, v_mask,
                             h_mask, min_amax)
        _quantize_rows_store(fwht(value.to(tl.float32), LOG2_D), v_dst, vs_ptr + s_off, v_mask,
                             h_mask, min_amax)
    elif INT8_KV:
        amax = tl.maximum(tl.max(tl.abs(r1), axis=1), tl.max(tl.abs(r2), axis=1))
        amax = tl.maximum(amax, tl.max(tl.abs(tail), axis=1))
        scale = _head_scale(amax, min_amax)
        tl.store(k_dst + offs_d[None, :], _quantize(r1, scale), mask=half_mask)
        tl.store(k_dst + HALF + offs_d[None, :], _quantize(r2, scale), mask=half_mask)
        tl.store(k_dst + offs_r[None, :], _quantize(tail, scale), mask=tail_mask)
        s_off = page * stride_sp + offset * stride_ss + offs_h * stride_sh
        tl.store(ks_ptr + s_off, scale, mask=h_mask)
        _quantize_rows_store(value, v_dst, vs_ptr + s_off, v_mask, h_mask, min_amax)
    else:
        dtype = k_ptr.dtype.element_ty
        tl.store(k_dst + offs_d[None, :], r1.to(dtype), mask=half_mask)
        tl.store(k_dst + HALF + offs_d[None, :], r2.to(dtype), mask=half_mask)
        tl.store(k_dst + offs_r[None, :], tail.to(dtype), mask=tail_mask)
        tl.store(v_dst, value.to(v_ptr.dtype.element_ty), mask=v_mask)


@triton.jit
def rope_cos_sin(pos_ptr, cos_sin_ptr, t, stride_c, offs_d, d_mask, HALF: tl.constexpr):
    """Token t's rotary cos and sin at offs_d (< HALF; 0 where d_mask is off), [1, len(offs_d)]
    fp32."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_c + offs_d, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_c + HALF + offs_d, mask=d_mask, other=0.0)[None, :]
    return cos, sin


@triton.jit
def store_new_kv_head(t, head, key_ptr, value_ptr, pos_ptr, cos_sin_ptr, slot_ptr, k_ptr, v_ptr,
                      ks_ptr, vs_ptr, kw_ptr, eps, scratch_ptr, stride_kt, stride_kh_in, stride_vt,
                      stride_vh_in, stride_c, stride_kp, stride_ks, stride_kh, stride_vp,
                      stride_vs, stride_vh, stride_vd, stride_sp, stride_ss, stride_sh, min_amax,
                      PAGE_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                      HEAD_DIM_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                      TAIL_PAD: tl.constexpr, INT8_KV: tl.constexpr, ROTATE: tl.constexpr,
                      LOG2_D: tl.constexpr, QK_NORM: tl.constexpr):
    """rope_store_kv's store of token t's KV head `head` alone (a padding token, slot < 0, stores
    nothing): what a decode attention program does for its own head before reading the cache."""
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        offs_d = tl.arange(0, HALF_PAD)
        d_mask = offs_d < HALF
        offs_r = 2 * HALF + tl.arange(0, TAIL_PAD)
        cos, sin = rope_cos_sin(pos_ptr, cos_sin_ptr, t, stride_c, offs_d, d_mask, HALF)
        offs_h = head + tl.arange(0, 1)
        store_rotated_kv(t, slot, offs_h, offs_h < NUM_HEADS, key_ptr, value_ptr, k_ptr, v_ptr,
                         ks_ptr, vs_ptr, kw_ptr, eps, scratch_ptr, cos, sin, offs_d, d_mask, offs_r,
                         offs_r < HEAD_DIM, stride_kt, stride_kh_in, stride_vt, stride_vh_in,
                         stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_vd,
                         stride_sp, stride_ss, stride_sh, min_amax, PAGE_SIZE, NUM_HEADS, HEAD_DIM,
                         HEAD_DIM_PAD, HALF, INT8_KV, ROTATE, LOG2_D, QK_NORM)


@triton.jit
def rope_q_tile(q_ptr, t, heads, g_mask, offs_d, pos_ptr, cos_sin_ptr, stride_c, stride_qt,
                stride_qh, qw_ptr, eps, HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
                QK_NORM: tl.constexpr):
    """Token t's query heads `heads` (g_mask) as rope_store_kv leaves them, [heads, len(offs_d)]
    in q's dtype: rotated (neox halves, the dims past 2 * HALF as they are), with QK_NORM first
    RMSNorm-ed by qw and rounded. Without the norm the same bits as the stored q (each value
    one rotation's arithmetic); with it the sum of squares runs over the whole row here, which
    may round differently from rope_store_kv's three partial sums."""
    dtype = q_ptr.dtype.element_ty
    rot = offs_d < 2 * HALF
    first = offs_d < HALF
    # each value's rotation partner: the other half's same position
    partner = tl.where(first, offs_d + HALF, tl.where(rot, offs_d - HALF, offs_d))
    c_idx = tl.where(first, offs_d, offs_d - HALF)
    mask = g_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    base = q_ptr + t * stride_qt + heads[:, None] * stride_qh
    qa = tl.load(base + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    qb = tl.load(base + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:  # elementwise.qk_norm's formula, rounded to q's dtype as it stores q
        rstd = tl.math.rsqrt(tl.sum(qa * qa, axis=1) / HEAD_DIM + eps)[:, None]
        dmask = offs_d < HEAD_DIM
        qa = (qa * rstd * tl.load(qw_ptr + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :])
        qb = (qb * rstd * tl.load(qw_ptr + partner, mask=dmask, other=0.0).to(tl.float32)[None, :])
        qa = qa.to(dtype).to(tl.float32)
        qb = qb.to(dtype).to(tl.float32)
    # (the lanes past the rotary dims keep qa below, whatever cos and sin read there)
    cos, sin = rope_cos_sin(pos_ptr, cos_sin_ptr, t, stride_c, c_idx, rot & (offs_d < HEAD_DIM), HALF)
    out = tl.where(first[None, :], qa * cos - qb * sin, qa * cos + qb * sin)
    return tl.where(rot[None, :], out, qa).to(dtype)


@dataclass(frozen=True)
class NewKV:
    """A decode step's new K/V rows, unrotated (views of the projection are fine), for a decode
    attention that rotates and stores them itself (decode_attention.py): rope_store_kv's
    arguments but q. qk_norm = (q_weight, k_weight, eps) as rope_store_kv's."""

    key: torch.Tensor  # [T, Hkv, D]
    value: torch.Tensor  # [T, Hkv, D]
    positions: torch.Tensor  # [T] int64
    cos_sin_cache: torch.Tensor  # [max_positions, rotary_dim] float32, cos | sin
    slot_mapping: torch.Tensor  # [T] int64; negative = no store
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None


def new_kv_launch(new_kv: NewKV | None, q: torch.Tensor, num_kv_heads: int, rotate: bool) -> tuple[list, dict]:
    """The decode attention kernel's new-token arguments: (positional, constexpr keywords), with
    q as the placeholder of every pointer it does not read when new_kv is None."""
    if new_kv is None:
        return [q] * 8 + [0.0, MIN_AMAX, 0, 0, 0, 0, 0], {}
    key, value = new_kv.key, new_kv.value
    shape = (q.shape[0], num_kv_heads, q.shape[2])
    if tuple(key.shape) != shape or tuple(value.shape) != shape or key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError(f"new K/V rows must be {shape} with head_dim contiguous, got "
                         f"{tuple(key.shape)} / {tuple(value.shape)}")
    q_weight, k_weight, eps = new_kv.qk_norm if new_kv.qk_norm is not None else (q, q, 0.0)
    half = new_kv.cos_sin_cache.shape[1] // 2
    scratch = torch.empty(key.shape, dtype=key.dtype, device=key.device) if rotate else key
    args = [key, value, new_kv.positions, new_kv.cos_sin_cache, new_kv.slot_mapping, q_weight,
            k_weight, scratch, float(eps), MIN_AMAX, key.stride(0), key.stride(1), value.stride(0),
            value.stride(1), new_kv.cos_sin_cache.stride(0)]
    meta = dict(NEW_KV=True, QK_NORM=new_kv.qk_norm is not None, HALF=half, HALF_PAD=next_pow2(half),
                TAIL_PAD=max(1, next_pow2(q.shape[2] - 2 * half)), NUM_KV_HEADS=num_kv_heads)
    return args, meta


def rope_store_kv(
    q: torch.Tensor,  # [T, Hq, D], rotated in place (qk_norm: the projection's q, left as it is)
    key: torch.Tensor,  # [T, Hkv, D], not rotated; left as it is
    value: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [max_positions, rotary_dim] float32, cos | sin
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; negative = skip the store (q is still rotated)
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """`apply_rope(q, key, ...)` then `store_kv(key, value, ...)` in one launch; the same bits
    (rotated int8 rows up to the Hadamard sums' fp32 order, see the kernel). Returns the rotated
    q: q itself, or with qk_norm = (q_weight, k_weight, eps) a new [T, Hq, D] tensor, q and key
    first RMSNorm-ed per head as elementwise.qk_norm does (same launch; q and key may then be
    strided views of the projection)."""
    num_tokens, num_heads, head_dim = key.shape
    if q.stride(2) != 1 or key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("q/key/value head_dim axis must be contiguous")
    q_out = q if qk_norm is None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    kv = kv_cache_args(k_cache, v_cache, k_scale, v_scale, head_dim)
    half = cos_sin_cache.shape[1] // 2
    q_weight, k_weight, eps = qk_norm if qk_norm is not None else (q, q, 0.0)
    # the rotated k rows' scratch for a Hadamard-rotated int8 cache (see the kernel)
    scratch = torch.empty(key.shape, dtype=key.dtype, device=key.device) if kv.rotate else key
    q_heads_pad = next_pow2(q.shape[1])
    q_group = min(q_heads_pad, Q_GROUP_HEADS)
    _rope_store_kv_kernel[(num_tokens, q_heads_pad // q_group + 1)](
        q_out, key, value, positions, cos_sin_cache, k_cache, v_cache, kv.k_scale, kv.v_scale,
        slot_mapping, q, q_weight, k_weight, float(eps), scratch,
        q_out.stride(0), q_out.stride(1), key.stride(0), key.stride(1), value.stride(0),
        value.stride(1), cos_sin_cache.stride(0), *kv.strides, q.stride(0), q.stride(1),
        MIN_AMAX,
        PAGE_SIZE=k_cache.shape[1], NUM_Q_HEADS=q.shape[1], NUM_Q_HEADS_PAD=q_heads_pad,
        Q_GROUP=q_group,
        NUM_HEADS=num_heads, HEADS_PAD=next_pow2(num_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=next_pow2(head_dim), HALF=half, HALF_PAD=next_pow2(half),
        TAIL_PAD=max(1, next_pow2(head_dim - 2 * half)), INT8_KV=kv.int8,
        ROTATE=kv.rotate, LOG2_D=kv.log2_d, QK_NORM=qk_norm is not None,
        num_warps=tiles_for(key.device).elementwise_warps, **pdl_args(key.device),
    )
    return q_out
