"""The dot products of the fused MoE decode kernels (fused_moe_decode.py): a block's one or two
slots through one expert's columns over a K range, for 4-bit or dense weights, in fp32.

4-bit (moe_ref.MoeW4: words [E, K // 8, N], per-group scale and bias): a [BLOCK_K / 8, BLOCK_N]
tile of packed words per step, its eight nibbles walked with w4a16_gemv.nibble_f32 (one AND-OR,
a subtraction and an FMA a nibble); one step never spans two groups (BLOCK_K <= group). Dense
(w13 [E, 2I, H], w2 [E, H, I], HF layout): a [BLOCK_N, BLOCK_K] tile of rows, K contiguous,
K's tail masked. Both decode each weight once for the block's two slots (TWO). A step's
weights are loaded apart from its dot (step_weights, step_dot), so the down kernel can request
its first step before its PDL wait.
"""

from __future__ import annotations

import triton
import triton.language as tl

from homelab_llm.engine.kernels.w4a16_gemv import nibble_f32, unscale_pow2


@triton.jit
def w4_tile(w, s, b, offs_n, n_mask, k0, stride_wr, stride_sg, GROUP_SIZE: tl.constexpr,
            BLOCK_K: tl.constexpr):
    """One K step's weights as stored: the [BLOCK_K / 8, BLOCK_N] packed words and the group's
    scale and bias [BLOCK_N] (fp32)."""
    word_rows = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    packed = tl.load(w + word_rows[:, None].to(tl.int64) * stride_wr + offs_n[None, :],
                     mask=n_mask[None, :], other=0)
    g = (k0 // GROUP_SIZE) * stride_sg
    scale = tl.load(s + g + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    bias = tl.load(b + g + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    return packed, scale, bias


@triton.jit
def w4_dot(packed, scale, bias, k0, x0, x1, TWO: tl.constexpr):
    """x0 (and x1) [k0, k0 + BLOCK_K) through w4_tile's step: [BLOCK_N] fp32 each. W = q * scale
    + bias within a group, so the tile's sum is sum(q * x) * scale + sum(x) * bias."""
    ROWS: tl.constexpr = packed.shape[0]
    word_rows = k0 // 8 + tl.arange(0, ROWS)
    high = packed >> 20  # nibbles 5..7 where nibble_f32's AND-OR reaches them
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
def dense_dot(tile, k0, K, x0, x1, TWO: tl.constexpr):
    """x0 (and x1) [k0, k0 + BLOCK_K) through a step's weight rows tile [BLOCK_N, BLOCK_K] (K
    contiguous, K's tail masked to 0)."""
    offs_k = k0 + tl.arange(0, tile.shape[1])
    k_mask = offs_k < K
    tile = tile.to(tl.float32)
    x = tl.load(x0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    part0 = tl.sum(tile * x[None, :], axis=1)
    part1 = part0
    if TWO:
        x = tl.load(x1 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        part1 = tl.sum(tile * x[None, :], axis=1)
    return part0, part1


@triton.jit
def step_weights(w, s, b, offs_n, n_mask, k0, K, stride_wr, stride_sg, W4: tl.constexpr,
                 GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weights of the K step at k0, as step_dot takes them: 4-bit (words, scale, bias) or
    dense (the [BLOCK_N, BLOCK_K] rows three times). Reads nothing but the weights, so a decode
    kernel may issue it ahead of its PDL wait (pdl.py)."""
    if W4:
        return w4_tile(w, s, b, offs_n, n_mask, k0, stride_wr, stride_sg, GROUP_SIZE, BLOCK_K)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        tile = tl.load(w + offs_n[:, None].to(tl.int64) * stride_wr + offs_k[None, :],
                       mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)
        return tile, tile, tile


@triton.jit
def step_dot(w0, w1, w2, k0, K, x0, x1, W4: tl.constexpr, TWO: tl.constexpr):
    """x0 (and x1) through step_weights' (w0, w1, w2) of the step at k0."""
    if W4:
        return w4_dot(w0, w1, w2, k0, x0, x1, TWO)
    else:
        return dense_dot(w0, k0, K, x0, x1, TWO)


@triton.jit
def expert_columns(first0, first1, first2, w, s, b, offs_n, n_mask, k_start, k_end, x0, x1,
                   stride_wr, stride_sg, W4: tl.constexpr, GROUP_SIZE: tl.constexpr,
                   BLOCK_K: tl.constexpr, TWO: tl.constexpr):
    """Rows x0 (and x1) over K range [k_start, k_end) through one expert's columns offs_n (w, s, b
    already point at the expert): fp32 [BLOCK_N] partial sums. first0-2: step_weights of the
    step at k_start, loaded by the caller (ahead of its PDL wait where it may)."""
    acc0, acc1 = step_dot(first0, first1, first2, k_start, k_end, x0, x1, W4, TWO)
    for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
        w0, w1, w2 = step_weights(w, s, b, offs_n, n_mask, k0, k_end, stride_wr, stride_sg, W4,
                                  GROUP_SIZE, BLOCK_K)
        p0, p1 = step_dot(w0, w1, w2, k0, k_end, x0, x1, W4, TWO)
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


@triton.jit
def program_share(sorted_ptr, block_expert_ptr, w_ptr, s_ptr, b_ptr, num_slots, N, K, k_per_split,
                  stride_we, stride_se, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A decode program's share, grid (block, column block, K split): its block's slots
    (block_slots' slot0, valid0, slot1, valid1), K range [k_start, k_end), columns (offs_n,
    n_mask) and the block's expert's weight, scale and bias pointers."""
    e, slot0, valid0, slot1, valid1 = block_slots(sorted_ptr, block_expert_ptr, tl.program_id(0),
                                                  num_slots, BLOCK_M)
    k_start = tl.program_id(2) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return (slot0, valid0, slot1, valid1, k_start, k_end, offs_n, offs_n < N,
            w_ptr + e * stride_we, s_ptr + e * stride_se, b_ptr + e * stride_se)
