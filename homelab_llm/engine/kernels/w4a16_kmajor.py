"""W4A16 batch-1 GEMV over a K-major copy of the packed weight: a candidate, not routed.

Why (issue 19, docs/BENCHMARKS.md 13.1 / 13.3): the bf16 decode GEMV beats cuBLAS with 1-4
weight rows a program, each streaming its contiguous K. The packed layout (w4a16_pack.W4Weight,
[K // 8, N]) is N-major, so the packed-half GEMV needs wide column blocks and splits K 32-64
ways on the 8B's matrices; its ~6 us of fixed cost a call (activation prologue, split
reduction) holds batch 1 near 310 tok/s. Here the same words are stored K-major, so a program
takes BLOCK_N whole output columns and walks K as the bf16 GEMV does. If a sweep
(`benchmarks/w4a16_sweep.py --only 'h2,km*'`) shows it ahead, the next step is to make this the
resident layout (every W4A16 kernel, TP sharding and the repackers then read it).

Layout (KMajorW4, `to_kmajor`): qk int32 [N, K // 8], nibble j of word r holds k = 8r + j (as
in W4Weight); scales / biases [N, K // G], W[k, n] = q * scale + bias within a group.

A K step is BLOCK_W words of each of the program's columns, a [BLOCK_N, GPS groups, WPG words a
group] tile: [GPS, WPG] spans the program's threads at 4 consecutive words (16 bytes) each, so
every thread holds all BLOCK_N columns of its words, and the step's activations (eight stride-8
slices of x) are loaded and converted once for all of them. Products: packed fp16 pairs
(half2, as the packed-half GEMV: w4a16_half2.nibble_pairs against activations scaled per group
in registers), or fp32 (w4a16_gemv.nibble_f32: one AND-OR, one subtract). Per word lane
acc += inner * scale + sum(x) * bias, summed once at the end. One row (the batch-1 case it
exists for); split K reduces with the shared ticket epilogue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.w4a16_gemv import (nibble_f32, pick_split, store_or_reduce,
                                                     ticket_buffer, unscale_pow2)
from homelab_llm.engine.kernels.w4a16_half2 import (PRODUCT_UNDO, X_SCALE_EVEN, X_SCALE_ODD, half_hi,
                                                      half_lo, hfma2, hmul2, nibble_pairs, uses_ptx)
from homelab_llm.engine.kernels.w4a16_pack import W4Weight

MAX_COLUMNS = 16  # columns a program holds (each thread keeps all of them)


@dataclass
class KMajorW4:
    qk: torch.Tensor  # int32 [N, K // 8]
    scales: torch.Tensor  # [N, K // G]
    biases: torch.Tensor  # [N, K // G]
    group_size: int

    @property
    def in_features(self) -> int:
        return self.qk.shape[1] * 8

    @property
    def out_features(self) -> int:
        return self.qk.shape[0]


def to_kmajor(w: W4Weight) -> KMajorW4:
    """The same weight with K contiguous per output column (a copy). Act-order weights keep
    their permutation on the caller's side, as for W4Weight (x arrives permuted)."""
    return KMajorW4(w.qweight.t().contiguous(), w.scales.t().contiguous(),
                    w.biases.t().contiguous(), w.group_size)


@triton.jit
def _inner_f32(words, x0, x1, x2, x3, x4, x5, x6, x7):
    """sum_j q_j x_j per word, fp32: x_j pre-scaled by unscale_pow2 (nibble_f32's powers)."""
    high = words >> 20  # nibbles 5..7 where nibble_f32's AND-OR reaches them
    inner = nibble_f32(words, 0) * x0
    inner += nibble_f32(words, 1) * x1
    inner += nibble_f32(words, 2) * x2
    inner += nibble_f32(words, 3) * x3
    inner += nibble_f32(words, 4) * x4
    inner += nibble_f32(high, 5) * x5
    inner += nibble_f32(high, 6) * x6
    return inner + nibble_f32(high, 7) * x7


@triton.jit
def _inner_half2(words, xp0, xp1, xp2, xp3, USE_ASM: tl.constexpr):
    """sum_j q_j x_j 2^-e 2^-10 per word: the nibble pairs (w4a16_half2.nibble_pairs) times the
    _x_pairs activation pairs, four packed fp16 products a word (PTX), or the same in plain
    Triton fp16 (the interpreter, gfx1100)."""
    p0, p1, p2, p3 = nibble_pairs(words)
    if USE_ASM:
        part = hfma2(p3, xp3, hfma2(p2, xp2, hfma2(p1, xp1, hmul2(p0, xp0))))
        return half_lo(part).to(tl.float32) + half_hi(part).to(tl.float32)
    lo = half_lo(p0) * half_lo(xp0) + half_lo(p1) * half_lo(xp1)
    hi = half_hi(p0) * half_hi(xp0) + half_hi(p1) * half_hi(xp1)
    lo += half_lo(p2) * half_lo(xp2) + half_lo(p3) * half_lo(xp3)
    hi += half_hi(p2) * half_hi(xp2) + half_hi(p3) * half_hi(xp3)
    return lo.to(tl.float32) + hi.to(tl.float32)


