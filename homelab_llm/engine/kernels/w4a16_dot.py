"""W4A16 for a few rows (decode at batch 2-64): dequantize each packed word once, feed tensor cores.

The GEMM kernel (w4a16.py) unpacks a [BLOCK_K / 8, BLOCK_N] tile of words into one
[BLOCK_K, BLOCK_N] operand through a layout shuffle and stores it to shared memory for the MMA
every step. Here a K step is WROWS word rows (8 * WROWS values of
k): the [WROWS, BLOCK_N] words are loaded once (16-byte vectors along N), and nibble j of every
word is the [WROWS, BLOCK_N] slice k = 8r + j. So the step is eight tensor-core dots

    acc[m, n] += sum_r x[m, 8r + j] * (q_j[r, n] * scale[g(r), n] + bias[g(r), n]),   j = 0..7

with x read as eight stride-8 slices (tiny, cached) and fp32 accumulation. Nibbles become floats
with the GEMV's AND-OR trick (no int->float conversion instruction: those run at a quarter of
the FMA rate and would bound a kernel that must dequantize at the copy rate). Dequantizing a tile is
shared by all BLOCK_M rows, which is what makes batch 8 cost little more than batch 1. A K step
may span several groups (group 32 with WROWS 16): scales are then loaded per word row; when one
group covers the step they are loaded once per step.

When one group covers the step the dots take the nibbles without any float arithmetic: one
AND-OR turns nibbles j and j + 4 of a word into the bf16 pair (128 + q_j, 128 + q_j+4) (fp16:
1024 + q, for fp16 activations), exact, so a weight costs ~1 integer instruction instead of ~3.5.
The dots then sum x (128 + q) in fp32 (bf16 products are exact in fp32), and the step applies
W = q s + b as acc += (inner - 128 sum x) s + (sum x) b (the left loop below: acc += inner s +
(sum x)(b - 128 s), two FMAs an element); the cancellation costs ~7 bits of the fp32 sum's 24
(the offset is ~17x the mean nibble), far below the bf16 output's rounding.

With the weights as the dot's LEFT operand instead (w_left, W4A16_ROUTES "dotL": sm_90 from 3
rows): out^T = W^T x^T, four dots a K step, one per nibble pair (j, j + 4). A word masked with
0x000F000F after a shift of 4j IS one register of the left operand (two 16-bit values of
k-adjacent columns, here k = 8r + j and 8r + j + 4), so the AND-OR result goes to the tensor
cores as is, with no byte permutes and no shared-memory staging of the dequantized tile; x, one
[BLOCK_M, BLOCK_K] tile a step, is split in registers into the matching column order. On sm_90
that is a wgmma with the weights in registers (BLOCK_N its M) and the rows its N (16 at up to 16
rows). BENCHMARKS 20.1: 8B step linears at 8 rows 3.48 ms against the eight-dot loop's 4.03 (and
an older left-operand loop that joined all eight slices into one tile through shared memory,
4.98).

The offset form's per-step epilogue and sum of x grow with the rows (a thread applies s and b
to 32 output elements a step at 64 rows, 8 at 16); GemmTiles.scaled forms the weights themselves
in the left operand's registers instead, (q - z) s + r by two packed FMAs a register (z the
group's zero point, r what is left of its bias: scaled_terms), each weight rounded once as a
dequantize-then-GEMM route rounds it, the scale rounded to the activations' type as Marlin-style
kernels take it; the dots' sum is then the step's product. sm_90 takes it at 17-64 rows
(BENCHMARKS 27.4: the 8B's and the 27B's step linears at 17-64 rows 9-14% faster); at 3-16 rows
(16-row programs, a quarter of the output elements a thread) the two FMAs a register cost more
than they save. Weights whose zero points are integers (W4Weight.int_zeros: GPTQ, AWQ,
AutoRound, symmetric, Q4_0) take a third form, GemmTiles.int_zeros: the registers hold q - z,
exact (one packed add a register), and the step applies s in fp32 (one FMA an output element):
no sum of x and no rounded weights. sm_90 takes it at every row count for those weights
(BENCHMARKS 28.1: as fast as the other two, within 1%, and exact: ~5e-8 a row against the
scaled form's ~2e-3); GGUF Q4_1 / Q4_K mins keep the offset and scaled forms.

Thin outputs split K across programs with the GEMV's deterministic ticket epilogue
(w4a16_gemv.store_or_reduce): no second kernel, replays inside CUDA/HIP graphs.

A call of one row block (every call on sm_90) reads each weight once, so both loops load the
words, scales and biases evict_first (EVICT_FIRST; as w4a16_h2.py does; BENCHMARKS 32.2); the MoE
prefill GEMM (fused_moe.py), whose row blocks reread an expert's weights, keeps the default. The
switch is a bool: Triton 3.6 fails to compile a call of a jit helper that leaves a string
constexpr parameter at its default (tests/engine/kernels/test_jit_defaults.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.common import dot_in_fp32, next_pow2
from homelab_llm.engine.kernels.launch_fit import balance_split, resident_per_sm
from homelab_llm.engine.kernels.pair_order import pair_order
from homelab_llm.engine.kernels.pdl import pdl_args, pdl_enter, pdl_late
from homelab_llm.engine.kernels.tuning import GemmTiles, device_sms, dot_left_tiles, tiles_for, uses_ptx
from homelab_llm.engine.kernels.w4a16_epilogue import DotChain, act_columns, finish_tile
from homelab_llm.engine.kernels.w4a16_gemv import nibble_f32, pick_split, ticket_buffer, unscale_pow2
from homelab_llm.engine.kernels.w4a16_pack import W4Weight


@triton.jit
def nibble_pair(packed, j: tl.constexpr, X_F16: tl.constexpr):
    """Nibbles j and j + 4 (j < 4) of every word as OFFSET + q in the activations' float type,
    two per AND-OR: the nibble lands in the low mantissa bits of 128 (bf16: ulp 1 there) or
    1024 (fp16), so the value is exact and no conversion instruction runs."""
    return pair_halves(pair_bits(packed >> (4 * j), packed, 0, X_F16), X_F16)


@triton.jit
def pair_halves(pair, X_F16: tl.constexpr):
    """pair_bits' 32 bits as their two 16-bit halves in the activations' float type."""
    fdt: tl.constexpr = tl.float16 if X_F16 else tl.bfloat16
    return pair.to(tl.int16).to(fdt, bitcast=True), (pair >> 16).to(tl.int16).to(fdt, bitcast=True)


@triton.jit
def pair_bits(packed, prev, j: tl.constexpr, X_F16: tl.constexpr, USE_ASM: tl.constexpr = False):
    """nibble_pair's 32 bits (nibbles j and j + 4 of each word as OFFSET + q in the two 16-bit
    halves) with one immediate an instruction: pair 0 ORs the magic number in, and pair j > 0
    takes those bits from pair j - 1 (prev & ~mask: a bitwise select, one LOP3). With two
    constants in one AND-OR, sm_90's compiler rematerializes the second into a register for
    every word (a move per pair: 32 of the left loop's 366 instructions a step)."""
    if j == 0:
        magic: tl.constexpr = 0x64006400 if X_F16 else 0x43004300
        return (packed & 0x000F000F) | magic
    if USE_ASM:  # LLVM folds the plain form's prev & ~mask back to the constant
        return tl.inline_asm_elementwise("lop3.b32 $0, $1, 983055, $2, 0xE2;", "=r,r,r",
                                         [packed >> (4 * j), prev], dtype=tl.int32, is_pure=True, pack=1)
    return ((packed >> (4 * j)) & 0x000F000F) | (prev & -0x000F0010)  # -0x000F0010 = ~0x000F000F


@triton.jit
def pair_tile(pair, X_F16: tl.constexpr):
    """pair_bits' words [BLOCK_N, WROWS] as ONE [BLOCK_N, 2 WROWS] dot operand (OFFSET + q):
    column 2r + h is nibble j + 4h of word row r. A word's masked pair is already the two 16-bit
    values of k-adjacent columns that the MMA's left operand holds in one register, so the
    compiler feeds the AND-OR result to the tensor cores as is: no byte permutes, no
    shared-memory staging of the dequantized tile."""
    lo, hi = pair_halves(pair, X_F16)
    return tl.reshape(tl.join(lo, hi), [lo.shape[0], 2 * lo.shape[1]])


@triton.jit
def half_bits(v, X_F16: tl.constexpr):
    """fp32 v rounded to nearest (ties to even) in the activations' 16-bit type, as the low 16
    bits of an int32. bf16 by integer rounding of the fp32 bits: Triton's interpreter truncates
    an fp32 -> bf16 conversion, whose error the scaled form would then carry in every weight."""
    if X_F16:
        return v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    bits = v.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


@triton.jit
def pair_both(v, X_F16: tl.constexpr, USE_ASM: tl.constexpr):
    """fp32 v rounded to nearest in the activations' 16-bit type, as int32 bits holding it twice
    (both halves of a packed pair): one cvt on NVIDIA, half_bits elsewhere."""
    if USE_ASM:
        op: tl.constexpr = "cvt.rn.f16x2.f32 $0, $1, $1;" if X_F16 else "cvt.rn.bf16x2.f32 $0, $1, $1;"
        both = tl.inline_asm_elementwise(op, "=r,r", [v], dtype=tl.int32, is_pure=True, pack=1)
    else:
        bits = half_bits(v, X_F16)
        both = bits | (bits << 16)
    return both


@triton.jit
def zero_point(sf, bf, USE_ASM: tl.constexpr = False):
    """z = round(-b / s) of fp32 scales and biases, clamped to [-64, 127] so OFFSET + z stays
    exact in 16 bits (masked-off columns: s = 0, z = 0). USE_ASM (NVIDIA): -b times the
    approximate reciprocal (rcp.approx, 1 ulp), not a full division, whose range fix-ups
    were ~14 of the left loop's instructions a step; the quotient is rounded to an integer, so
    an error of 1 ulp changes z only where -b / s is within ~1e-7 of a half (never for integer
    zero points, whose quotient is z within the bias's own rounding)."""
    d = tl.where(sf == 0.0, 1.0, sf)
    if USE_ASM:
        inv = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [d], dtype=tl.float32,
                                        is_pure=True, pack=1)
        z = -bf * inv
    else:
        z = -bf / d
    return tl.minimum(tl.maximum(tl.floor(z + 0.5), -64.0), 127.0)


