"""W4A16 for a few rows on tensor cores, one dot a K step over a K-major weight tile.

The few-row kernel in w4a16_dot.py runs eight tensor-core dots a K step (one per nibble of the
packed words), each staging its tile through shared memory: 20 barriers a step on sm_90
(Nsight Compute: latency bound, 21% of DRAM peak at 4 rows). Building the dequantized step in
natural [K, N] order and running one dot measured 3x slower: each thread holds eight k values of
a column (one word), and an N-major shared tile scatters them into eight rows, two bytes a store.

Here the tile is built **K-major**, [BLOCK_N, BLOCK_K]: a thread's word becomes eight
consecutive bf16 of one row of the tile, so the store into shared memory for the dot is one
16-byte vector, and the dot takes the transpose (both operand orders are native to the MMA
units). The words' eight nibbles come as the four AND-OR pairs (q_j, q_j+4) | magic of
w4a16_dot.nibble_pair (exact bf16 128 + q, or fp16 1024 + q; no conversion instruction), so a
word's slot s = 2j + h holds k = j + 4h; x is loaded in that same order (a gather from L1:
the k order of a dot is free), and the step applies W = q s + b as
acc += (inner - OFFSET sum_k x) s + (sum_k x) b (one group covers a step: BLOCK_K divides
the group size).

SWAP puts the weights in the MMA's row operand (out^T = W^T x^T: the tile's BLOCK_N rows fill
the 16..64-row MMA shapes while the few activation rows pad only the column operand); otherwise
x is the row operand (padded to 16 rows). Thin outputs split K with the GEMV's deterministic
ticket epilogue (w4a16_gemv.store_or_reduce); splits fill whole waves (launch_fit).

Invariants: qweight [K // 8, N] int32 (w4a16_pack), group size a multiple of BLOCK_K, x row
contiguous in bf16 or fp16; block_m >= 16 and block_k >= 16 (tl.dot's minimum).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.common import dot_in_fp32, next_pow2
from homelab_llm.engine.kernels.launch_fit import fit_split, resident_programs
from homelab_llm.engine.kernels.tuning import GemmTiles, tiles_for
from homelab_llm.engine.kernels.w4a16_gemv import pick_split, store_or_reduce, ticket_buffer
from homelab_llm.engine.kernels.w4a16_pack import W4Weight


@triton.jit
def kmajor_tile(words, X_F16: tl.constexpr):
    """words [BLOCK_N, WROWS] int32 -> [BLOCK_N, 8 * WROWS] floats OFFSET + q, exact, where column
    8 r + s of a row is nibble s // 2 + 4 (s % 2) of word r (slot_k gives the k of each column).
    tl.join appends its axis last (in-thread), so the reshapes move no data."""
    magic: tl.constexpr = 0x64006400 if X_F16 else 0x43004300
    fdt: tl.constexpr = tl.float16 if X_F16 else tl.bfloat16
    p0 = (words & 0x000F000F) | magic
    p1 = ((words >> 4) & 0x000F000F) | magic
    p2 = ((words >> 8) & 0x000F000F) | magic
    p3 = ((words >> 12) & 0x000F000F) | magic
    pairs = tl.join(tl.join(p0, p2), tl.join(p1, p3))  # [..., a, b] = p_(2a + b)
    pairs = tl.reshape(pairs, [words.shape[0], words.shape[1] * 4])
    lo = pairs.to(tl.int16).to(fdt, bitcast=True)  # q_j (the low half)
    hi = (pairs >> 16).to(tl.int16).to(fdt, bitcast=True)  # q_j+4
    return tl.reshape(tl.join(lo, hi), [words.shape[0], words.shape[1] * 8])


@triton.jit
def slot_k(BLOCK_K: tl.constexpr):
    """The k (within a step) of each column of kmajor_tile: 8 r + s // 2 + 4 (s % 2)."""
    s = tl.arange(0, BLOCK_K)
    return (s & ~7) + ((s & 7) >> 1) + 4 * (s & 1)