@triton.jit
def _columns_step(acc, qk_ptr, s_ptr, b_ptr, cols, N, stride_q, stride_s, k_words, w_mask, g_off,
                  x0, x1, x2, x3, x4, x5, x6, x7, x_sum, undo, HALF2: tl.constexpr,
                  USE_ASM: tl.constexpr):
    """acc [BLOCK_N, GPS, WPG] + the program's columns' K step, per word lane: the words dotted
    with the step's activations ([GPS, WPG], shared by every column), then scaled and biased by
    the word's group. fp32: x0..x7 are the pre-scaled slices; HALF2: x0..x3 the activation pairs
    and undo [GPS, 1] their scale (x4..x7 unused)."""
    c64 = tl.minimum(cols, N - 1).to(tl.int64)[:, None, None]  # [BLOCK_N, 1, 1]
    c_ok = (cols < N)[:, None, None]
    words = tl.load(qk_ptr + c64 * stride_q + k_words[None, :, :], mask=c_ok & w_mask[None, :, :],
                    other=0, eviction_policy="evict_first")
    s = tl.load(s_ptr + c64 * stride_s + g_off[None, :, :], mask=c_ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + c64 * stride_s + g_off[None, :, :], mask=c_ok, other=0.0).to(tl.float32)
    if HALF2:
        inner = _inner_half2(words, x0[None, :, :], x1[None, :, :], x2[None, :, :], x3[None, :, :],
                             USE_ASM)
        s = s * undo[None, :, :]  # the activations' scale folded into the group's
    else:
        inner = _inner_f32(words, x0[None, :, :], x1[None, :, :], x2[None, :, :], x3[None, :, :],
                           x4[None, :, :], x5[None, :, :], x6[None, :, :], x7[None, :, :])
    return acc + inner * s + x_sum[None, :, :] * b


@triton.jit
def _pair(lo, hi):
    """Two fp32 tensors as packed fp16 pairs (int32 bits, lo in the low half)."""
    lo16 = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return lo16 | (hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _x_pairs(x0, x1, x2, x3, x4, x5, x6, x7):
    """The step's activations as w4a16_half2's pairs (x_j, x_j+4) for j = 0..3, scaled per group
    (a tile row) by 2^-e with 2^e the largest power of two <= the group's max |x| (so scaled
    values lie in (-2, 2)), times 2^14 (even j) or 2^10 (odd j); and undo [GPS, 1] = 2^e 2^10,
    which turns a product back."""
    amax = tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3))),
                      tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)), tl.maximum(tl.abs(x6), tl.abs(x7))))
    expo = tl.max(amax, axis=1)[:, None].to(tl.int32, bitcast=True) & 0x7F800000
    # an all-zero (or subnormal) group takes 2^0, so 2^-e times 2^14 stays finite
    expo = tl.where(expo == 0, 0x3F800000, expo)
    inv = (0x7F000000 - expo).to(tl.float32, bitcast=True)  # 2^-e, exact
    even = inv * X_SCALE_EVEN
    odd = inv * X_SCALE_ODD
    undo = expo.to(tl.float32, bitcast=True) * PRODUCT_UNDO
    return (_pair(x0 * even, x4 * even), _pair(x1 * odd, x5 * odd), _pair(x2 * even, x6 * even),
            _pair(x3 * odd, x7 * odd), undo)


@triton.jit
def _x_slice(x_ptr, k_words, w_mask, j: tl.constexpr):
    """x[8 w + j] for the step's words w, as fp32 (masked words read 0). Eight such stride-8
    slices cost fewer instructions than one 16-byte vector a word split in registers (sm_90
    compile: the splits moved through shared memory)."""
    return tl.load(x_ptr + k_words * 8 + j, mask=w_mask, other=0.0).to(tl.float32)


