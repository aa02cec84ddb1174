"""The dot products of the fused MoE decode kernels (fused_moe_decode.py): a block's one or two
slots through one expert's columns over a K range, for 4-bit or dense weights, in fp32.

4-bit (moe_ref.MoeW4: words [E, K // 8, N], per-group scale and bias): a [BLOCK_K / 8, BLOCK_N]
tile of packed words per step, its eight nibbles walked with w4a16_gemv.nibble_f32 (one AND-OR,
a subtraction and an FMA a nibble); one step never spans two groups (BLOCK_K <= group). Dense
(w13 [E, 2I, H], w2 [E, H, I], HF layout): a [BLOCK_N, BLOCK_K] tile of rows, K contiguous,
K's tail masked. Both decode each weight once for the block's two slots (TWO).
"""

from __future__ import annotations

import triton
import triton.language as tl

from homelab_llm.engine.kernels.w4a16_gemv import nibble_f32, unscale_pow2


@triton.jit
def w4_step(w, s, b, offs_n, n_mask, k0, x0, x1, stride_wr, stride_sg,
            GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, TWO: tl.constexpr):
    """x0 (and x1) [k0, k0 + BLOCK_K) through one [BLOCK_K / 8, BLOCK_N] tile of packed words:
    [BLOCK_N] fp32 each. W = q * scale + bias within a group, so the tile's sum is
    sum(q * x) * scale + sum(x) * bias."""
    ROWS: tl.constexpr = BLOCK_K // 8
    word_rows = k0 // 8 + tl.arange(0, ROWS)
    packed = tl.load(w + word_rows[:, None].to(tl.int64) * stride_wr + offs_n[None, :],
                     mask=n_mask[None, :], other=0)
    high = packed >> 20  # nibbles 5..7 where nibble_f32's AND-OR reaches them
    g = (k0 // GROUP_SIZE) * stride_sg
    scale = tl.load(s + g + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    bias = tl.load(b + g + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    inner0 = tl.zeros(packed.shape, tl.float32)
    inner1 = tl.zeros(packed.shape, tl.float32)
    x_sum0 = tl.zeros([ROWS], tl.float32)
    x_sum1 = tl.zeros([ROWS], tl.float32)
    for j in tl.static_range(8):
        if j < 5:
            q = nibble_f32(packed, j)
        else:
            q = nibble_f32(high, j)
        xj = tl.load(x0 + word_rows * 8 + j).to(tl.float32)
        inner0 += q * unscale_pow2(xj, j)[:, None]
        x_sum0 += xj
        if TWO:
            xj = tl.load(x1 + word_rows * 8 + j).to(tl.float32)
            inner1 += q * unscale_pow2(xj, j)[:, None]
            x_sum1 += xj
    part0 = tl.sum(inner0, axis=0) * scale + tl.sum(x_sum0, axis=0) * bias
    part1 = tl.sum(inner1, axis=0) * scale + tl.sum(x_sum1, axis=0) * bias
    return part0, part1


@triton.jit
def dense_step(w, offs_n, n_mask, k0, K, x0, x1, stride_wr, BLOCK_K: tl.constexpr,
                TWO: tl.constexpr):
    """x0 (and x1) [k0, k0 + BLOCK_K) through the weight rows offs_n (K contiguous)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    tile = tl.load(w + offs_n[:, None].to(tl.int64) * stride_wr + offs_k[None, :],
                   mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
    x = tl.load(x0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    part0 = tl.sum(tile * x[None, :], axis=1)
    part1 = part0
    if TWO:
        x = tl.load(x1 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        part1 = tl.sum(tile * x[None, :], axis=1)
    return part0, part1


@triton.jit
def expert_columns(w, s, b, offs_n, n_mask, k_start, k_end, x0, x1, stride_wr, stride_sg,
                   W4: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, TWO: tl.constexpr):
    """Rows x0 (and x1) over K range [k_start, k_end) through one expert's columns offs_n (w, s, b
    already point at the expert): fp32 [BLOCK_N] partial sums."""
    acc0 = tl.zeros([BLOCK_N], tl.float32)
    acc1 = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if W4:
            p0, p1 = w4_step(w, s, b, offs_n, n_mask, k0, x0, x1, stride_wr, stride_sg,
                             GROUP_SIZE, BLOCK_K, TWO)
        else:
            p0, p1 = dense_step(w, offs_n, n_mask, k0, k_end, x0, x1, stride_wr, BLOCK_K, TWO)
        acc0 += p0
        acc1 += p1
    return acc0, acc1


@triton.jit
def block_slots(sorted_ptr, block_expert_ptr, pid_m, num_slots, BLOCK_M: tl.constexpr):
    """Block pid_m's expert (>= 0) and its slots: (e, slot0, valid0, slot1, valid1); an invalid
    slot reads as 0 (an unused block, e -1, has none)."""
    e = tl.load(block_expert_ptr + pid_m)
    limit = tl.where(e >= 0, num_slots, 0)
    slot0 = tl.load(sorted_ptr + pid_m * BLOCK_M)
    valid0 = slot0 < limit
    slot1 = slot0
    if BLOCK_M == 2:
        slot1 = tl.load(sorted_ptr + pid_m * BLOCK_M + 1)
    valid1 = (slot1 < limit) & (BLOCK_M == 2)
    slot0 = tl.where(valid0, slot0, 0).to(tl.int64)
    slot1 = tl.where(valid1, slot1, 0).to(tl.int64)
    return tl.maximum(e, 0).to(tl.int64), slot0, valid0, slot1, valid1