@triton.jit
def _w4a16_kdot_kernel(
    x_ptr, qw_ptr, scales_ptr, biases_ptr, out_ptr, ws_ptr, ticket_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_qw, stride_sg, stride_om, num_splits,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WROWS: tl.constexpr,
    SWAP: tl.constexpr, DOT_F32: tl.constexpr, LOOP_STAGES: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    BLOCK_K: tl.constexpr = WROWS * 8
    X_F16: tl.constexpr = x_ptr.dtype.element_ty == tl.float16
    OFFSET: tl.constexpr = 1024.0 if X_F16 else 128.0
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_tile = qw_ptr + tl.arange(0, WROWS)[None, :] * stride_qw + offs_n[:, None]  # [BLOCK_N, WROWS]
    x_tile = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + slot_k(BLOCK_K)[None, :]
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=LOOP_STAGES):
        words = tl.load(w_tile + (k0 // 8) * stride_qw, mask=n_mask[:, None], other=0)
        g_off = (k0 // GROUP_SIZE) * stride_sg + offs_n
        s = tl.load(scales_ptr + g_off, mask=n_mask, other=0.0).to(tl.float32)
        b = tl.load(biases_ptr + g_off, mask=n_mask, other=0.0).to(tl.float32)
        xs = tl.load(x_tile + k0, mask=m_mask[:, None], other=0.0)
        x_sum = tl.sum(xs.to(tl.float32), axis=1)
        wt = kmajor_tile(words, X_F16)
        if DOT_F32:
            wt = wt.to(tl.float32)
            xs = xs.to(tl.float32)
        else:
            xs = xs.to(wt.dtype)
        if SWAP:
            inner = tl.dot(wt, tl.trans(xs))  # [BLOCK_N, BLOCK_M]
            acc += (inner - OFFSET * x_sum[None, :]) * s[:, None] + x_sum[None, :] * b[:, None]
        else:
            inner = tl.dot(xs, tl.trans(wt))  # [BLOCK_M, BLOCK_N]
            acc += (inner - OFFSET * x_sum[:, None]) * s[None, :] + x_sum[:, None] * b[None, :]
    if SWAP:
        part = tl.trans(acc)
    else:
        part = acc
    ticket = ticket_ptr + pid_m * tl.num_programs(1) + pid_n
    store_or_reduce(part, out_ptr, ws_ptr, ticket, pid_k, offs_m, offs_n, M, N, stride_om, num_splits)


def kdot_grid(m: int, n: int, group_size: int, tiles: GemmTiles) -> tuple[int, int, int, int]:
    """(rows a program, word rows a K step, row blocks, column blocks): block_m a power of two
    from 16 up to tiles.block_m, the step at most one group."""
    block_m = min(tiles.block_m, max(16, next_pow2(m)))
    wrows = max(2, min(tiles.block_k, group_size) // 8)
    return block_m, wrows, triton.cdiv(m, block_m), triton.cdiv(n, tiles.block_n)


def w4a16_kdot(x2: torch.Tensor, w: W4Weight, out: torch.Tensor, tiles: GemmTiles | None = None,
               split: int | None = None, swap: bool = True) -> torch.Tensor:
    """out[M, N] = x2[M, K] @ W for a few rows; x2 already permuted (act-order) and row-contiguous.
    tiles: block_m an upper bound (the rows a program takes, at least 16), block_k the step
    (capped at the group size); split: K splits (None: whole waves of resident programs)."""
    m, k = x2.shape
    n = w.out_features
    t = tiles or tiles_for(x2.device).w4a16_dot
    block_m, wrows, grid_m, grid_n = kdot_grid(m, n, w.group_size, t)
    block_k = wrows * 8
    meta = dict(GROUP_SIZE=w.group_size, BLOCK_M=block_m, BLOCK_N=t.block_n, WROWS=wrows, SWAP=swap,
                DOT_F32=dot_in_fp32(), LOOP_STAGES=t.num_stages, num_warps=t.num_warps,
                num_stages=t.num_stages)
    tickets = ticket_buffer(x2.device, grid_m * grid_n)

    def args(ws: torch.Tensor, k_per_split: int, split: int) -> tuple:
        return (x2, w.qweight, w.scales, w.biases, out, ws, tickets, m, n, k, k_per_split,
                x2.stride(0), w.qweight.stride(0), w.scales.stride(0), out.stride(0), split)

    if split is None:
        resident = resident_programs(_w4a16_kdot_kernel, (x2.dtype,) + tuple(sorted(meta.items())),
                                     x2.device, args(out, 2 * block_k, 2), meta)
        split = (fit_split(grid_m * grid_n, triton.cdiv(k, block_k), resident, min_steps=2) if resident
                 else pick_split(grid_m * grid_n, k, block_k, x2.device, waves=t.split_k))
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    ws = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x2.device)
    _w4a16_kdot_kernel[(grid_m, grid_n, split)](*args(ws, k_per_split, split), **meta)
    return out