@triton.jit
def scaled_terms(scale, bias, X_F16: tl.constexpr, USE_ASM: tl.constexpr):
    """The scaled form's packed [BLOCK_N, 1] operands for a step's group: s, -(OFFSET + z) and
    r, with z = zero_point (an integer for GPTQ / AWQ / AutoRound weights, 8 for symmetric ones)
    and r = b + z s what is left of the bias (0 for integer zero points). The weight is then
    (q - z) s + r: q - z exact, so rounding s to the activations' type errs by its 2^-9 times
    q - z, not times q as in q s + b (whose b would cancel the large part)."""
    OFFSET: tl.constexpr = 1024.0 if X_F16 else 128.0
    sf = scale.to(tl.float32)
    bf = bias.to(tl.float32)
    z = zero_point(sf, bf, USE_ASM)
    return (pair_both(sf, X_F16, USE_ASM)[:, None], pair_both(-OFFSET - z, X_F16, USE_ASM)[:, None],
            pair_both(bf + z * sf, X_F16, USE_ASM)[:, None])


@triton.jit
def zero_terms(scale, bias, X_F16: tl.constexpr, USE_ASM: tl.constexpr):
    """The integer-zero form's [BLOCK_N, 1] operands for a step's group: s in fp32 (the
    epilogue's) and -(OFFSET + z) packed (the registers'). Only for weights whose biases are
    exactly -z s (W4Weight.int_zeros), so q - z times s is the weight, with no rounding."""
    OFFSET: tl.constexpr = 1024.0 if X_F16 else 128.0
    sf = scale.to(tl.float32)
    z = zero_point(sf, bias.to(tl.float32), USE_ASM)
    return sf[:, None], pair_both(-OFFSET - z, X_F16, USE_ASM)[:, None]


