"""W4A16 multi-row GEMV (decode, M = 1..16 rows): every packed word is read once for all M rows.

Why another GEMV (w4a16_gemv.py): at batch 1-4 a decode step is bound by reading 0.5 byte per
weight, and on an H200 a fp32 CUDA-core GEMV needs ~3 instructions per weight just to convert and
multiply, so issue slots are as scarce as bytes in flight. Here a program owns BLOCK_N output
columns (each thread whole 16-byte vectors of them: 128-bit loads, BLOCK_N = 4 x threads x c)
and walks its K range in steps of WROWS packed word rows:

  * each word row is one [1, BLOCK_N] load; nibble j of it is an outer product with the M
    activations x[:, 8r + j] (a [BLOCK_M, 1] broadcast every thread holds), FMA'd straight into
    a [BLOCK_M, BLOCK_N] fp32 accumulator: the word is dequantized once for all M rows and no
    reduction runs inside the loop (a tl.sum over word rows compiled to a tree: ~1.5
    instructions per product instead of one FMA);
  * nibble j becomes the exact float q with one AND-OR and one FMA (no int->float conversion:
    those issue at a quarter of the FMA rate): (word & 0xF << 4j) | 0x4B000000 read as fp32 is
    2^23 + q * 16^j (j <= 4; nibbles 5..7 after one shift by 20), and
    fma(that, 16^-j, -2^23 * 16^-j) = q exactly;
  * the group's scale and bias apply once per step: W = q * s + b within a group, so
    sum_k x W = s * sum_k x q + b * sum_k x (BLOCK_K = 8 * WROWS never spans two groups), the
    x sum from one vector load per step;
  * padding rows (M < BLOCK_M) read row M - 1 (unmasked loads of one address are merged; the
    store drops those rows), and the per-row/per-nibble x offsets are constants from a per-step
    base pointer, so they fold into the load instructions.

Thin matrices split K across programs (tiles.RowsTiles says how many programs per SM to aim
for); the partial sums go to an fp32 buffer and the last program of each column block sums them
in split order (w4a16_gemv.store_or_reduce: deterministic, graph-replayable, one launch). The
split count is a runtime argument: one compile serves every shape's split.

Invariants: qweight [K // 8, N] int32 (w4a16_pack.W4Weight), K a multiple of the group size,
BLOCK_M a power of two >= M, WROWS a power of two with 8 * WROWS <= group size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.common import next_pow2
from homelab_llm.engine.kernels.tuning import RowsTiles, device_sms, rows_tiles
from homelab_llm.engine.kernels.w4a16_gemv import store_or_reduce, ticket_buffer
from homelab_llm.engine.kernels.w4a16_pack import W4Weight

MAX_ROWS = 16  # more rows belong to the tensor-core kernels (w4a16_dot.py, w4a16.py)


@triton.jit
def nibble_exact(word, j: tl.constexpr):
    """Nibble j (0..7) of `word` as the exact fp32 value q in 0..15; `word` is the packed word for
    j <= 4 and the word shifted right by 20 for j >= 5 (so the nibble sits at bits 0..11)."""
    sh: tl.constexpr = 4 * j if j < 5 else 4 * (j - 5)
    bits = (word & (0xF << sh)) | 0x4B000000  # 2^23 + q * 2^sh as fp32
    return bits.to(tl.float32, bitcast=True) * (1.0 / (1 << sh)) - 8388608.0 / (1 << sh)


@triton.jit
def _w4a16_rows_kernel(
    x_ptr, qw_ptr, scales_ptr, biases_ptr, out_ptr, ws_ptr, ticket_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_qw, stride_sg, stride_om,
    num_splits,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WROWS: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    BLOCK_K: tl.constexpr = WROWS * 8
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    # Padding rows read row M - 1: unmasked (masked loads were issued once per column vector).
    x_rows = x_ptr + tl.minimum(offs_m, M - 1)[:, None].to(tl.int64) * stride_xm  # [BLOCK_M, 1]
    w_cols = qw_ptr + offs_n[None, :]  # [1, BLOCK_N]
    w_mask = n_mask[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        # Step base pointers: the offsets below are constants the loads' immediates take.
        x_step = x_rows + k0
        w_step = w_cols + (k0 // 8) * stride_qw  # < 2^31: K / 8 * N words
        g_off = (k0 // GROUP_SIZE) * stride_sg + offs_n
        s = tl.load(scales_ptr + g_off, mask=n_mask, other=0.0).to(tl.float32)
        b = tl.load(biases_ptr + g_off, mask=n_mask, other=0.0).to(tl.float32)
        inner = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        # sum_k x for the bias, from one vector load of the step's x: accumulating the scalar
        # loads below instead made the compiler load each of them a second time.
        x_sum = tl.sum(tl.load(x_step + tl.arange(0, BLOCK_K)[None, :]).to(tl.float32), axis=1)
        # One word row at a time, each nibble an outer product FMA'd into `inner` (no tl.sum).
        for r in tl.static_range(WROWS):
            word = tl.load(w_step + r * stride_qw, mask=w_mask, other=0)
            high = word >> 20  # nibbles 5..7 where nibble_exact's AND-OR reaches them
            for j in tl.static_range(8):
                xj = tl.load(x_step + (8 * r + j)).to(tl.float32)
                if j < 5:
                    q = nibble_exact(word, j)
                else:
                    q = nibble_exact(high, j)
                inner += q * xj
        acc += inner * s[None, :] + x_sum[:, None] * b[None, :]
    store_or_reduce(acc, out_ptr, ws_ptr, ticket_ptr + pid_n, pid_k, offs_m, offs_n, M, N, stride_om,
                    num_splits)


def rows_split(n_blocks: int, k: int, block_k: int, sms: int, tiles: RowsTiles) -> int:
    """K splits so that n_blocks * split programs reach about tiles.waves per SM (bytes in flight
    bound a decode GEMV), keeping at least tiles.min_steps K steps per split."""
    split = 1
    while n_blocks * split * 2 <= tiles.waves * sms and k // (split * 2) >= tiles.min_steps * block_k:
        split *= 2
    return split


@dataclass(frozen=True)
class SplitPlan:
    """How a multi-row GEMV launch covers [K, N]: word rows per K step, column blocks, K splits
    (none empty) and the K range of each (whole steps)."""

    wrows: int
    n_blocks: int
    split: int
    k_per_split: int


def split_plan(n: int, k: int, group_size: int, tiles: RowsTiles, device: torch.device,
               split: int | None = None) -> SplitPlan:
    """The launch plan for tiles on this device; split None: rows_split's choice."""
    wrows = min(tiles.wrows, group_size // 8)
    block_k = wrows * 8
    n_blocks = triton.cdiv(n, tiles.block_n)
    split = split or (1 if tiles.whole_k else rows_split(n_blocks, k, block_k, device_sms(device), tiles))
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    return SplitPlan(wrows, n_blocks, triton.cdiv(k, k_per_split), k_per_split)


def w4a16_rows(x2: torch.Tensor, w: W4Weight, out: torch.Tensor, tiles: RowsTiles | None = None,
               split: int | None = None) -> torch.Tensor:
    """out[M, N] = x2[M, K] @ W for 1..MAX_ROWS rows; x2 already permuted (act-order) and
    row-contiguous, out [M, N] row-contiguous. tiles: the arch table's entry for M rows unless
    given (the sweep passes variants); split: K splits (None: rows_split)."""
    m, k = x2.shape
    n = w.out_features
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"w4a16_rows takes 1..{MAX_ROWS} rows, got {m}")
    t = tiles or rows_tiles(m, x2.device)
    p = split_plan(n, k, w.group_size, t, x2.device, split)
    ws = out if p.split == 1 else torch.empty((p.split, m, n), dtype=torch.float32, device=x2.device)
    tickets = ticket_buffer(x2.device, p.n_blocks)
    _w4a16_rows_kernel[(p.n_blocks, p.split)](
        x2, w.qweight, w.scales, w.biases, out, ws, tickets,
        m, n, k, p.k_per_split,
        x2.stride(0), w.qweight.stride(0), w.scales.stride(0), out.stride(0), p.split,
        GROUP_SIZE=w.group_size, BLOCK_M=next_pow2(m), BLOCK_N=t.block_n, WROWS=p.wrows,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )
    return out