@triton.jit
def _w4a16_kmajor_kernel(
    x_ptr, qk_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, ticket_ptr,
    N, K, k_per_split, stride_q, stride_s, num_splits,
    GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, GPS: tl.constexpr, HALF2: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    WPG: tl.constexpr = GROUP_SIZE // 8  # words a group
    BLOCK_W: tl.constexpr = GPS * WPG  # words a K step
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_start = pid_k * (k_per_split // 8)
    w_end = tl.minimum(w_start + k_per_split // 8, K // 8)
    tile = tl.arange(0, GPS)[:, None] * WPG + tl.arange(0, WPG)[None, :]  # [GPS, WPG] words
    g_tile = tl.arange(0, GPS)[:, None]  # each word's group within the step
    # [GPS, WPG] covers the program's threads 4 words each, so the columns stay in each thread
    # and the activations are loaded and converted once for all of them
    acc = tl.zeros([BLOCK_N, GPS, WPG], tl.float32)
    for w0 in range(w_start, w_end, BLOCK_W):
        k_words = w0 + tile
        w_mask = k_words < w_end
        x0 = _x_slice(x_ptr, k_words, w_mask, 0)
        x1 = _x_slice(x_ptr, k_words, w_mask, 1)
        x2 = _x_slice(x_ptr, k_words, w_mask, 2)
        x3 = _x_slice(x_ptr, k_words, w_mask, 3)
        x4 = _x_slice(x_ptr, k_words, w_mask, 4)
        x5 = _x_slice(x_ptr, k_words, w_mask, 5)
        x6 = _x_slice(x_ptr, k_words, w_mask, 6)
        x7 = _x_slice(x_ptr, k_words, w_mask, 7)
        x_sum = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7
        undo = x_sum  # fp32 mode: unused
        if HALF2:
            x0, x1, x2, x3, undo = _x_pairs(x0, x1, x2, x3, x4, x5, x6, x7)
        else:  # pre-scale by nibble_f32's powers of two (exact), once for every column
            x1 = unscale_pow2(x1, 1)
            x2 = unscale_pow2(x2, 2)
            x3 = unscale_pow2(x3, 3)
            x4 = unscale_pow2(x4, 4)
            x6 = unscale_pow2(x6, 6)
            x7 = unscale_pow2(x7, 7)
        g_off = tl.minimum(w0 // WPG + g_tile, (K // GROUP_SIZE) - 1)  # [GPS, 1]
        acc = _columns_step(acc, qk_ptr, s_ptr, b_ptr, offs_n, N, stride_q, stride_s, k_words,
                            w_mask, g_off, x0, x1, x2, x3, x4, x5, x6, x7, x_sum, undo, HALF2,
                            USE_ASM)
    part = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BLOCK_N]
    store_or_reduce(part[None, :], out_ptr, ws_ptr, ticket_ptr + pid_n, pid_k, tl.arange(0, 1),
                    offs_n, 1, N, N, num_splits)

def w4a16_kmajor(x2: torch.Tensor, w: KMajorW4, out: torch.Tensor, block_n: int = 8,
                 num_warps: int = 2, split: int | None = None, waves: int = 4,
                 half2: bool = True) -> torch.Tensor:
    """out[1, N] = x2[1, K] @ W (x2 already permuted where the weight is act-order, rows
    contiguous). A K step gives each of the 32 x num_warps threads 4 words of each of the
    block_n columns (sm_90 compile, packed-half, 4 warps: 5.2 SASS instructions a weight at 4
    columns, 3.0 at 16 with 254 registers).
    half2: packed fp16 products (fma.rn.f16x2 on NVIDIA, plain fp16 elsewhere), else fp32."""
    m, k = x2.shape
    n = w.out_features
    if m != 1 or k != w.in_features:
        raise ValueError(f"w4a16_kmajor: x {tuple(x2.shape)} for a [{w.in_features}, {n}] weight "
                         "(one row)")
    if block_n < 1 or block_n > MAX_COLUMNS or block_n & (block_n - 1):
        raise ValueError(f"w4a16_kmajor: block_n {block_n} (a power of two up to {MAX_COLUMNS})")
    wpg = w.group_size // 8
    gps = max(1, 128 * num_warps // wpg)  # 4 words a thread
    block_k = gps * w.group_size
    n_blocks = triton.cdiv(n, block_n)
    split = split or pick_split(n_blocks, k, block_k, x2.device, waves)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    ws = out if split == 1 else torch.empty((split, 1, n), dtype=torch.float32, device=x2.device)
    _w4a16_kmajor_kernel[(n_blocks, split)](
        x2, w.qk, w.scales, w.biases, out, ws, ticket_buffer(x2.device, n_blocks),
        n, k, k_per_split, w.qk.stride(0), w.scales.stride(0), split,
        GROUP_SIZE=w.group_size, BLOCK_N=block_n, GPS=gps, HALF2=half2,
        USE_ASM=uses_ptx(x2.device), num_warps=num_warps,
    )
    return out
