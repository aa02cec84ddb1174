"""Small helpers the Triton kernels and their wrappers share: shape checks, interpreter switches,
the paged-KV launch arguments, and the tile steps both attention kernels take."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.ref import kv_rotated
from homelab_llm.engine.kernels.tuning import interpreting, tiles_for, uses_ptx


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def dot_in_fp32() -> bool:
    """The numpy interpreter has no bf16 matmul: kernels upcast tl.dot operands when this is set."""
    return interpreting()


def cache_strides(cache: torch.Tensor) -> tuple[int, int, int]:
    """(page, slot, head) strides of a KV cache [num_pages, page_size, heads, head_dim]; the
    head_dim axis must be contiguous so a row loads as one vector."""
    if cache.dim() != 4:
        raise ValueError(f"KV cache must be [num_pages, page_size, heads, head_dim], got {tuple(cache.shape)}")
    if cache.stride(3) != 1:
        raise ValueError("KV cache head_dim axis must be contiguous")
    return cache.stride(0), cache.stride(1), cache.stride(2)


def v_cache_strides(cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(page, slot, head, dim) strides of a V cache [num_pages, page_size, heads, head_dim]: rows
    contiguous along head_dim as K's are, or dim-major within a page (the slot axis contiguous:
    cache/page_pool.py's int8 V layout on NVIDIA, where a tile's tokens are the consecutive k
    values the P @ V dot's operand wants)."""
    if cache.dim() != 4:
        raise ValueError(f"KV cache must be [num_pages, page_size, heads, head_dim], got {tuple(cache.shape)}")
    if cache.stride(3) != 1 and cache.stride(1) != 1:
        raise ValueError("V cache needs its head_dim or its slot axis contiguous")
    return cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3)


def scale_strides(scale: torch.Tensor | None) -> tuple[int, int, int]:
    if scale is None:
        return 0, 0, 0
    if scale.dim() != 3:
        raise ValueError(f"KV scales must be [num_pages, page_size, heads], got {tuple(scale.shape)}")
    return scale.stride(0), scale.stride(1), scale.stride(2)