@triton.jit
def packed_fma(a, b, c, X_F16: tl.constexpr):
    """a * b + c on int32 words holding two fp16 / bf16 values each, one PTX instruction (NVIDIA
    only: PTX takes no immediates for these, so constants go in as registers)."""
    op: tl.constexpr = "fma.rn.f16x2 $0, $1, $2, $3;" if X_F16 else "fma.rn.bf16x2 $0, $1, $2, $3;"
    return tl.inline_asm_elementwise(op, "=r,r,r,r", [a, tl.broadcast_to(b, a.shape), tl.broadcast_to(c, a.shape)],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def zero_shifted(pair, c, X_F16: tl.constexpr, USE_ASM: tl.constexpr):
    """q - z = (OFFSET + q) * 1 + c, c = -(OFFSET + z) packed: exact (small integers), one
    packed FMA a register (ptxas makes it an HADD2)."""
    if USE_ASM:
        w = packed_fma(pair, tl.full(pair.shape, 0x3C003C00 if X_F16 else 0x3F803F80, tl.int32), c, X_F16)
    else:
        lo, hi = pair_halves(pair, X_F16)
        cf = pair_halves(c, X_F16)[0].to(tl.float32)
        w = half_bits(lo.to(tl.float32) + cf, X_F16) | (half_bits(hi.to(tl.float32) + cf, X_F16) << 16)
    return w


@triton.jit
def left_weights(pair, s, c, r, SCALED: tl.constexpr, IZERO: tl.constexpr, X_F16: tl.constexpr,
                 USE_ASM: tl.constexpr):
    """The left operand's registers for one nibble pair: pair_bits' words as they are (OFFSET +
    q; the offset form's epilogue applies s and b); with IZERO q - z (zero_shifted; the epilogue
    applies s); with SCALED the weights themselves from scaled_terms' packed s, c = -(OFFSET +
    z) and r: q - z, then (q - z) s + r rounded once to the activations' type; two packed FMAs
    a register."""
    w = pair
    if SCALED or IZERO:
        w = zero_shifted(pair, c, X_F16, USE_ASM)
    if SCALED:
        if USE_ASM:
            w = packed_fma(w, s, r, X_F16)
        else:  # the same arithmetic in fp32 ((q - z) s is exact there), one rounding
            lo, hi = pair_halves(w, X_F16)
            sf = pair_halves(s, X_F16)[0].to(tl.float32)
            rf = pair_halves(r, X_F16)[0].to(tl.float32)
            w = half_bits(lo.to(tl.float32) * sf + rf, X_F16) | (half_bits(hi.to(tl.float32) * sf + rf, X_F16) << 16)
    return w


@triton.jit
def x_pair_slices(xt, WROWS: tl.constexpr):
    """A K step's activations [BLOCK_M, 8 WROWS] (k = 8r + j, natural order) as the four
    [BLOCK_M, 2 WROWS] operands pair_tile's tiles pair with: slice j holds column 2r + h =
    x[:, 8r + j + 4h]. Split in registers, one tile a step."""
    bm: tl.constexpr = xt.shape[0]
    x5 = tl.reshape(xt, [bm, WROWS, 2, 2, 2])  # [m, r, h, j & 2, j & 1]: each split takes the last
    even, odd = tl.split(x5)  # j & 1
    s0, s2 = tl.split(even)  # j & 2, leaving [m, r, h]
    s1, s3 = tl.split(odd)
    return (tl.reshape(s0, [bm, 2 * WROWS]), tl.reshape(s1, [bm, 2 * WROWS]),
            tl.reshape(s2, [bm, 2 * WROWS]), tl.reshape(s3, [bm, 2 * WROWS]))


@triton.jit
def pair_left_dot(acc, xs, pair, X_F16: tl.constexpr, DOT_F32: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] + one nibble pair's dot (pair: pair_bits' words), weights on the
    left: W_j^T xs^T."""
    w = pair_tile(pair, X_F16)
    if DOT_F32:
        return acc + tl.dot(w.to(tl.float32), tl.trans(xs).to(tl.float32))
    return tl.dot(w, tl.trans(xs), acc)


@triton.jit
def joined_tile(w0, w1, w2, w3, X_F16: tl.constexpr):
    """The four nibble pairs' left-operand registers (left_weights' words [BLOCK_N, WROWS]) as
    ONE [BLOCK_N, 8 WROWS] operand, pair j's tile (pair_tile) at columns [2 WROWS j, 2 WROWS (j +
    1)): the order of a K step of x in pair order. Each register stays where it is (the
    permute and reshape only rename them), so the joined dot needs no data movement."""
    t = tl.join(tl.join(tl.join(*pair_halves(w0, X_F16)), tl.join(*pair_halves(w1, X_F16))),
                tl.join(tl.join(*pair_halves(w2, X_F16)), tl.join(*pair_halves(w3, X_F16))))
    return tl.reshape(tl.permute(t, (0, 4, 3, 1, 2)), [w0.shape[0], 8 * w0.shape[1]])


@triton.jit
def scaled_pairs(packed, s, c, r, X_F16: tl.constexpr, USE_ASM: tl.constexpr):
    """The scaled form's left-operand registers (left_weights from scaled_terms' s, c and r) of
    a step's four nibble pairs."""
    pair = pair_bits(packed, packed, 0, X_F16)
    w0 = left_weights(pair, s, c, r, True, False, X_F16, USE_ASM)
    pair = pair_bits(packed, pair, 1, X_F16, USE_ASM)
    w1 = left_weights(pair, s, c, r, True, False, X_F16, USE_ASM)
    pair = pair_bits(packed, pair, 2, X_F16, USE_ASM)
    w2 = left_weights(pair, s, c, r, True, False, X_F16, USE_ASM)
    pair = pair_bits(packed, pair, 3, X_F16, USE_ASM)
    return w0, w1, w2, left_weights(pair, s, c, r, True, False, X_F16, USE_ASM)


