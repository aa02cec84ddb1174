"""Write new tokens' K/V into the paged cache at `slot_mapping`, quantizing to int8 on the way
when the cache is int8 (per token, per head, symmetric, fp16 scale).

Bit-exact with `ref.quantize_per_token_head`: IEEE division (`div_rn`, since Triton's plain `/`
on fp32 may be approximate), round-half-to-even done by hand (portable to ROCm, no libdevice),
and the fp16 scale is rounded before it divides, like the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.common import cache_strides, check_int8_scales, next_pow2, scale_strides
from homelab_llm.engine.kernels.ref import _MIN_AMAX
from homelab_llm.engine.kernels.tuning import tiles_for


@triton.jit
def _round_half_even(y):
    r = tl.floor(y)
    frac = y - r  # exact: |y| <= 127.5 leaves plenty of mantissa
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, r + 1.0, r)


@triton.jit
def _quantize_rows_store(x, dst, scale_dst, mask, h_mask, min_amax):
    """One token's [heads, head_dim] -> int8 rows and one fp16 scale per head."""
    xf = x.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(xf), axis=1), min_amax)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32)).to(tl.float16)
    y = tl.math.div_rn(xf, scale.to(tl.float32)[:, None])
    q = tl.minimum(tl.maximum(_round_half_even(y), -127.0), 127.0).to(tl.int8)
    tl.store(dst, q, mask=mask)
    tl.store(scale_dst, scale, mask=h_mask)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, slot_ptr,
    stride_kt, stride_kh_in, stride_vt, stride_vh_in,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_sp, stride_ss, stride_sh,
    min_amax,
    PAGE_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, INT8_KV: tl.constexpr,
):
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
    v_dst = v_ptr + page * stride_vp + offset * stride_vs + offs_h[:, None] * stride_vh + offs_d[None, :]
    if INT8_KV:
        s_off = page * stride_sp + offset * stride_ss + offs_h * stride_sh
        h_mask = offs_h < NUM_HEADS
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
    int8 = check_int8_scales(k_cache, k_scale, v_scale)
    skp, sks, skh = cache_strides(k_cache)
    svp, svs, svh = cache_strides(v_cache)
    ssp, sss, ssh = scale_strides(k_scale if int8 else None)
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, k_scale if int8 else k_cache, v_scale if int8 else v_cache,
        slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        skp, sks, skh, svp, svs, svh, ssp, sss, ssh,
        _MIN_AMAX,
        PAGE_SIZE=k_cache.shape[1], NUM_HEADS=num_heads, HEADS_PAD=next_pow2(num_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=next_pow2(head_dim), INT8_KV=int8,
        num_warps=tiles_for(key.device).elementwise_warps,
    )
