"""Packed-half W4A16 building blocks: two weights dequantized and multiplied per instruction.

Shared by the half2 GEMV (w4a16_h2.py) and meant for other decode GEMVs over the same packed
layout (w4a16_pack.W4Weight: nibble j of a word holds k = 8r + j), e.g. the MoE expert GEMV.

Nibbles to fp16, two per instruction, exact, with no conversion or fix-up instruction: a nibble
in the low mantissa bits of an fp16 with a zero exponent IS a subnormal, q 2^-24 (bits 0-3) or
q 2^-20 (bits 4-7), so
  word & 0x000F000F          = the fp16 pair (q0, q4) * 2^-24
  word & 0x00F000F0          = (q1, q5) * 2^-20
  (word >> 8) & 0x000F000F   = (q2, q6) * 2^-24,    (word >> 8) & 0x00F000F0 = (q3, q7) * 2^-20
(one shift and four LOP3s per word: eight weights). The powers of two go into the activations,
which prep_x_pairs stores as the fp16 pairs (x_j, x_j+4) * 2^-e * (2^14 for even j, 2^10 odd),
so every product is q x 2^-e 2^-10, and each (q pair, x pair) costs ONE fma.rn.f16x2 per
activation row (no .ftz: subnormal operands are exact, at full rate).

Precision: 2^-e puts max|x| 2^-e in [1, 2) per (row, K step) (exact; undone in fp32 per step,
with the 2^10): products are below 30 * 2^-10 and a K step's sums (<= 64 products per fp16
lane) below 2 -- no overflow for any finite input -- and products round at 2^-11 relative
(below 2^-14, subnormal, at 2^-25 absolute: < 1e-6 of the step's scale). A K step's sum
carries ~sqrt(terms) 2^-11 of its magnitude (~2e-3 worst seen per output row), then goes to
fp32.

NVIDIA builds use PTX for the packed FMAs (tl.inline_asm_elementwise); USE_ASM=False is the
same arithmetic in plain Triton fp16 (the two halves as separate tensors): what TRITON_INTERPRET
(CPU tests) and gfx1100 run, so the CPU tests check the packing order, the pre-scales and the
group math, and the GPU tests the PTX.
"""

from __future__ import annotations

import triton
import triton.language as tl

from homelab_llm.engine.kernels.w4a16_prologue import load_input

X_SCALE_EVEN = tl.constexpr(16384.0)  # 2^14: pairs (q0, q4), (q2, q6) are q 2^-24
X_SCALE_ODD = tl.constexpr(1024.0)  # 2^10: pairs (q1, q5), (q3, q7) are q 2^-20
PRODUCT_UNDO = tl.constexpr(1024.0)  # every product is q x 2^-e 2^-10


@triton.jit
def nibble_pairs(word):
    """The word's nibbles as four packed fp16 pairs (int32 bits, low half first): (q0, q4) 2^-24,
    (q1, q5) 2^-20, (q2, q6) 2^-24, (q3, q7) 2^-20 -- subnormals, exact. Plain integer ops."""
    hi = word >> 8  # the arithmetic shift's sign bits land outside both masks
    return word & 0x000F000F, word & 0x00F000F0, hi & 0x000F000F, hi & 0x00F000F0


