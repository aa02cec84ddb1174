"""Packed-half W4A16 building blocks: two weights dequantized and multiplied per instruction.

Shared by the half2 GEMV (w4a16_h2.py) and meant for other decode GEMVs over the same packed
layout (w4a16_pack.W4Weight: nibble j of a word holds k = 8r + j), e.g. the MoE expert GEMV.

Nibbles to fp16, two per instruction, exact, no conversion instruction:
  (word >> 8i) & 0x000F000F | 0x64006400  = the fp16 pair (1024 + q_4i', 1024 + q_4i'+4)  (i' = 2i)
  (word >> 8i) & 0x00F000F0 | 0x64006400  = (1024 + 16 q, 1024 + 16 q) for nibbles 2i+1, 2i+5
(fp16 has ulp 1 on [1024, 2048)), then one sub.f16x2 (- 1024) or fma.f16x2 (* 1/16 - 64) gives q
exactly. So a word's eight weights are the four fp16 pairs (q_j, q_j+4), j = 0..3, in one shift,
four LOP3s and four packed fixes; each pair then costs ONE fma.rn.f16x2 per activation row
against the activation pair (x_j, x_j+4) packed the same way (prep_x_pairs writes them).

Precision: products and the running sums are fp16, so activations are pre-scaled per (row,
K step) by a power of two 2^-e with max|x| 2^-e in [1, 2) (exact; undone in fp32 per step):
|q x| < 30, and a sum of at most 64 such products per fp16 lane (a K step of <= 128 k) stays
below 2^11 -- no overflow for any finite bf16 input. Rounding: each product and partial sum
rounds at 2^-11 relative, so a K step's sum carries ~sqrt(32) 2^-11 of its magnitude (~3e-3
worst seen per output row at 1 K step; it averages down over steps), then moves to fp32.

NVIDIA builds use PTX (tl.inline_asm_elementwise); USE_ASM=False is the same arithmetic in
plain Triton fp16 (the two halves as separate tensors): what TRITON_INTERPRET (CPU tests) and
gfx1100 run, so the CPU tests check packing order, pre-scale and group math, and the GPU tests
the PTX.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Four (q_j, q_j+4) fp16 pairs from one word: shift once, four LOP3 (a & b | c = 0xEA), and the
# fixes: low nibbles - 1024, high nibbles (1024 + 16 q) * 1/16 - 64.
PAIRS_ASM = tl.constexpr("""{
.reg .b32 t, m, h, s, c;
mov.b32 m, 0x64006400;
mov.b32 h, 0x2C002C00;
mov.b32 c, 0xD400D400;
shr.u32 t, $4, 8;
lop3.b32 $0, $4, 0x000F000F, m, 0xEA;
lop3.b32 $1, $4, 0x00F000F0, m, 0xEA;
lop3.b32 $2, t, 0x000F000F, m, 0xEA;
lop3.b32 $3, t, 0x00F000F0, m, 0xEA;
sub.f16x2 $0, $0, m;
fma.rn.f16x2 $1, $1, h, c;
sub.f16x2 $2, $2, m;
fma.rn.f16x2 $3, $3, h, c;
}""")


@triton.jit
def pairs_h2(word):
    """The word's nibbles as four packed fp16 pairs (int32 bits): (q0, q4), (q1, q5), (q2, q6),
    (q3, q7) -- low half first. PTX only (NVIDIA)."""
    return tl.inline_asm_elementwise(PAIRS_ASM, "=r,=r,=r,=r,r", [word],
                                     dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


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
def pair_f16(word, j: tl.constexpr):
    """Plain-Triton twin of pairs_h2's pair j: (q_j, q_j+4) as two fp16 tensors, the same
    magic-number arithmetic (exact), one half at a time."""
    sh: tl.constexpr = 8 * (j // 2)
    if j % 2 == 0:
        bits = ((word >> sh) & 0x000F000F) | 0x64006400
        return half_lo(bits) - 1024.0, half_hi(bits) - 1024.0
    else:
        bits = ((word >> sh) & 0x00F000F0) | 0x64006400
        return half_lo(bits) * 0.0625 - 64.0, half_hi(bits) * 0.0625 - 64.0


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
def tile_dot(words, xp_ptr, USE_ASM: tl.constexpr):
    """sum_k x W-nibbles for one K step, fp32 [BLOCK_M, BLOCK_N]: words [1, WROWS, BLOCK_N] int32
    (one load: every word row's loads issue before any math, and each thread keeps all WROWS rows
    of its columns, so the row sum below stays inside the thread); xp_ptr [BLOCK_M, WROWS, 1]
    pointers to each word row's four activation pairs (int32 bits, prep_x_pairs' layout).
    A (row, word) chains its four pairs in fp16x2, the word rows add in fp16x2, then fp32."""
    if USE_ASM:
        p0, p1, p2, p3 = pairs_h2(words)
        part = hmul2(p0, tl.load(xp_ptr))
        part = hfma2(p1, tl.load(xp_ptr + 1), part)
        part = hfma2(p2, tl.load(xp_ptr + 2), part)
        part = hfma2(p3, tl.load(xp_ptr + 3), part)
        both = tl.reduce(part, 1, hadd2)
        return half_lo(both).to(tl.float32) + half_hi(both).to(tl.float32)
    else:
        lo = tl.zeros([xp_ptr.shape[0], words.shape[1], words.shape[2]], tl.float16)
        hi = tl.zeros([xp_ptr.shape[0], words.shape[1], words.shape[2]], tl.float16)
        for j in tl.static_range(4):
            xp = tl.load(xp_ptr + j)
            q_lo, q_hi = pair_f16(words, j)
            lo += q_lo * half_lo(xp)
            hi += q_hi * half_hi(xp)
        return tl.sum(lo.to(tl.float32) + hi.to(tl.float32), axis=1)


@triton.jit
def prep_x_pairs(x_ptr, xh_ptr, xg_ptr, M, K, stride_xm, k_start, k_end,
                 SEG: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK_SEGS: tl.constexpr):
    """Activations of k in [k_start, k_end) (whole segments of SEG = one K step) for the half2
    dot, by one program:
      xh [M, K] fp16: x * 2^-e(row, segment), stored so that int32 pair 4r + j of a row is
         (x[8r + j], x[8r + j + 4]) -- the order pairs_h2 produces the weights in;
      xg [2, M, K // SEG] fp32: the segment's sum of x (unscaled), and 2^e.
    2^e is the largest power of two <= max|x| over the segment (0 for an all-zero segment), so
    the scaled values lie in (-2, 2). Programs sharing a K range write identical bits (the same
    arithmetic in the same order), so their overlapping stores race harmlessly."""
    CHUNK: tl.constexpr = CHUNK_SEGS * SEG
    n_segs = K // SEG
    offs_m = tl.arange(0, BLOCK_M)[:, None, None]
    offs_s = tl.arange(0, CHUNK_SEGS)[None, :, None]
    offs_e = tl.arange(0, SEG)[None, None, :]
    m_ok = offs_m < M
    m2 = tl.arange(0, BLOCK_M)[:, None]
    for c0 in range(k_start, k_end, CHUNK):
        k = c0 + offs_s * SEG + offs_e  # [1, CHUNK_SEGS, SEG]
        ok = m_ok & (k < k_end)
        x = tl.load(x_ptr + offs_m.to(tl.int64) * stride_xm + k, mask=ok, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=2)  # [BLOCK_M, CHUNK_SEGS]
        expo = amax.to(tl.int32, bitcast=True) & 0x7F800000
        undo = expo.to(tl.float32, bitcast=True)  # 2^floor(log2 amax); 0 when amax is 0/subnormal
        inv = (0x7F000000 - expo).to(tl.float32, bitcast=True)  # 2^-floor(log2 amax), exact
        xs = (x * inv[:, :, None]).to(tl.float16)
        # k = 8r + j + 4h (j < 4, h 0/1) goes to fp16 slot 8r + 2j + h: int32 pair 4r + j.
        dest = (k & ~7) + 2 * (k & 3) + ((k >> 2) & 1)
        tl.store(xh_ptr + offs_m.to(tl.int64) * K + dest, xs, mask=ok)
        seg = (c0 // SEG + tl.arange(0, CHUNK_SEGS))[None, :]
        s_ok = (m2 < M) & (seg < k_end // SEG)
        s_offs = m2 * n_segs + seg
        tl.store(xg_ptr + s_offs, tl.sum(x, axis=2), mask=s_ok)
        tl.store(xg_ptr + M * n_segs + s_offs, undo, mask=s_ok)