def check_int8_scales(cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """True for an int8 cache; then both fp16 scale tensors must be given."""
    if cache.dtype != torch.int8:
        return False
    if k_scale is None or v_scale is None:
        raise ValueError("int8 KV cache needs k_scale and v_scale [num_pages, page_size, heads] float16")
    return True


@dataclass(frozen=True)
class KVCacheArgs:
    """What every kernel that reads or writes the paged KV cache is launched with."""

    int8: bool
    rotate: bool  # int8 rows are Hadamard-rotated (ref.kv_rotated)
    log2_d: int
    k_scale: torch.Tensor  # the scales, or the cache itself as a placeholder the kernel never reads
    v_scale: torch.Tensor
    strides: tuple[int, ...]  # K page/slot/head, V page/slot/head/dim, scale page/slot/head

    @property
    def v_dim_major(self) -> bool:
        """V stored dim-major within a page (v_cache_strides): its dim stride is not 1."""
        return self.strides[6] != 1

    def int8_convert(self, device: torch.device) -> int:
        """The attention kernels' KV_CVT on this device: how int8 K/V tiles become fp16 for the
        dots (CVT_INT, CVT_V_PTX, CVT_HW; see kv_for_dots)."""
        if not self.int8:
            return CVT_INT.value
        if tiles_for(device).int8_convert_hw:
            return CVT_HW.value
        return (CVT_V_PTX if self.v_dim_major and uses_ptx(device) else CVT_INT).value


def kv_cache_args(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                  v_scale: torch.Tensor | None, head_dim: int) -> KVCacheArgs:
    int8 = check_int8_scales(k_cache, k_scale, v_scale)
    s_strides = scale_strides(k_scale if int8 else None)
    if int8 and scale_strides(v_scale) != s_strides:
        raise ValueError("k_scale and v_scale must share a layout")
    return KVCacheArgs(
        int8=int8, rotate=int8 and kv_rotated(head_dim), log2_d=max(0, head_dim.bit_length() - 1),
        k_scale=k_scale if int8 else k_cache, v_scale=v_scale if int8 else v_cache,
        strides=cache_strides(k_cache) + v_cache_strides(v_cache) + s_strides)


@dataclass(frozen=True)
class AttentionExtras:
    """The sliding window and sinks an attention kernel is launched with."""

    has_window: bool
    has_sinks: bool
    sinks: torch.Tensor  # the sinks, or q as a placeholder the kernel never reads


def attention_extras(window: int, sinks: torch.Tensor | None, num_q_heads: int,
                     q: torch.Tensor) -> AttentionExtras:
    if window < 0:
        raise ValueError(f"window must be >= 0 (0 = full attention), got {window}")
    if sinks is not None:
        if sinks.shape != (num_q_heads,) or sinks.dtype != torch.float32 or not sinks.is_contiguous():
            raise ValueError(f"sinks must be a contiguous float32 [{num_q_heads}] tensor, "
                             f"got {sinks.dtype} {tuple(sinks.shape)}")
    return AttentionExtras(has_window=window > 0, has_sinks=sinks is not None,
                           sinks=q if sinks is None else sinks)


@triton.jit
def sink_start(sinks_ptr, heads, mask, first, m_i, l_i):
    """The running (max, sum) seeded with each row's sink logit (in log2 units, as the scores):
    the sink is one more softmax term exp(sink) with no value. Only where `first`, so a split
    decode counts it once."""
    sink = tl.load(sinks_ptr + heads, mask=mask, other=0.0).to(tl.float32) * 1.4426950408889634
    m_i = tl.where(first, sink, m_i)
    l_i = tl.where(first, 1.0, l_i)
    return m_i, l_i


# KV_CVT, how the attention kernels turn int8 K/V into fp16 (kv_for_dots):
CVT_INT = tl.constexpr(0)  # int8_to_fp16's integer ops for K and V (portable; NVIDIA's default)
CVT_V_PTX = tl.constexpr(1)  # the same for K, int8_to_fp16_ptx for V (dim-major V on NVIDIA)
CVT_HW = tl.constexpr(2)  # the hardware conversion for both (ArchTiles.int8_convert_hw: RDNA3)


@triton.jit
def int8_to_fp16(x, HW: tl.constexpr = False):
    """Exact int8 -> fp16 with integer ops only: the bits 0x6480 + x are the fp16 number 1152 + x
    (1024's exponent, x + 128 in the mantissa). The plain conversion goes through the
    quarter-rate int-to-float unit and made int8 KV attention slower than bf16 (measured, H200).
    HW: the plain conversion. On gfx1100 the integer form's 16-bit adds cost registers: the
    int8 prefill spilled 75-321 VGPRs a lane with it, 0-125 without (BENCHMARKS 62.2)."""
    if HW:
        return x.to(tl.float16)
    bits = x.to(tl.int16) + 0x6480
    return bits.to(tl.float16, bitcast=True) - 1152.0


@triton.jit
def int8_to_fp16_ptx(x):
    """int8_to_fp16 in three PTX instructions per four values (NVIDIA only): the sign bits
    flipped (x + 128 as a byte, one LOP3), then each byte placed under a 0x64 high byte (1024 + x
    + 128, two PRMTs), then the packed subtraction. Fewer instructions than the plain form, whose
    sign extension takes a PRMT and an add per pair, in the int8 V tile of the decode loop."""
    biased = tl.inline_asm_elementwise(
        "{ .reg .b32 t; xor.b32 t, $2, 0x80808080; prmt.b32 $0, t, 0x64646464, 0x5140; "
        "prmt.b32 $1, t, 0x64646464, 0x5342; }", "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
    return biased - 1152.0


@triton.jit
def page_rows(offs_n, end, PAGE_SIZE: tl.constexpr):
    """The tokens offs_n whose page holds a key below `end`: the mask of page-table reads and of
    int8 V rows, constant over each page (so a dim-major V tile still loads as vectors, which a
    mask ending mid-page forbids)."""
    return offs_n // PAGE_SIZE * PAGE_SIZE < end


@triton.jit
def load_paged_kv(k_ptr, v_ptr, page_table_ptr, row_offset, offs_n, n_mask, page_mask, offs_d, d_mask,
                  kv_head, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_vd,
                  like, PAGE_SIZE: tl.constexpr, INT8_KV: tl.constexpr, DOT_F32: tl.constexpr,
                  RAW_K: tl.constexpr = False, KV_CVT: tl.constexpr = 0):
    """One tile of K and V rows (tokens offs_n of one sequence, one KV head; n_mask its keys,
    page_mask = page_rows) gathered through the page table, in the dtype the dot products take
    (`like`'s, or fp16 for int8 KV; RAW_K: int8 K stays int8, for int8 score dots; KV_CVT: the
    int8 conversion, KVCacheArgs.int8_convert). Returns the tiles and each token's (page, slot) for reading
    its int8 scales."""
    page = tl.load(page_table_ptr + row_offset + offs_n // PAGE_SIZE, mask=page_mask, other=0)
    page = page.to(tl.int64)
    slot = offs_n % PAGE_SIZE
    k, v = gather_kv(k_ptr, v_ptr, page, slot, n_mask, page_mask, offs_d, d_mask, kv_head,
                     stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_vd)
    k, v = kv_for_dots(k, v, like, INT8_KV, DOT_F32, RAW_K, KV_CVT)
    return k, v, page, slot


@triton.jit
def gather_kv(k_ptr, v_ptr, page, slot, n_mask, page_mask, offs_d, d_mask, kv_head,
              stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_vd):
    """K and V rows of tokens at (page int64, slot), as stored (0 where masked). int8 V rows are
    read for every token of page_mask's pages: the rows past n_mask in the last page are finite
    codes whose probabilities (and scales) are 0; float V keeps n_mask (a stale row there could
    hold an inf or NaN, which times 0 is NaN)."""
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + page[:, None] * stride_kp + slot[:, None] * stride_ks
                + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v_mask = kv_mask
    if v_ptr.dtype.element_ty == tl.int8:
        v_mask = page_mask[:, None] & d_mask[None, :]
    v = tl.load(v_ptr + page[:, None] * stride_vp + slot[:, None] * stride_vs
                + kv_head * stride_vh + offs_d[None, :] * stride_vd, mask=v_mask, other=0.0)
    return k, v


@triton.jit
def kv_for_dots(k, v, like, INT8_KV: tl.constexpr, DOT_F32: tl.constexpr, RAW_K: tl.constexpr,
                KV_CVT: tl.constexpr = 0):
    """Stored K/V tiles in the dtype the dot products take (see load_paged_kv)."""
    if INT8_KV and not DOT_F32:
        if not RAW_K:
            k = int8_to_fp16(k, KV_CVT == CVT_HW)
        if KV_CVT == CVT_V_PTX:
            v = int8_to_fp16_ptx(v)
        else:
            v = int8_to_fp16(v, KV_CVT == CVT_HW)
    else:
        if not RAW_K:
            k = k.to(like.dtype)
        v = v.to(like.dtype)
    return k, v


@triton.jit
def load_token_scales(s_ptr, page, slot, kv_head, stride_sp, stride_ss, stride_sh, n_mask):
    """The per-token fp16 scales of one KV head for a tile of tokens, as fp32."""
    return tl.load(s_ptr + page * stride_sp + slot * stride_ss + kv_head * stride_sh,
                   mask=n_mask, other=0.0).to(tl.float32)


@triton.jit
def load_key_scales(s_ptr, page, slot, kv_head, stride_sp, stride_ss, stride_sh):
    """load_token_scales without its mask, for int8 K's scales where the caller replaces every
    score past its keys with -inf by a select (which no NaN from a stale scale survives): every
    (page, slot) is in the cache, as masked page-table reads give page 0. The masked load cost
    gfx1100's int8 prefill ~80 spilled VGPRs a lane at head_dim 256, while sm_90's spilled 32
    bytes more without it (BENCHMARKS 62.3): PrefillTiles.unmasked_key_scales chooses."""
    return tl.load(s_ptr + page * stride_sp + slot * stride_ss + kv_head * stride_sh).to(tl.float32)


# -- the tile steps of both attention kernels (decode: rows are query heads; prefill: tokens) -----

@triton.jit
def fwht(x, LOG2_D: tl.constexpr):
    """x [R, 2**LOG2_D] float32 @ H (ref.kv_rotation's +-1 Walsh-Hadamard matrix, unscaled) by
    LOG2_D butterfly stages in fp32: element i pairs with i ^ 2^b. It never holds H: building
    the D x D sign matrix in registers for a tl.dot took ~80 registers per thread (D 128),
    halved the decode kernel's occupancy for int8 KV and spilled on gfx1100 in the KV store."""
    R: tl.constexpr = x.shape[0]
    D: tl.constexpr = 1 << LOG2_D
    for b in tl.static_range(LOG2_D):
        y = tl.permute(tl.reshape(x, [R, D >> (b + 1), 2, 1 << b]), [0, 1, 3, 2])
        u, v = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(u + v, u - v), [0, 1, 3, 2]), [R, D])
    return x


@triton.jit
def prepare_q(q, offs_d, sm_scale_log2, HEAD_DIM: tl.constexpr, LOG2_D: tl.constexpr,
              ROTATE: tl.constexpr, INT8_KV: tl.constexpr, DOT_F32: tl.constexpr):
    """q in the dtype the score dot takes; against rotated int8 rows, q @ H / D scores the same."""
    if ROTATE:
        q = fwht(q.to(tl.float32), LOG2_D) * (1.0 / HEAD_DIM)
    if DOT_F32:
        q = q.to(tl.float32)
    elif INT8_KV:
        # fp16 operands for int8 KV (see int8_to_fp16); folding the softmax scale into q first
        # keeps a bf16 q well inside fp16 range.
        q = (q.to(tl.float32) * sm_scale_log2).to(tl.float16)
    return q


@triton.jit
def tile_scores(q, k, ks_ptr, page, slot, kv_head, stride_sp, stride_ss, stride_sh, n_mask,
                sm_scale_log2, INT8_KV: tl.constexpr, DOT_F32: tl.constexpr,
                KS_UNMASKED: tl.constexpr = False):
    """q @ k^T in log2 units (the softmax scale applied, int8 K's per-token scales too;
    KS_UNMASKED: by load_key_scales, the caller's select dropping the scores past n_mask)."""
    ks = sm_scale_log2  # unused unless INT8_KV
    if INT8_KV:
        if KS_UNMASKED:
            ks = load_key_scales(ks_ptr, page, slot, kv_head, stride_sp, stride_ss, stride_sh)
        else:
            ks = load_token_scales(ks_ptr, page, slot, kv_head, stride_sp, stride_ss, stride_sh, n_mask)
    return scaled_scores(q, k, ks, sm_scale_log2, INT8_KV, DOT_F32)


@triton.jit
def per_tile(x, in_loop, ON: tl.constexpr):
    """x itself, for one KV tile; with ON (the kernels' TILE_Q) behind a select on in_loop, a
    condition on the tile's start that holds in every tile but that the compiler cannot prove, so
    a dot taking the result converts x into its operand layout in each tile instead of once
    before the loop. That hoisted copy lives through the loop: on gfx1100 a [16, 256] q in WMMA's
    operand layout (both half waves hold it) is 128 VGPRs a lane, and head_dim 256 spilled
    (ArchTiles' tile_q_from). in_loop must compare with a bound the compiler does not know:
    n0 >= 0 folds, n0 >= start or n0 < end do not (which one spills less differs by kernel:
    BENCHMARKS 63)."""
    if ON:
        x = tl.where(in_loop, x, tl.zeros_like(x))
    return x


@triton.jit
def scaled_scores(q, k, ks, sm_scale_log2, INT8_KV: tl.constexpr, DOT_F32: tl.constexpr):
    """tile_scores with int8 K's per-token scales `ks` [BLOCK_N] already loaded."""
    scores = tl.dot(q, tl.trans(k))
    if INT8_KV:
        scores = scores * ks[None, :]
    if not INT8_KV or DOT_F32:
        scores = scores * sm_scale_log2
    return scores


@triton.jit
def accumulate_pv(acc, alpha, p, v, vs_ptr, page, slot, kv_head, stride_sp, stride_ss, stride_sh,
                  n_mask, INT8_KV: tl.constexpr):
    """acc * alpha + p @ v (int8 V's per-token scales folded into p)."""
    vs = alpha  # unused unless INT8_KV
    if INT8_KV:
        vs = load_token_scales(vs_ptr, page, slot, kv_head, stride_sp, stride_ss, stride_sh, n_mask)
    return scaled_pv(acc, alpha, p, v, vs, INT8_KV)


@triton.jit
def scaled_pv(acc, alpha, p, v, vs, INT8_KV: tl.constexpr):
    """accumulate_pv with int8 V's per-token scales `vs` [BLOCK_N] already loaded."""
    if INT8_KV:
        p = p * vs[None, :]
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def unrotate_out(out, offs_d, HEAD_DIM: tl.constexpr, LOG2_D: tl.constexpr, ROTATE: tl.constexpr,
                 DOT_F32: tl.constexpr):
    """Back from rotated rows (linear, so split-KV partials merge the same either way)."""
    if ROTATE:
        out = fwht(out, LOG2_D) * (1.0 / HEAD_DIM)
    return out