@triton.jit
def dot_step(acc, x_rows, k0, word_rows, j: tl.constexpr, m_mask, r_mask, w, X_PERM: tl.constexpr,
             DOT_F32: tl.constexpr):
    """acc + x[:, 8 r + j] @ w for the step's word rows r (w: nibble j's [WROWS, BLOCK_N] tile).
    X_PERM: x was permuted per K step (permute_steps), so the slice is contiguous."""
    if X_PERM:
        cols = k0 + j * word_rows.shape[0] + (word_rows - k0 // 8)  # slice j: k0 + WROWS j + r
    else:
        cols = word_rows * 8 + j
    xj = tl.load(x_rows + cols[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0)
    if DOT_F32:
        return acc + tl.dot(xj.to(tl.float32), w.to(tl.float32))
    return acc + tl.dot(xj, w.to(xj.dtype))


@triton.jit
def _w4a16_dot_kernel(
    x_ptr, qw_ptr, scales_ptr, biases_ptr, out_ptr, ws_ptr, ticket_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_qw, stride_sg, stride_om, num_splits,
    res_ptr, nw_ptr, sum_ptr, y_ptr, parts_ptr, rstd_ptr, rstd_in_ptr, act_half, eps, stride_rm, stride_ym,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WROWS: tl.constexpr,
    X_PERM: tl.constexpr, DOT_F32: tl.constexpr, W_LEFT: tl.constexpr = False,
    USE_ASM: tl.constexpr = False, PDL: tl.constexpr = False, SCALED: tl.constexpr = False,
    IZERO: tl.constexpr = False, EVICT_FIRST: tl.constexpr = False, PAIR_ACCS: tl.constexpr = False,
    X_PAIRS: tl.constexpr = False, JOINED: tl.constexpr = False, EPI: tl.constexpr = 0,
    ACT: tl.constexpr = 1, NORM_IN: tl.constexpr = False, OUT_PAIRS: tl.constexpr = 0,
    PARTS_BLOCK: tl.constexpr = 1,
):
    """out = x W (w4a16_dot); EPI, ACT, NORM_IN, OUT_PAIRS: the chained epilogues
    (w4a16_epilogue.py: the norm and act-and-mul around the linear; their pointers None unless
    used); PARTS_BLOCK: the column blocks (NORM_OUT's partial sums a row) rounded up to a power
    of two."""
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    X_F16: tl.constexpr = x_ptr.dtype.element_ty == tl.float16
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if EPI == 2:  # ACT_OUT: half gate, half up columns, act-and-mul in the epilogue
        offs_n = act_columns(pid_n, act_half, BLOCK_N)
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    if W_LEFT:
        acc = wleft_steps(x_ptr, qw_ptr, scales_ptr, biases_ptr, offs_m, offs_n, m_mask, n_mask,
                          k_start, k_end, stride_xm, stride_qw, stride_sg, GROUP_SIZE, BLOCK_M,
                          BLOCK_N, WROWS, X_F16, DOT_F32, USE_ASM, SCALED, IZERO,
                          X_PAIRS=X_PAIRS, EVICT_FIRST=EVICT_FIRST, PAIR_ACCS=PAIR_ACCS,
                          JOINED=JOINED)
    else:
        acc = wright_steps(x_rows, qw_ptr, scales_ptr, biases_ptr, offs_m, offs_n, m_mask, n_mask,
                           k_start, k_end, stride_qw, stride_sg, GROUP_SIZE, BLOCK_M, BLOCK_N,
                           WROWS, X_F16, X_PERM, DOT_F32, EVICT_FIRST)
    ticket = ticket_ptr + pid_m * tl.num_programs(1) + pid_n
    row_ticket = ticket_ptr + tl.num_programs(0) * tl.num_programs(1) + pid_m
    pdl_late(PDL)
    finish_tile(acc, out_ptr, ws_ptr, ticket, row_ticket, pid_k, pid_n, offs_m, offs_n, M, N, stride_om, num_splits,
                res_ptr, nw_ptr, sum_ptr, y_ptr, parts_ptr, rstd_ptr, rstd_in_ptr, act_half, eps, stride_rm,
                stride_ym, EPI, ACT, NORM_IN, OUT_PAIRS, PARTS_BLOCK)


@triton.jit
def wleft_steps(x_ptr, qw_ptr, scales_ptr, biases_ptr, offs_m, offs_n, m_mask, n_mask, k_start,
                k_end, stride_xm, stride_qw, stride_sg, GROUP_SIZE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WROWS: tl.constexpr,
                X_F16: tl.constexpr, DOT_F32: tl.constexpr, USE_ASM: tl.constexpr = False,
                SCALED: tl.constexpr = False, IZERO: tl.constexpr = False,
                X_PAIRS: tl.constexpr = False, EVICT_FIRST: tl.constexpr = False,
                PAIR_ACCS: tl.constexpr = False, JOINED: tl.constexpr = False):
    """The K loop with the weights as the dots' left operand: out^T = W^T x^T, four nibble-pair
    dots a K step (pair_tile: a word's masked pair is one register of the left operand; sm_90:
    wgmma with the weights in registers, BLOCK_N its M, the rows its N). x is one [BLOCK_M, 8
    WROWS] tile a step, split in registers (x_pair_slices); the same tile gives the step's sum
    of x for the magic-number offset. A step stays inside one group. USE_ASM (NVIDIA): pairs 1-3
    by one PTX lop3 each (pair_bits). SCALED (GemmTiles.scaled): the registers hold the weights,
    (q - z) s + r (left_weights), the dots sum the step's product whole and the step adds it: no
    sum of x, no epilogue, each weight rounded once to the activations' type. IZERO
    (GemmTiles.int_zeros on a W4Weight.int_zeros weight): the registers hold q - z, exact, and
    the step applies s (one FMA an output element): no sum of x, no rounding of the weights.
    X_PAIRS: x is stored in pair order (pair_order), so the four slices are contiguous loads
    that go to the MMA as they are (many rows: no split in registers and store back to shared).
    PAIR_ACCS (SCALED and X_PAIRS only; GemmTiles.pair_accs): one accumulator a nibble pair,
    summed after the loop. Each dot then feeds only its own next step and reads x from the
    loop's multi-buffered copies, which is what Triton's asyncLaunchDots needs to keep the
    wgmmas in flight (eight K-16 dots a step, a wait for at most 7 pending) instead of waiting
    after every pair (sm_90 SASS at 16 x 128: the four DEPBAR-to-zero waits and their CTA
    fences gone, 2 barriers a step left). JOINED (SCALED and X_PAIRS only; GemmTiles.joined):
    one dot a step of the four pair tiles joined along K (joined_tile, no data movement) with
    x's whole step in pair order, into one accumulator: in flight the same way, with fewer
    registers than PAIR_ACCS (sm_90 at 16 x 128: 108 against 116, 308 instructions a step
    against 318). Otherwise the four dots stay four: the joined dot was 10% slower in the
    MoE's gate_up at 2,048 tokens on the H200 (30.1)."""
    BLOCK_K: tl.constexpr = WROWS * 8
    OFFSET: tl.constexpr = 1024.0 if X_F16 else 128.0
    EVICT: tl.constexpr = "evict_first" if EVICT_FIRST else ""
    rows = tl.arange(0, WROWS)
    # [BLOCK_M, BLOCK_K] (X_PAIRS: one slice, [BLOCK_M, 2 WROWS]; JOINED: the whole step)
    x_offs = offs_m[:, None] * stride_xm + tl.arange(0, 2 * WROWS if X_PAIRS and not JOINED
                                                      else BLOCK_K)[None, :]
    w_offs = rows[None, :] * stride_qw + offs_n[:, None]  # [BLOCK_N, WROWS]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    # scalar step pointers advanced a step at a time, 32-bit offsets within a step (per-element
    # 64-bit address math was ~45 of the loop's instructions on sm_90)
    qw_step = qw_ptr + tl.cast(k_start // 8, tl.int64) * stride_qw
    x_step = x_ptr + k_start
    for k0 in range(k_start, k_end, BLOCK_K):
        packed = tl.load(qw_step + w_offs, mask=n_mask[:, None], other=0,
                         eviction_policy=EVICT)  # [BLOCK_N, WROWS]
        g_off = (k0 // GROUP_SIZE) * stride_sg + offs_n
        scale = tl.load(scales_ptr + g_off, mask=n_mask, other=0.0, eviction_policy=EVICT)
        bias = tl.load(biases_ptr + g_off, mask=n_mask, other=0.0, eviction_policy=EVICT)
        if SCALED:
            s, c, b = scaled_terms(scale, bias, X_F16, USE_ASM)
        elif IZERO:
            s, c = zero_terms(scale, bias, X_F16, USE_ASM)
            b = c  # unused: left_weights reads r only for SCALED
        else:
            s = scale.to(tl.float32)[:, None]
            b = bias.to(tl.float32)[:, None]
            c = b  # unused: the offset form's registers are the pairs as they are
        if JOINED:  # the step's x in pair order as one tile: the joined dot's operand
            xt = tl.load(x_step + x_offs, mask=m_mask[:, None], other=0.0)
        elif X_PAIRS:  # the four slices are contiguous: straight to the MMA, no split in registers
            x0 = tl.load(x_step + x_offs, mask=m_mask[:, None], other=0.0)
            x1 = tl.load(x_step + 2 * WROWS + x_offs, mask=m_mask[:, None], other=0.0)
            x2 = tl.load(x_step + 4 * WROWS + x_offs, mask=m_mask[:, None], other=0.0)
            x3 = tl.load(x_step + 6 * WROWS + x_offs, mask=m_mask[:, None], other=0.0)
            if not (SCALED or IZERO):
                x_sum = tl.sum(x0.to(tl.float32) + x1.to(tl.float32) + x2.to(tl.float32)
                               + x3.to(tl.float32), axis=1)[None, :]
        else:
            xt = tl.load(x_step + x_offs, mask=m_mask[:, None], other=0.0)
            if not (SCALED or IZERO):
                x_sum = tl.sum(xt.to(tl.float32), axis=1)[None, :]
            x0, x1, x2, x3 = x_pair_slices(xt, WROWS)
        if JOINED:  # the scaled form, the four pairs' registers as one operand, one dot a step
            wt = joined_tile(*scaled_pairs(packed, s, c, b, X_F16, USE_ASM), X_F16)
            if DOT_F32:
                acc += tl.dot(wt.to(tl.float32), tl.trans(xt).to(tl.float32))
            else:
                acc = tl.dot(wt, tl.trans(xt), acc)
        elif PAIR_ACCS:  # the scaled form, one accumulator a pair: no dot feeds another this step
            w0, w1, w2, w3 = scaled_pairs(packed, s, c, b, X_F16, USE_ASM)
            acc = pair_left_dot(acc, x0, w0, X_F16, DOT_F32)
            acc1 = pair_left_dot(acc1, x1, w1, X_F16, DOT_F32)
            acc2 = pair_left_dot(acc2, x2, w2, X_F16, DOT_F32)
            acc3 = pair_left_dot(acc3, x3, w3, X_F16, DOT_F32)
        else:
            # SCALED: the dots sum into acc itself (one accumulator's registers, not two)
            inner = acc if SCALED else tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            pair = pair_bits(packed, packed, 0, X_F16)
            w0 = left_weights(pair, s, c, b, SCALED, IZERO, X_F16, USE_ASM)
            inner = pair_left_dot(inner, x0, w0, X_F16, DOT_F32)
            for j in tl.static_range(1, 4):
                pair = pair_bits(packed, pair, j, X_F16, USE_ASM)
                xj = x1 if j == 1 else (x2 if j == 2 else x3)
                inner = pair_left_dot(inner, xj, left_weights(pair, s, c, b, SCALED, IZERO, X_F16, USE_ASM),
                                      X_F16, DOT_F32)
            if SCALED:
                acc = inner
            else:
                acc += inner * s
                if not IZERO:  # the offset form's second FMA an element: (b - OFFSET s) is per column
                    acc += x_sum * (b - OFFSET * s)
        qw_step += WROWS * stride_qw
        x_step += BLOCK_K
    if PAIR_ACCS:
        acc = (acc + acc1) + (acc2 + acc3)
    return tl.trans(acc)


@triton.jit
def wright_steps(x_rows, qw_ptr, scales_ptr, biases_ptr, offs_m, offs_n, m_mask, n_mask, k_start,
                 k_end, stride_qw, stride_sg, GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, WROWS: tl.constexpr, X_F16: tl.constexpr,
                 X_PERM: tl.constexpr, DOT_F32: tl.constexpr, EVICT_FIRST: tl.constexpr = False):
    """The K loop with the weights as the dots' right operand: eight per-nibble dots a step."""
    BLOCK_K: tl.constexpr = WROWS * 8
    ONE_GROUP: tl.constexpr = GROUP_SIZE % BLOCK_K == 0  # a K step never crosses a group
    EVICT: tl.constexpr = "evict_first" if EVICT_FIRST else ""
    OFFSET: tl.constexpr = 1024.0 if X_F16 else 128.0  # nibble_pair's magic-number floor
    rows = tl.arange(0, WROWS)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        word_rows = k0 // 8 + rows
        r_mask = word_rows * 8 < k_end
        packed = tl.load(qw_ptr + word_rows[:, None].to(tl.int64) * stride_qw + offs_n[None, :],
                         mask=r_mask[:, None] & n_mask[None, :], other=0,
                         eviction_policy=EVICT)
        if ONE_GROUP:
            g_off = (k0 // GROUP_SIZE) * stride_sg + offs_n
            s = tl.load(scales_ptr + g_off, mask=n_mask, other=0.0,
                        eviction_policy=EVICT).to(tl.float32)[None, :]
            b = tl.load(biases_ptr + g_off, mask=n_mask, other=0.0,
                        eviction_policy=EVICT).to(tl.float32)[None, :]
        else:
            g_off = ((word_rows * 8) // GROUP_SIZE)[:, None] * stride_sg + offs_n[None, :]
            sb_mask = r_mask[:, None] & n_mask[None, :]
            s = tl.load(scales_ptr + g_off, mask=sb_mask, other=0.0,
                        eviction_policy=EVICT).to(tl.float32)
            b = tl.load(biases_ptr + g_off, mask=sb_mask, other=0.0,
                        eviction_policy=EVICT).to(tl.float32)
        if ONE_GROUP:
            # sum_k x (OFFSET + q) from tensor-core dots on magic-number floats, then
            # W = q s + b applied per step: acc += (inner - OFFSET sum_k x) s + (sum_k x) b.
            x_sum = tl.sum(tl.load(x_rows + k0 + tl.arange(0, BLOCK_K)[None, :], mask=m_mask[:, None],
                                   other=0.0).to(tl.float32), axis=1)[:, None]
            inner = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for j in tl.static_range(4):
                lo, hi = nibble_pair(packed, j, X_F16)
                inner = dot_step(inner, x_rows, k0, word_rows, j, m_mask, r_mask, lo, X_PERM, DOT_F32)
                inner = dot_step(inner, x_rows, k0, word_rows, j + 4, m_mask, r_mask, hi, X_PERM,
                                 DOT_F32)
            acc += (inner - OFFSET * x_sum) * s + x_sum * b
        else:
            high = packed >> 20  # nibbles 5..7 where nibble_f32's AND-OR reaches them
            for j in tl.static_range(8):
                # q * 16^(j % 5) without an int->float conversion (a quarter-rate instruction),
                # times scale * 16^-(j % 5): the same product as q * scale, exactly.
                if j < 5:
                    w = nibble_f32(packed, j) * unscale_pow2(s, j) + b
                else:
                    w = nibble_f32(high, j) * unscale_pow2(s, j) + b
                acc = dot_step(acc, x_rows, k0, word_rows, j, m_mask, r_mask, w, X_PERM, DOT_F32)
    return acc


PERMUTE_ABOVE = 16  # rows: past one MMA row block, x's stride-8 gathers cost more than a permute


def permute_steps(x2: torch.Tensor, block_k: int) -> torch.Tensor:
    """x with each K step of block_k values reordered from k = 8 r + j to j * (block_k / 8) + r,
    so the kernel's eight per-nibble slices of a step are contiguous loads. Without it every
    program gathers x at a stride of 8 elements (16 bytes), one 32-byte sector per two values:
    at 40 rows those gathers, repeated by every column block, cost more than the weights."""
    m, k = x2.shape
    return x2.view(m, k // block_k, block_k // 8, 8).transpose(2, 3).contiguous().view(m, k)


def dot_grid(m: int, n: int, tiles: GemmTiles) -> tuple[int, int, int, int]:
    """(rows a program, word rows a K step, row blocks, column blocks) of a launch over m x n:
    tiles.block_m is an upper bound (at least 16, tl.dot's minimum), a step at least 16 word rows."""
    block_m = min(tiles.block_m, max(16, next_pow2(m)))
    return block_m, max(16, tiles.block_k // 8), triton.cdiv(m, block_m), triton.cdiv(n, tiles.block_n)


def launch_tiles(m: int, w: W4Weight, device: torch.device, tiles: GemmTiles | None = None,
                 w_left: bool = True) -> tuple[bool, GemmTiles]:
    """(w_left, tiles) a w4a16_dot launch of m rows takes: the given tiles, else with w_left the
    table's left-operand entry, else its w4a16_dot; the left loop only where the weight's group
    is whole K steps (a step stays inside a group), the eight-dot loop otherwise."""
    arch = tiles_for(device)
    t = tiles or (w_left and dot_left_tiles(m, device, w.out_features, w.in_features)) or arch.w4a16_dot
    if w_left and w.group_size % (dot_grid(m, w.out_features, t)[1] * 8):
        return False, tiles or arch.w4a16_dot
    return w_left, t


def x_pairs_block(m: int, w: W4Weight, device: torch.device) -> int:
    """The K step whose pair order (pair_order) a left-operand launch of m rows on the table's
    tiles wants x in from its producer (GemmTiles.x_pairs or pair_accs), 0 where it reads x in
    k order."""
    w_left, t = launch_tiles(m, w, device)
    return 8 * dot_grid(m, w.out_features, t)[1] if w_left and (t.x_pairs or t.in_flight) else 0


def w4a16_dot(x2: torch.Tensor, w: W4Weight, out: torch.Tensor, tiles: GemmTiles | None = None,
              split: int | None = None, permute: bool | None = None,
              w_left: bool = False, x_paired: bool = False, chain: DotChain | None = None) -> torch.Tensor:
    """out[M, N] = x2[M, K] @ W for a few rows; x2 is already permuted and row-contiguous.
    tiles: block_m is an upper bound (rounded down to the next power of two >= M, at least 16),
    block_k = 8 * word rows per K step (at least 128: tl.dot needs 16 word rows); default the
    arch table's w4a16_dot, or with w_left its w4a16_dot_left entry where it has one. w_left: the
    weights as the dots' left operand, four nibble-pair dots a step (wleft_steps) where the group
    size is a multiple of the K step; else the eight-dot loop (on the w4a16_dot tiles unless
    tiles are given). x_paired: x2 comes in pair order (pair_order at the tiles' K step), which
    the left loop then reads as four contiguous slices a step (X_PAIRS; what a producer writing
    that order, or one reorder serving several calls, gives); an error where the launch takes
    the eight-dot loop. Tiles with pair_accs or joined need that order: x2 is reordered here
    unless x_paired. chain: a chained epilogue (w4a16_epilogue.DotChain: it says what is stored
    instead of out, which is then left alone)."""
    m, k = x2.shape
    n = w.out_features
    w_left, t = launch_tiles(m, w, x2.device, tiles, w_left)
    block_m, wrows, grid_m, grid_n = dot_grid(m, n, t)
    block_k = wrows * 8
    pairs = w_left and t.in_flight  # every left launch's K is whole steps (whole groups)
    if x_paired and not w_left:
        raise ValueError("w4a16_dot: x_paired needs the left-operand loop (w_left, a group size that "
                         "is whole K steps)")
    if pairs and not x_paired:
        x2 = pair_order(x2, block_k)
    if permute is None:
        permute = m > PERMUTE_ABOVE
    permute = permute and k % block_k == 0 and not w_left  # the left-weights loop reads x in k order
    if permute:
        x2 = permute_steps(x2, block_k)
    izero = w_left and t.int_zeros and w.int_zeros and not pairs
    meta = dict(GROUP_SIZE=w.group_size, BLOCK_M=block_m, BLOCK_N=t.block_n, WROWS=wrows,
                X_PERM=permute, DOT_F32=dot_in_fp32(), W_LEFT=w_left,
                USE_ASM=w_left and uses_ptx(x2.device), num_warps=t.num_warps,
                # one row block reads each weight once a call: the L2 need not keep it
                EVICT_FIRST=grid_m == 1,
                SCALED=w_left and (t.scaled or pairs) and not izero, IZERO=izero,
                PAIR_ACCS=pairs and not t.joined, JOINED=pairs and t.joined, X_PAIRS=pairs or x_paired,
                num_stages=t.num_stages, **pdl_args(x2.device, "dot"))
    chain = chain or DotChain()
    meta.update(chain.meta(n, t.block_n, grid_n))
    # NORM_OUT: a counter a row block after the tiles' (w4a16_epilogue.row_norm_scale)
    tickets = ticket_buffer(x2.device, grid_m * grid_n + (grid_m if chain.epi else 0))

    def args(ws: torch.Tensor, k_per_split: int, split: int) -> tuple:
        return (x2, w.qweight, w.scales, w.biases, out, ws, tickets, m, n, k, k_per_split,
                x2.stride(0), w.qweight.stride(0), w.scales.stride(0), out.stride(0), split) + chain.runtime(n)

    if split is None:
        per_sm = resident_per_sm(_w4a16_dot_kernel, (x2.dtype,) + tuple(sorted(meta.items())),
                                 x2.device, args(out, 2 * block_k, 2), meta)
        # these programs are longer than the GEMV's (tiles.split_k: programs per SM otherwise)
        split = (balance_split(grid_m * grid_n, triton.cdiv(k, block_k), device_sms(x2.device), per_sm,
                               min_steps=2)
                 if per_sm else pick_split(grid_m * grid_n, k, block_k, x2.device, waves=t.split_k))
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    ws = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x2.device)
    _w4a16_dot_kernel[(grid_m, grid_n, split)](*args(ws, k_per_split, split), **meta)
    return out