@triton.jit
def hfma2(a, b, c):
    """a * b + c on packed fp16 pairs held as int32 bits (one fma.rn.f16x2). PTX only."""
    return tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def half_lo(bits):
    """The low fp16 of a packed pair (int32 bits)."""
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def half_hi(bits):
    """The high fp16 of a packed pair (int32 bits)."""
    return ((bits >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def hmul2(a, b):
    """a * b on packed fp16 pairs held as int32 bits (one mul.rn.f16x2). PTX only."""
    return tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def hadd2(a, b):
    """a + b on packed fp16 pairs held as int32 bits (one add.f16x2; a tl.reduce combiner). PTX only."""
    return tl.inline_asm_elementwise("add.f16x2 $0, $1, $2;", "=r,r,r", [a, b],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def l2_prefetch(ptrs):
    """Ask the L2 for the lines at ptrs (prefetch.global.L2; nothing waits on it). PTX only."""
    tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def tile_dot(words, xp_ptr, USE_ASM: tl.constexpr):
    """sum_k x W-nibbles for one K step, fp32 [BLOCK_M, BLOCK_N]: words [1, WROWS, BLOCK_N] int32
    (one load: every word row's loads issue before any math, and each thread keeps all WROWS rows
    of its columns, so the row sum below stays inside the thread); xp_ptr [BLOCK_M, WROWS, 1]
    pointers to each word row's four activation pairs (int32 bits, prep_x_pairs' layout).
    A (row, word) chains its four pairs in fp16x2, the word rows add in fp16x2, then fp32."""
    return rows_sum(word_products(words, xp_ptr, USE_ASM), 1, USE_ASM)


@triton.jit
def word_products(words, xp_ptr, USE_ASM: tl.constexpr):
    """Each word's four pairs times its activation pairs (xp_ptr broadcast against words), chained
    in fp16x2: packed int32 bits with USE_ASM, else the pair's two halves summed in fp32."""
    p0, p1, p2, p3 = nibble_pairs(words)
    if USE_ASM:
        part = hmul2(p0, tl.load(xp_ptr))
        part = hfma2(p1, tl.load(xp_ptr + 1), part)
        part = hfma2(p2, tl.load(xp_ptr + 2), part)
        return hfma2(p3, tl.load(xp_ptr + 3), part)
    else:
        lo = half_lo(p0) * half_lo(tl.load(xp_ptr))
        hi = half_hi(p0) * half_hi(tl.load(xp_ptr))
        lo += half_lo(p1) * half_lo(tl.load(xp_ptr + 1))
        hi += half_hi(p1) * half_hi(tl.load(xp_ptr + 1))
        lo += half_lo(p2) * half_lo(tl.load(xp_ptr + 2))
        hi += half_hi(p2) * half_hi(tl.load(xp_ptr + 2))
        lo += half_lo(p3) * half_lo(tl.load(xp_ptr + 3))
        hi += half_hi(p3) * half_hi(tl.load(xp_ptr + 3))
        return lo.to(tl.float32) + hi.to(tl.float32)


@triton.jit
def rows_sum(part, axis: tl.constexpr, USE_ASM: tl.constexpr):
    """word_products summed over the word rows' axis, fp32: in fp16x2 then fp32 with USE_ASM."""
    if USE_ASM:
        both = tl.reduce(part, axis, hadd2)
        return half_lo(both).to(tl.float32) + half_hi(both).to(tl.float32)
    else:
        return tl.sum(part, axis=axis)


@triton.jit
def prep_x_pairs(x_ptr, xh_ptr, xg_ptr, M, K, stride_xm, k_start, k_end,
                 res_ptr, nw_ptr, sum_ptr, stride_rm, stride_sm, rstd, sum_limit,
                 SEG: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK_SEGS: tl.constexpr,
                 NORM: tl.constexpr, RESIDUAL: tl.constexpr, ACT_IN: tl.constexpr,
                 normed_ptr, NORM_OUT: tl.constexpr):
    """Activations of k in [k_start, k_end) (whole segments of SEG = one K step) for the half2
    dot, by one program (x in the form w4a16_prologue.load_input gives: NORM with the rows'
    rstd [BLOCK_M], RESIDUAL, ACT_IN; the summed input, and with NORM_OUT the normalized one,
    stored below sum_limit):
      xh [M, K] fp16: x * 2^-e(row, segment) * (2^14 for even j, 2^10 odd), stored so that
         int32 pair 4r + j of a row is (x[8r + j], x[8r + j + 4]) -- the order and powers of
         two nibble_pairs gives the weights;
      xg [2, M, K // SEG] fp32: the segment's sum of x (unscaled), and 2^e * 2^10 (undoes a
         product's scale).
    2^e is the largest power of two <= max|x| over the segment (0 for an all-zero segment), so
    the scaled values lie in (-2, 2). Programs sharing a K range write identical bits (the same
    arithmetic in the same order), so their overlapping stores race harmlessly."""
    CHUNK: tl.constexpr = CHUNK_SEGS * SEG
    for c0 in range(k_start, k_end, CHUNK):
        rows, k, ok = chunk_coords(c0, k_end, M, SEG, BLOCK_M, CHUNK_SEGS)
        x = load_input(x_ptr, res_ptr, nw_ptr, sum_ptr, normed_ptr, rows, k, ok, K,
                       stride_xm, stride_rm, stride_sm, rstd[:, None, None], sum_limit, NORM,
                       RESIDUAL, ACT_IN, NORM_OUT)
        store_x_pairs(x, k, ok, c0, xh_ptr, xg_ptr, M, K, k_end, SEG, BLOCK_M, CHUNK_SEGS)


@triton.jit
def chunk_coords(c0, k_end, M, SEG: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK_SEGS: tl.constexpr):
    """One prep_x_pairs chunk's rows [BLOCK_M, 1, 1] (int64), k [1, CHUNK_SEGS, SEG] from c0 and
    mask (rows < M, k < k_end)."""
    offs_m = tl.arange(0, BLOCK_M)[:, None, None]
    k = c0 + tl.arange(0, CHUNK_SEGS)[None, :, None] * SEG + tl.arange(0, SEG)[None, None, :]
    return offs_m.to(tl.int64), k, (offs_m < M) & (k < k_end)


@triton.jit
def store_x_pairs(x, k, ok, c0, xh_ptr, xg_ptr, M, K, k_end, SEG: tl.constexpr,
                  BLOCK_M: tl.constexpr, CHUNK_SEGS: tl.constexpr):
    """One chunk's input values x (fp32, at chunk_coords' k) into prep_x_pairs' xh and xg. The
    values are put in their slot order first (a permute of each 8), so the stores are
    contiguous and vectorize: stored slot by slot, 2 bytes at a time, a whole-K program's 4096
    values took its prologue 5-15 us on the H200 (docs/BENCHMARKS.md 34)."""
    n_segs = K // SEG
    offs_m = tl.arange(0, BLOCK_M)[:, None, None]
    m2 = tl.arange(0, BLOCK_M)[:, None]
    amax = tl.max(tl.abs(x), axis=2)  # [BLOCK_M, CHUNK_SEGS]
    expo = amax.to(tl.int32, bitcast=True) & 0x7F800000
    undo = expo.to(tl.float32, bitcast=True)  # 2^floor(log2 amax); 0 when amax is 0/subnormal
    inv = (0x7F000000 - expo).to(tl.float32, bitcast=True)  # 2^-floor(log2 amax), exact
    # nibble_pairs' powers of two: pairs j = k % 4 even take 2^14, odd 2^10 (exact)
    xs = (x * inv[:, :, None] * tl.where((k & 1) == 0, X_SCALE_EVEN, X_SCALE_ODD)).to(tl.float16)
    # k = 8r + j + 4h (j < 4, h 0/1) goes to fp16 slot 8r + 2j + h: int32 pair 4r + j. The
    # permute moves x[8r + 4h + j] from position 8r + 4h + j to 8r + 2j + h, its slot, so each
    # value is stored at the k of its position (chunks start at multiples of 8)
    xs = tl.reshape(tl.permute(tl.reshape(xs, [BLOCK_M, CHUNK_SEGS, SEG // 8, 2, 4]),
                               [0, 1, 2, 4, 3]), [BLOCK_M, CHUNK_SEGS, SEG])
    tl.store(xh_ptr + offs_m.to(tl.int64) * K + k, xs, mask=ok)
    seg = (c0 // SEG + tl.arange(0, CHUNK_SEGS))[None, :]
    s_ok = (m2 < M) & (seg < k_end // SEG)
    s_offs = m2 * n_segs + seg
    tl.store(xg_ptr + s_offs, tl.sum(x, axis=2), mask=s_ok)
    tl.store(xg_ptr + M * n_segs + s_offs, undo * PRODUCT_UNDO, mask=s_ok)
