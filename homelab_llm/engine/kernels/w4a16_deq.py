"""W4A16 for many rows (prefill chunks): dequantize the weight once, then the vendor BLAS GEMM.

At a few hundred rows and more a W4A16 matmul is bound by math, not by reading the weight, and
the vendor GEMM (cuBLAS / hipBLASLt) runs bf16 math far closer to the tensor cores' rate than a
Triton kernel that must also unpack nibbles inside its K loop (w4a16.py's GEMM expands each
word to eight K rows: on an H200 a 27B model's linears at 2,048 rows took 420 ms there against
126 ms for bf16 weights). Here one memory-bound kernel writes the dequantized [K, N] weight
(2 bytes a weight, into a scratch tensor the caching allocator hands back every call: the
engine's activation profile counts it), then `torch.matmul` runs at the BLAS rate. The extra
traffic, 0.5 byte read + 2 written + 2 read again per weight, is a few milliseconds per forward
for a 27B model: small next to the math of hundreds of rows, too much for a few rows (those go
to the GEMV / few-row kernels, tuning.W4A16_ROUTES).

Each program dequantizes a [BLOCK_R, BLOCK_N] tile of packed words (8 * BLOCK_R rows of K):
nibble j of word row r is k = 8 r + j, one group of scales and biases per word row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.w4a16_pack import W4Weight

BLOCK_R = 16  # word rows a program (128 rows of K)
BLOCK_N = 128  # columns a program (16-byte vectors along N)
MAX_SCRATCH_BYTES = 1 << 29  # a larger weight (a big vocabulary's lm_head) keeps the GEMM kernel


@triton.jit
def _dequant_w4_kernel(qw_ptr, scales_ptr, biases_ptr, out_ptr, K, N,
                       stride_qw, stride_sg, stride_o,
                       GROUP_SIZE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    word_rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (word_rows * 8 < K)[:, None] & (cols < N)[None, :]
    packed = tl.load(qw_ptr + word_rows[:, None].to(tl.int64) * stride_qw + cols[None, :], mask=mask, other=0)
    g_off = ((word_rows * 8) // GROUP_SIZE)[:, None] * stride_sg + cols[None, :]
    s = tl.load(scales_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(biases_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
    out_rows = out_ptr + (word_rows * 8)[:, None].to(tl.int64) * stride_o + cols[None, :]
    for j in tl.static_range(8):
        q = ((packed >> (4 * j)) & 0xF).to(tl.float32)
        tl.store(out_rows + j * stride_o, (q * s + b).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_w4(w: W4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The [K, N] weight in `dtype` (kernel input order: act-order permuted like x must be)."""
    k, n = w.in_features, w.out_features
    out = torch.empty((k, n), dtype=dtype, device=w.qweight.device)
    grid = (triton.cdiv(triton.cdiv(k, 8), BLOCK_R), triton.cdiv(n, BLOCK_N))
    _dequant_w4_kernel[grid](w.qweight, w.scales, w.biases, out, k, n,
                             w.qweight.stride(0), w.scales.stride(0), out.stride(0),
                             GROUP_SIZE=w.group_size, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N, num_warps=4)
    return out


def fits_scratch(w: W4Weight, dtype: torch.dtype) -> bool:
    """Whether this weight's dequantized copy stays within the scratch cap."""
    return w.in_features * w.out_features * dtype.itemsize <= MAX_SCRATCH_BYTES


def w4a16_deq_matmul(x2: torch.Tensor, w: W4Weight, out: torch.Tensor) -> torch.Tensor:
    """out[M, N] = x2[M, K] @ W through a dequantized copy of W; x2 already permuted."""
    return torch.matmul(x2, dequantize_w4(w, x2.dtype), out=out)
