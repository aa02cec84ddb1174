"""A packed-word tile's nibbles as K rows, for tl.dot kernels that dequantize in registers.

Our int4 layout (w4a16_pack.py) packs eight consecutive K rows of a column into one int32 word:
nibble j of word row r is k = 8 r + j. A tile of BLOCK_K rows is BLOCK_K / 8 word rows. Loading
the words once and unpacking them here moves 0.5 byte a weight through the loads (and through
shared memory where the compiler pipelines them) instead of the 4 bytes a weight of loading each
K row's word (eight rows asking for the same address). BENCHMARKS 29.1: the fused MoE's 4-bit
prefill layer 1.02 -> 0.93 ms at the same tiles, w4a16.py's GEMM 10-18% faster.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_k_words(ptr, k0, stride_k, offs_n, n_mask, BLOCK_K: tl.constexpr):
    """The [BLOCK_K // 8, N] words holding K rows k0 .. k0 + BLOCK_K - 1 of columns offs_n (k0 a
    multiple of 8; ptr the weight's first word row, stride_k between word rows)."""
    first = ptr + tl.cast(k0 // 8, tl.int64) * stride_k  # 64-bit once; 32-bit offsets in the tile
    return tl.load(first + tl.arange(0, BLOCK_K // 8)[:, None] * stride_k + offs_n[None, :],
                   mask=n_mask[None, :], other=0)


@triton.jit
def k_rows(words):
    """words [R, N] int32 -> the nibbles [8 R, N] (0..15, int32), row 8 r + j from nibble j."""
    shifts = (tl.arange(0, 8) * 4)[None, :, None]
    nibbles = (words[:, None, :] >> shifts) & 0xF
    return tl.reshape(nibbles, (8 * words.shape[0], words.shape[1]))


@triton.jit
def k_rows_f32(words):
    """k_rows as exact fp32 values with no int-to-float conversion instruction: the nibble ORed
    into the low mantissa bits of 2^23 is the float 2^23 + q, and one subtraction leaves q.
    w4a16.py's GEMM takes it (BENCHMARKS 29.1: 2-3% ahead of k_rows plus a conversion there;
    the fused MoE's GEMM is 4% behind with it, so keeps the conversion)."""
    bits = k_rows(words) | 0x4B000000
    return bits.to(tl.float32, bitcast=True) - 8388608.0
