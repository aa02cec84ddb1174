"""W4A16 decode for 2..32 rows on warp-level tensor-core MMAs with the fragments placed by hand.

Why (issues 17 and 19): the packed-half GEMV (w4a16_h2.py) pays one fma.rn.f16x2 per weight
pair per row, so 2 rows cost ~1.4x one and 8 rows ~2.5x; the few-row wgmma kernel
(w4a16_dot.py) goes through Triton's dot (shared-memory copies of x, fences, a layout
conversion) at ~300 warp instructions per KB of weights: both are issue-bound where a decode
step should be copy-bound (docs/BENCHMARKS.md 38.4, 38.7). Here one mma.sync.m16n8k16 (fp16 in,
fp32 accumulate) multiplies 16 output columns x 16 K by up to 8 activation rows, and the A
fragment comes straight out of the packed words with no conversion:

  A (weights) thread (g, c) = lane (4g + c) holds, per mma, the pairs (row g, k 2c..2c+1),
            (row g+8, same k), (row g, k 2c+8..9), (row g+8, same). w4a16_half2.nibble_pairs
            turns one word (8 nibbles of one column, k = 8r + j) into four exact fp16 pairs
            (q_j, q_j+4), j = 0..3 (subnormals q 2^-24 / q 2^-20). A thread loads the words of
            4 adjacent columns 4g..4g+3 at one word row (16 bytes): columns 4g, 4g+1 are one
            mma's A rows g, g+8 (pairs 0, 1, then pairs 2, 3 for a second mma), columns 4g+2,
            4g+3 another's. The K order inside an mma is free as long as B uses the same one:
            the 16 k slots of thread c are the 8 values of its own word row r0 + c, in
            nibble_pairs' order, so a quad's 4 threads read 4 consecutive word rows.
  B (x)     thread (g, c) holds activation row g at the same k slots: the four int32 pairs
            4r..4r+3 of prep_x_pairs' layout ((x_j, x_j+4) * 2^-e * 2^14 / 2^10), one 16-byte
            load; rows g >= M read row M - 1 (their outputs are dropped). 9-32 rows: two or
            four B tiles (rows 8j + g; ROW_TILES 2 or 4) multiply the same A fragments, so the
            words are still read once, for 8 or 16 mmas a word row instead of 4.
  C         thread (g, c) gets its 4 columns for rows 2c and 2c+1, in fp32.

Per word row a thread spends one 16-byte load of words and one of x, four shifts, sixteen
LOP3s and four mmas (64 weights x up to 8 rows): ~100 SASS instructions per KB of weights on
sm_90 whatever the row count (a group's scales and sums included), against ~212 a KB an SM can
issue while its share of the copy rate streams in (H100/H200).

A warp owns 32 columns (64 with quads=2) and strides K in whole groups (group size 128: 4
steps of 4 word rows); a program is WARPS_N x WARPS_K warps: WARPS_N column tiles side by
side, each split WARPS_K ways along K and summed once through shared memory; programs split K
further (pid 1) through the W4A16 split-K epilogue (w4a16_gemv.store_or_reduce). After each
group, acc * 2^e * scale + sum(x) * bias per (row, column) (W = q s + b within a group), as in
the packed-half GEMV.

The activations reach the kernel as prep_x_pairs' scratch ([M, K] fp16 pairs + [M, 2, K / group]
fp32) from a launch of their own (prep_pairs, one program per row and 512 values), which can also form
the input as w4a16_h2's prologue does: the RMSNorm (with the residual add, keeping the summed
and normalized rows) or the gated activation, so a norm-then-linear is two launches as on the
left-operand kernel. (Every program converting its own K range instead, as w4a16_h2 does, made
every column block redo the same work and cost more than the launch: docs/BENCHMARKS.md 48.2.)

USE_ASM (NVIDIA sm_80+): the mma is PTX (tl.inline_asm_elementwise over [L] tensors, L = the
program's threads, one element a thread, so each thread's element i is lane i % 32 of warp
i // 32 -- what the PTX fragment layout assumes). Elsewhere (TRITON_INTERPRET: the CPU tests)
mma_twin rebuilds each warp's A, B and C from the same fragments and multiplies them, so the
CPU tests check the fragment placement itself, the packing order and the group math; the GPU
tests check the PTX. gfx1100 (wave32, no mma.sync) does not take this kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.pdl import pdl_args, pdl_enter, pdl_late
from homelab_llm.engine.kernels.tuning import device_sms, field_override, uses_ptx
from homelab_llm.engine.kernels.w4a16_gemv import store_or_reduce, ticket_buffer
from homelab_llm.engine.kernels.w4a16_half2 import half_hi, half_lo, nibble_pairs, prep_x_pairs
from homelab_llm.engine.kernels.w4a16_pack import W4Weight
from homelab_llm.engine.kernels.w4a16_prologue import ACT_CODES, norm_chunk, row_rstd

MAX_ROWS = 32  # four n8 B tiles (9-16 rows: ROW_TILES 2, 17-32: 4; every A fragment reused)
PREP_VALUES = tl.constexpr(512)  # K values a prep chunk converts (a multiple of the group)
REDUCE_VALUES, REDUCE_SLOTS = tl.constexpr(16384), tl.constexpr(16)


@dataclass(frozen=True)
class MmaTiles:
    """warps_n column tiles of 32 x quads a program, each split warps_k ways along K (in whole
    groups); split: K splits across programs (0: from waves, programs an SM aimed for)."""

    warps_n: int = 2
    warps_k: int = 2
    split: int = 0
    waves: int = 8
    quads: int = 1  # 4-column groups a thread: 1 (32 columns a warp) or 2 (64)

    @property
    def block_n(self) -> int:
        return 32 * self.quads * self.warps_n


# The tiles a shape gets (mma_tiles), from w4a16_sweep.py over the 8B, 27B and 30B-A3B linears
# at TP 1 and 2, 1-8 rows, and engine steps (H100, docs/BENCHMARKS.md 50): one-warp programs with
# K split for 24 programs an SM serve the large matrices (27B W4A16 step at 2 rows 9.01 -> 8.03 ms
# against SQUARE for all); outputs of 4.5+ column tiles of 32 an SM (the 27B's gate_up) take
# four-warp programs splitting K inside instead; LM heads (11+ an SM) and matrices of 12 Mi
# weights or fewer (the 30B-A3B's attention, whose batch-8 step lost 3% on one-warp programs)
# keep the two-by-two programs.
WIDE_BLOCKS_PER_SM, HEAD_BLOCKS_PER_SM, SMALL_WEIGHTS = 4.5, 11.0, 12 << 20
ONE_WARP = MmaTiles(warps_n=1, warps_k=1, waves=24)
K_WARPS = MmaTiles(warps_n=1, warps_k=4, waves=8)
SQUARE = MmaTiles(warps_n=2, warps_k=2, waves=8)
# 9-16 rows (two B tiles a thread: more registers a program): two-warp K-splitting programs, 8 an
# SM, for every matrix but LM heads (w4a16_sweep.py, 27B linears at 16 rows on an H100: 8.04 ms a
# step against 9.95 at the 1-8-row picks and 8.93 on dotL; docs/BENCHMARKS.md 51). 17-32 rows
# (four B tiles) stay on them too: no tiles tried there beat dotL (14.0 ms against 10.1 at 32).
ROWS16 = MmaTiles(warps_n=1, warps_k=2, waves=8)
# A/B runs without a patched tree: "field=value,..." as every shape's tiles ("warps_n=2,warps_k=2,
# waves=8": SQUARE for all, the tiles before per-shape picks)
MMA_TILES_ENV = "HOMELAB_LLM_MMA_TILES"


@functools.lru_cache(maxsize=8)
def mma_tiles_override(spec: str) -> MmaTiles | None:
    """MMA_TILES_ENV's text as the tiles every shape takes (None when empty)."""
    kinds = {f.name: int for f in dataclasses.fields(MmaTiles)}
    change = field_override(MMA_TILES_ENV, spec, kinds)
    return MmaTiles(**change) if change else None


def mma_tiles(n: int, k: int, device: torch.device, m: int = 1) -> MmaTiles:
    """The tiles w4a16_mma gives an [n, k] weight at m rows (see WIDE_BLOCKS_PER_SM's and
    ROWS16's notes)."""
    fixed = mma_tiles_override(os.environ.get(MMA_TILES_ENV, ""))
    if fixed is not None:
        return fixed
    per_sm = (n / 32) / device_sms(device)
    if per_sm >= HEAD_BLOCKS_PER_SM:
        return SQUARE
    if m > 8:
        return ROWS16
    if n * k <= SMALL_WEIGHTS:
        return SQUARE
    return K_WARPS if per_sm >= WIDE_BLOCKS_PER_SM else ONE_WARP


@triton.jit
def mma_16816(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, WARPS: tl.constexpr, USE_ASM: tl.constexpr):
    """D = A B + C per warp: mma.m16n8k16 with fp16 A (a0..a3) and B (b0, b1) as int32 pair bits
    and fp32 C / D (c0..c3), every operand [32 WARPS], element i on lane i % 32 of warp i // 32."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, "
            "{$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        return mma_twin(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, WARPS)


@triton.jit
def lane_halves(bits, WARPS: tl.constexpr):
    """[32 WARPS] int32 pair bits -> [WARPS, 8, 4, 2] fp32: (warp, group g, thread c, half)."""
    return tl.reshape(tl.join(half_lo(bits), half_hi(bits)).to(tl.float32), [WARPS, 8, 4, 2])


@triton.jit
def mma_twin(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, WARPS: tl.constexpr):
    """mma_16816 in plain Triton: each warp's A [16, 16], B [16, 8] rebuilt from the fragments
    (PTX ISA's m16n8k16 layouts), multiplied in fp32, D handed back in C's fragment layout."""
    # A: register 0 (row g, k 2c + h), 1 (row g + 8), 2 (row g, k + 8), 3 (row g + 8, k + 8)
    a = tl.join(tl.join(lane_halves(a0, WARPS), lane_halves(a1, WARPS)),
                tl.join(lane_halves(a2, WARPS), lane_halves(a3, WARPS)))  # (w, g, c, h, rh, kh)
    a = tl.reshape(tl.permute(a, [0, 4, 1, 5, 2, 3]), [WARPS, 16, 16])  # (w, rh g, kh c h)
    # B: register 0 (k 2c + h, column g), 1 (k + 8)
    b = tl.join(lane_halves(b0, WARPS), lane_halves(b1, WARPS))  # (w, g, c, h, kh)
    b = tl.reshape(tl.permute(b, [0, 4, 2, 3, 1]), [WARPS, 16, 8])  # (w, kh c h, g)
    d = tl.sum(a[:, :, :, None] * b[:, None, :, :], axis=2)  # [WARPS, 16, 8]: (w, rh g, c h)
    # C: (row g, column 2c + h) for c0 / c1, row g + 8 for c2 / c3
    d = tl.reshape(tl.permute(tl.reshape(d, [WARPS, 2, 8, 4, 2]), [0, 2, 3, 1, 4]), [32 * WARPS, 2, 2])
    d_h0, d_h1 = tl.split(d)  # [32 WARPS, 2 (rh)] each
    d0, d2 = tl.split(d_h0)
    d1, d3 = tl.split(d_h1)
    return c0 + d0, c1 + d1, c2 + d2, c3 + d3


@triton.jit
def split4(v):
    """[L, 4] -> its four columns [L] (in order)."""
    lo, hi = tl.split(tl.reshape(v, [v.shape[0], 2, 2]))  # columns (0, 2) and (1, 3)
    v0, v2 = tl.split(lo)
    v1, v3 = tl.split(hi)
    return v0, v1, v2, v3


@triton.jit
def load4(ptr, offs, ok, EVICT: tl.constexpr):
    """Four consecutive values a thread (offs [L] of the first; one 16-byte load where aligned),
    zeros where not ok [L, 4], as four [L] tensors."""
    ptrs = ptr + offs[:, None] + tl.arange(0, 4)[None, :]
    if EVICT:  # weights, scales, biases: read once a step
        v = tl.load(ptrs, mask=ok, other=0, eviction_policy="evict_first")
    else:
        v = tl.load(ptrs, mask=ok, other=0)
    return split4(v)


@triton.jit
def pair_mmas(wa, wb, x0, x1, x2, x3, d0, d1, d2, d3, WARPS: tl.constexpr, USE_ASM: tl.constexpr):
    """Two mmas over one word row: A rows g / g + 8 are the columns of words wa / wb, the k slots
    nibble_pairs' pairs 0, 1 then 2, 3 against the activation pairs x0..x3."""
    pa0, pa1, pa2, pa3 = nibble_pairs(wa)
    pb0, pb1, pb2, pb3 = nibble_pairs(wb)
    d0, d1, d2, d3 = mma_16816(pa0, pb0, pa1, pb1, x0, x1, d0, d1, d2, d3, WARPS, USE_ASM)
    return mma_16816(pa2, pb2, pa3, pb3, x2, x3, d0, d1, d2, d3, WARPS, USE_ASM)


@triton.jit
def quad_step(qw_ptr, offs, ok, x0, x1, x2, x3, dx0, dx1, dx2, dx3, dy0, dy1, dy2, dy3,
              WARPS: tl.constexpr, USE_ASM: tl.constexpr):
    """One word row of a thread's 4 columns (one 16-byte load at offs): columns 0, 1 into the
    dx fragment, 2, 3 into dy."""
    w0, w1, w2, w3 = load4(qw_ptr, offs, ok, True)
    dx0, dx1, dx2, dx3 = pair_mmas(w0, w1, x0, x1, x2, x3, dx0, dx1, dx2, dx3, WARPS, USE_ASM)
    dy0, dy1, dy2, dy3 = pair_mmas(w2, w3, x0, x1, x2, x3, dy0, dy1, dy2, dy3, WARPS, USE_ASM)
    return dx0, dx1, dx2, dx3, dy0, dy1, dy2, dy3


@triton.jit
def word_frags(qw_ptr, offs, ok):
    """A thread's 4 words at one word row (one 16-byte load at offs) as the A fragments of its
    two mma pairs: nibble_pairs of columns 0, 1 (pa, pb: the dx fragment's) and 2, 3 (pc, pd)."""
    w0, w1, w2, w3 = load4(qw_ptr, offs, ok, True)
    pa0, pa1, pa2, pa3 = nibble_pairs(w0)
    pb0, pb1, pb2, pb3 = nibble_pairs(w1)
    pc0, pc1, pc2, pc3 = nibble_pairs(w2)
    pd0, pd1, pd2, pd3 = nibble_pairs(w3)
    return pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3, pc0, pc1, pc2, pc3, pd0, pd1, pd2, pd3


@triton.jit
def tile_mmas(pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3, pc0, pc1, pc2, pc3, pd0, pd1, pd2, pd3, xp_ptr, x_offs,
              x_ok, dx0, dx1, dx2, dx3, dy0, dy1, dy2, dy3, WARPS: tl.constexpr, USE_ASM: tl.constexpr):
    """One row tile's four mmas at a word row: its activation pairs (one 16-byte load at x_offs)
    against word_frags' fragments, into its dx / dy accumulators."""
    x0, x1, x2, x3 = load4(xp_ptr, x_offs, x_ok, False)
    dx0, dx1, dx2, dx3 = mma_16816(pa0, pb0, pa1, pb1, x0, x1, dx0, dx1, dx2, dx3, WARPS, USE_ASM)
    dx0, dx1, dx2, dx3 = mma_16816(pa2, pb2, pa3, pb3, x2, x3, dx0, dx1, dx2, dx3, WARPS, USE_ASM)
    dy0, dy1, dy2, dy3 = mma_16816(pc0, pd0, pc1, pd1, x0, x1, dy0, dy1, dy2, dy3, WARPS, USE_ASM)
    dy0, dy1, dy2, dy3 = mma_16816(pc2, pd2, pc3, pd3, x2, x3, dy0, dy1, dy2, dy3, WARPS, USE_ASM)
    return dx0, dx1, dx2, dx3, dy0, dy1, dy2, dy3


@triton.jit
def tile_totals(xg_ptr, base, c, M, n_groups, G, ok, scales_ptr, biases_ptr, offs, ok2, dx0, dx1, dx2, dx3,
                dy0, dy1, dy2, dy3, tx0, tx1, tx2, tx3, ty0, ty1, ty2, ty3):
    """quad_totals for the row tile whose first row is base: a thread's output rows base + 2c,
    base + 2c + 1 (past M: row M - 1, dropped at the store)."""
    sum0, sum1, undo0, undo1 = group_factors(xg_ptr, tl.minimum(base + 2 * c, M - 1),
                                             tl.minimum(base + 2 * c + 1, M - 1), n_groups, G, ok)
    return quad_totals(scales_ptr, biases_ptr, offs, ok2, undo0, undo1, sum0, sum1, dx0, dx1, dx2, dx3,
                       dy0, dy1, dy2, dy3, tx0, tx1, tx2, tx3, ty0, ty1, ty2, ty3)


@triton.jit
def tile_part(tx0, tx1, tx2, tx3, ty0, ty1, ty2, ty3, WARPS_N: tl.constexpr, WARPS_K: tl.constexpr):
    """A row tile's totals, the WARPS_K K ranges added, as its [8, 32 WARPS_N] output tile."""
    return fragment_tile(warp_sum(tx0, WARPS_K), warp_sum(tx1, WARPS_K), warp_sum(tx2, WARPS_K),
                         warp_sum(tx3, WARPS_K), warp_sum(ty0, WARPS_K), warp_sum(ty1, WARPS_K),
                         warp_sum(ty2, WARPS_K), warp_sum(ty3, WARPS_K), WARPS_N)


@triton.jit
def group_factors(xg_ptr, row0, row1, n_groups, G, ok):
    """A group's x sums and undo factors for a thread's two output rows (prep_pairs' [M, 2, K /
    GROUP] layout): (sum0, sum1, undo0, undo1)."""
    sum0 = tl.load(xg_ptr + 2 * row0 * n_groups + G, mask=ok, other=0.0)
    sum1 = tl.load(xg_ptr + 2 * row1 * n_groups + G, mask=ok, other=0.0)
    undo0 = tl.load(xg_ptr + (2 * row0 + 1) * n_groups + G, mask=ok, other=0.0)
    undo1 = tl.load(xg_ptr + (2 * row1 + 1) * n_groups + G, mask=ok, other=0.0)
    return sum0, sum1, undo0, undo1


@triton.jit
def quad_totals(scales_ptr, biases_ptr, offs, ok, undo0, undo1, sum0, sum1, dx0, dx1, dx2, dx3,
                dy0, dy1, dy2, dy3, tx0, tx1, tx2, tx3, ty0, ty1, ty2, ty3):
    """A group's fragments of a thread's 4 columns (scales / biases at offs) added to its totals
    in output units; rows 2c (undo0, sum0) and 2c + 1."""
    s0, s1, s2, s3 = load4(scales_ptr, offs, ok, True)
    b0, b1, b2, b3 = load4(biases_ptr, offs, ok, True)
    s0, s1, s2, s3 = s0.to(tl.float32), s1.to(tl.float32), s2.to(tl.float32), s3.to(tl.float32)
    b0, b1, b2, b3 = b0.to(tl.float32), b1.to(tl.float32), b2.to(tl.float32), b3.to(tl.float32)
    return (tx0 + scaled(dx0, undo0, s0, sum0, b0), tx1 + scaled(dx1, undo1, s0, sum1, b0),
            tx2 + scaled(dx2, undo0, s1, sum0, b1), tx3 + scaled(dx3, undo1, s1, sum1, b1),
            ty0 + scaled(dy0, undo0, s2, sum0, b2), ty1 + scaled(dy1, undo1, s2, sum1, b2),
            ty2 + scaled(dy2, undo0, s3, sum0, b3), ty3 + scaled(dy3, undo1, s3, sum1, b3))


@triton.jit
def scaled(d, undo, s, xsum, b):
    """A group's fragment value in output units: sum q x 2^-e 2^-10 -> (x W) over the group."""
    return d * (undo * s) + xsum * b


@triton.jit
def warp_sum(t, WARPS_K: tl.constexpr):
    """[WARPS_K x 32 WARPS_N] per-thread sums -> [32 WARPS_N]: the WARPS_K K ranges added."""
    return tl.sum(tl.reshape(t, [WARPS_K, t.shape[0] // WARPS_K]), axis=0)


@triton.jit
def fragment_tile(tx0, tx1, tx2, tx3, ty0, ty1, ty2, ty3, WARPS_N: tl.constexpr):
    """The summed C fragments [32 WARPS_N] as the program's [8, 32 WARPS_N] tile: a thread's
    column j of 4g..4g+3 (tx: j = 0, 1; ty: 2, 3) at rows 2c (tx0, tx2, ty0, ty2) and 2c + 1."""
    v = tl.join(tl.join(tl.join(tx0, tx1), tl.join(tx2, tx3)),
                tl.join(tl.join(ty0, ty1), tl.join(ty2, ty3)))  # (lane, row h, j % 2, j // 2)
    v = tl.reshape(v, [WARPS_N, 8, 4, 2, 2, 2])  # (wn, g, c, rh, jl, jh)
    return tl.reshape(tl.permute(v, [2, 3, 0, 1, 5, 4]), [8, 32 * WARPS_N])  # (c rh, wn g jh jl)


@triton.jit
def _w4a16_mma_kernel(xp_ptr, xg_ptr, qw_ptr, scales_ptr, biases_ptr, out_ptr, ws_ptr, ticket_ptr,
                      M, N, K, groups_per_split, stride_qw, stride_sg, stride_om, num_splits,
                      GROUP: tl.constexpr, WARPS_N: tl.constexpr, WARPS_K: tl.constexpr,
                      EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, QUADS: tl.constexpr,
                      USE_ASM: tl.constexpr, ROW_TILES: tl.constexpr = 1, PDL: tl.constexpr = False):
    """Thread (wn, wk, g, c) of the program: columns 4g..4g+3 of warp column tile wn (words 0, 1
    for one mma's A rows g, g + 8, words 2, 3 for the other's), word rows 16 G + 4t + c of its
    groups G = wk, wk + WARPS_K, ..., activation row g (B), output rows 2c, 2c + 1 (C). Rows past
    M read row M - 1 (their outputs are dropped); EVEN_N (N fills the column tiles) and EVEN_K
    (every warp's K range whole) leave the weight loads unmasked: a masked load zero-fills its
    registers first. QUADS 2: a thread also takes columns 32 further (a warp 64 columns), sharing
    its activation loads and group sums. ROW_TILES 2 or 4 (9-16 or 17-32 rows; QUADS 1): every A
    fragment also multiplies activation rows 8j + g into output rows 8j + 2c, 8j + 2c + 1 for
    row tiles j = 1.., so the words are read once for all rows. xp / xg: prep_pairs' scratch.
    PDL (kernels/pdl.py):
    waits for the previous grid first; lets the next launch after the K loop in mode LATE."""
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    g_start = pid_k * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, K // GROUP)
    L: tl.constexpr = 32 * WARPS_N * WARPS_K
    WPG: tl.constexpr = GROUP // 8  # word rows a group
    QW: tl.constexpr = 32 * QUADS  # columns a warp
    i = tl.arange(0, L)
    lane = i % 32
    wk = i // (32 * WARPS_N)
    g = lane // 4
    c = lane % 4
    col = pid_n * (QW * WARPS_N) + ((i // 32) % WARPS_N) * QW + 4 * g  # the thread's first column
    col_ok = (col[:, None] + tl.arange(0, 4)[None, :]) < N  # [L, 4]
    col_ok2 = (col[:, None] + (32 + tl.arange(0, 4))[None, :]) < N  # the second quad's
    if EVEN_N:
        col_ok = tl.full([L, 4], True, tl.int1)
        col_ok2 = col_ok
    n_groups = K // GROUP
    row0 = tl.minimum(2 * c, M - 1)
    row1 = tl.minimum(2 * c + 1, M - 1)
    x_row0 = tl.minimum(g, M - 1) * (K // 2)  # row tile 0's x row start, then (ROW_TILES 2+) 1-3's
    x_row1 = tl.minimum(8 + g, M - 1) * (K // 2)
    x_row2 = tl.minimum(16 + g, M - 1) * (K // 2)
    x_row3 = tl.minimum(24 + g, M - 1) * (K // 2)
    step_w = 4 * stride_qw  # 4 word rows
    z = tl.zeros([L], tl.float32)
    tx0, tx1, tx2, tx3, ty0, ty1, ty2, ty3 = z, z, z, z, z, z, z, z
    ux0, ux1, ux2, ux3, uy0, uy1, uy2, uy3 = z, z, z, z, z, z, z, z  # QUADS 2: the second quad
    vx0, vx1, vx2, vx3, vy0, vy1, vy2, vy3 = z, z, z, z, z, z, z, z  # ROW_TILES 2+: rows 8-15
    ax0, ax1, ax2, ax3, ay0, ay1, ay2, ay3 = z, z, z, z, z, z, z, z  # ROW_TILES 4: rows 16-23
    bx0, bx1, bx2, bx3, by0, by1, by2, by3 = z, z, z, z, z, z, z, z  # and 24-31
    for gb in range(g_start, g_end, WARPS_K):
        G = gb + wk
        ok = G < g_end
        if EVEN_K:
            ok = tl.full([L], True, tl.int1)
        w_offs = (G * WPG + c) * stride_qw + col  # int32: K / 8 x N < 2^31
        k_offs = 4 * (G * WPG + c)
        x_offs = x_row0 + k_offs
        dx0, dx1, dx2, dx3, dy0, dy1, dy2, dy3 = z, z, z, z, z, z, z, z
        ex0, ex1, ex2, ex3, ey0, ey1, ey2, ey3 = z, z, z, z, z, z, z, z
        rx0, rx1, rx2, rx3, ry0, ry1, ry2, ry3 = z, z, z, z, z, z, z, z  # row tile 1's
        fx0, fx1, fx2, fx3, fy0, fy1, fy2, fy3 = z, z, z, z, z, z, z, z  # 2's
        hx0, hx1, hx2, hx3, hy0, hy1, hy2, hy3 = z, z, z, z, z, z, z, z  # 3's
        for t in tl.static_range(WPG // 4):
            if ROW_TILES == 1:
                x0, x1, x2, x3 = load4(xp_ptr, x_offs + 16 * t, ok[:, None], False)
                dx0, dx1, dx2, dx3, dy0, dy1, dy2, dy3 = quad_step(
                    qw_ptr, w_offs + t * step_w, ok[:, None] & col_ok, x0, x1, x2, x3,
                    dx0, dx1, dx2, dx3, dy0, dy1, dy2, dy3, L // 32, USE_ASM)
            else:
                (pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3, pc0, pc1, pc2, pc3, pd0, pd1, pd2,
                 pd3) = word_frags(qw_ptr, w_offs + t * step_w, ok[:, None] & col_ok)
                dx0, dx1, dx2, dx3, dy0, dy1, dy2, dy3 = tile_mmas(
                    pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3, pc0, pc1, pc2, pc3, pd0, pd1, pd2, pd3, xp_ptr,
                    x_offs + 16 * t, ok[:, None], dx0, dx1, dx2, dx3, dy0, dy1, dy2, dy3, L // 32, USE_ASM)
                rx0, rx1, rx2, rx3, ry0, ry1, ry2, ry3 = tile_mmas(
                    pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3, pc0, pc1, pc2, pc3, pd0, pd1, pd2, pd3, xp_ptr,
                    x_row1 + k_offs + 16 * t, ok[:, None], rx0, rx1, rx2, rx3, ry0, ry1, ry2, ry3, L // 32,
                    USE_ASM)
                if ROW_TILES == 4:
                    fx0, fx1, fx2, fx3, fy0, fy1, fy2, fy3 = tile_mmas(
                        pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3, pc0, pc1, pc2, pc3, pd0, pd1, pd2, pd3, xp_ptr,
                        x_row2 + k_offs + 16 * t, ok[:, None], fx0, fx1, fx2, fx3, fy0, fy1, fy2, fy3,
                        L // 32, USE_ASM)
                    hx0, hx1, hx2, hx3, hy0, hy1, hy2, hy3 = tile_mmas(
                        pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3, pc0, pc1, pc2, pc3, pd0, pd1, pd2, pd3, xp_ptr,
                        x_row3 + k_offs + 16 * t, ok[:, None], hx0, hx1, hx2, hx3, hy0, hy1, hy2, hy3,
                        L // 32, USE_ASM)
            if QUADS == 2:
                ex0, ex1, ex2, ex3, ey0, ey1, ey2, ey3 = quad_step(
                    qw_ptr, w_offs + t * step_w + 32, ok[:, None] & col_ok2, x0, x1, x2, x3,
                    ex0, ex1, ex2, ex3, ey0, ey1, ey2, ey3, L // 32, USE_ASM)
        sum0, sum1, undo0, undo1 = group_factors(xg_ptr, row0, row1, n_groups, G, ok)
        tx0, tx1, tx2, tx3, ty0, ty1, ty2, ty3 = quad_totals(
            scales_ptr, biases_ptr, G * stride_sg + col, ok[:, None] & col_ok, undo0, undo1, sum0, sum1,
            dx0, dx1, dx2, dx3, dy0, dy1, dy2, dy3, tx0, tx1, tx2, tx3, ty0, ty1, ty2, ty3)
        s_offs, s_ok = G * stride_sg + col, ok[:, None] & col_ok
        if ROW_TILES >= 2:  # rows 8-15's totals, then (ROW_TILES 4) 16-23's and 24-31's
            vx0, vx1, vx2, vx3, vy0, vy1, vy2, vy3 = tile_totals(
                xg_ptr, 8, c, M, n_groups, G, ok, scales_ptr, biases_ptr, s_offs, s_ok,
                rx0, rx1, rx2, rx3, ry0, ry1, ry2, ry3, vx0, vx1, vx2, vx3, vy0, vy1, vy2, vy3)
        if ROW_TILES == 4:
            ax0, ax1, ax2, ax3, ay0, ay1, ay2, ay3 = tile_totals(xg_ptr, 16, c, M, n_groups, G, ok, scales_ptr,
                                                                 biases_ptr, s_offs, s_ok, fx0, fx1, fx2, fx3, fy0,
                                                                 fy1, fy2, fy3, ax0, ax1, ax2, ax3, ay0, ay1, ay2, ay3)
            bx0, bx1, bx2, bx3, by0, by1, by2, by3 = tile_totals(
                xg_ptr, 24, c, M, n_groups, G, ok, scales_ptr, biases_ptr, s_offs, s_ok, hx0, hx1, hx2, hx3, hy0, hy1,
                hy2, hy3, bx0, bx1, bx2, bx3, by0, by1, by2, by3)
        if QUADS == 2:
            ux0, ux1, ux2, ux3, uy0, uy1, uy2, uy3 = quad_totals(
                scales_ptr, biases_ptr, G * stride_sg + col + 32, ok[:, None] & col_ok2, undo0, undo1,
                sum0, sum1, ex0, ex1, ex2, ex3, ey0, ey1, ey2, ey3, ux0, ux1, ux2, ux3, uy0, uy1, uy2, uy3)
    part = tile_part(tx0, tx1, tx2, tx3, ty0, ty1, ty2, ty3, WARPS_N, WARPS_K)
    if QUADS == 2:  # each warp's 64 columns: its first quad's 32, then its second's
        part2 = tile_part(ux0, ux1, ux2, ux3, uy0, uy1, uy2, uy3, WARPS_N, WARPS_K)
        both = tl.join(tl.reshape(part, [8, WARPS_N, 32]), tl.reshape(part2, [8, WARPS_N, 32]))
        part = tl.reshape(tl.permute(both, [0, 1, 3, 2]), [8, 64 * WARPS_N])
    if ROW_TILES == 2:  # rows 0-7, then 8-15
        part_b = tile_part(vx0, vx1, vx2, vx3, vy0, vy1, vy2, vy3, WARPS_N, WARPS_K)
        part = tl.reshape(tl.permute(tl.join(part, part_b), [2, 0, 1]), [16, 32 * WARPS_N])
    if ROW_TILES == 4:  # [8, n, i, j] is row tile 2j + i
        part_b = tile_part(vx0, vx1, vx2, vx3, vy0, vy1, vy2, vy3, WARPS_N, WARPS_K)
        part_c = tile_part(ax0, ax1, ax2, ax3, ay0, ay1, ay2, ay3, WARPS_N, WARPS_K)
        part_d = tile_part(bx0, bx1, bx2, bx3, by0, by1, by2, by3, WARPS_N, WARPS_K)
        tiles4 = tl.join(tl.join(part, part_b), tl.join(part_c, part_d))
        part = tl.reshape(tl.permute(tiles4, [3, 2, 0, 1]), [32, 32 * WARPS_N])
    pdl_late(PDL)
    offs_m = tl.arange(0, 8 * ROW_TILES)
    offs_n = pid_n * (QW * WARPS_N) + tl.arange(0, QW * WARPS_N)
    store_or_reduce(part, out_ptr, ws_ptr, ticket_ptr + pid_n, pid_k, offs_m, offs_n, M, N, stride_om,
                    num_splits, REDUCE_VALUES, REDUCE_SLOTS)


@triton.jit
def _prep_kernel(x_ptr, xh_ptr, xg_ptr, res_ptr, nw_ptr, sum_ptr, normed_ptr, eps, M, K, stride_xm,
                 stride_rm, stride_sm, GROUP: tl.constexpr, NORM: tl.constexpr,
                 RESIDUAL: tl.constexpr, ACT_IN: tl.constexpr, NORM_CHUNK: tl.constexpr,
                 NORM_OUT: tl.constexpr, PDL: tl.constexpr = False):
    """Program (chunk, row): one row's PREP_VALUES values as prep_x_pairs' scratch in the
    row-major [M, 2, K / GROUP] group layout, so that a row's two planes are prep_x_pairs' one-row
    [2, K / GROUP]. One row a program: the norm's sum of squares is one trip over the row (all
    rows in each program took 4-5 L2 round trips: docs/BENCHMARKS.md 49.1)."""
    pdl_enter(PDL)  # x is the previous grid's output
    k_start = tl.program_id(0) * PREP_VALUES
    row = tl.program_id(1).to(tl.int64)
    x_ptr += row * stride_xm
    res_ptr += row * stride_rm
    sum_ptr += row * stride_sm
    normed_ptr += row * stride_sm
    xh_ptr += row * K
    xg_ptr += row * 2 * (K // GROUP)
    rstd = tl.zeros([1], tl.float32)
    if NORM:  # every program reads the whole row for its scale (a few KB from L2)
        rstd = row_rstd(x_ptr, res_ptr, 1, K, eps, stride_xm, stride_rm, 1, NORM_CHUNK, RESIDUAL)
    CHUNK_SEGS: tl.constexpr = max(1, PREP_VALUES // GROUP)
    prep_x_pairs(x_ptr, xh_ptr, xg_ptr, 1, K, stride_xm, k_start, tl.minimum(k_start + PREP_VALUES, K),
                 res_ptr, nw_ptr, sum_ptr, stride_rm, stride_sm, rstd, K, SEG=GROUP, BLOCK_M=1,
                 CHUNK_SEGS=CHUNK_SEGS, NORM=NORM, RESIDUAL=RESIDUAL, ACT_IN=ACT_IN, normed_ptr=normed_ptr,
                 NORM_OUT=NORM_OUT)


def mma_fits(m: int, w: W4Weight) -> bool:
    """Whether w4a16_mma takes this call: 1..MAX_ROWS rows, group 128 (4 steps of 4 word rows),
    no act-order permutation."""
    return 1 <= m <= MAX_ROWS and w.group_size == 128 and w.perm is None and w.qweight.dim() == 2


def empty_pairs(m: int, k: int, group: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch for m rows of k values as the kernel's pairs: ([m, k] fp16, [m, 2, k / group] fp32),
    for prep_pairs(out=) or a producer that writes them (gdn_recurrent's gated norm)."""
    return (torch.empty((m, k), dtype=torch.float16, device=device),
            torch.empty((m, 2, k // group), dtype=torch.float32, device=device))


def prep_pairs(x2: torch.Tensor, group: int, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
               residual: torch.Tensor | None = None, summed: torch.Tensor | None = None,
               act_in: str | None = None, normed: torch.Tensor | None = None,
               out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x2's rows as prep_x_pairs' scratch with one power of two a (row, group): (pairs [M, K]
    fp16, [M, 2, K / group] fp32: a row's sums, then its undo factors), one launch (a program
    per row and 512 values) that can also form the input as w4a16_h2's prologue does (the same
    arguments, checked there): RMSNorm(x2 (+ residual)) * norm_weight, storing x2 + residual
    in summed and the normalized rows in normed; act_in: x2 is [M, 2K] gate | up and the pairs
    are act(gate) * up. out: empty_pairs' scratch to write (else new)."""
    m = x2.shape[0]
    k = x2.shape[1] // 2 if act_in else x2.shape[1]
    if not 1 <= m <= MAX_ROWS or k % group or x2.stride(1) != 1 or act_in not in ACT_CODES \
            or (act_in and norm_weight is not None) or (residual is not None) != (summed is not None) \
            or (residual is not None and norm_weight is None) or (normed is not None and norm_weight is None):
        raise ValueError(f"w4a16_mma pairs: x {tuple(x2.shape)} (1..{MAX_ROWS} row-contiguous rows, K a "
                         f"multiple of {group}), norm {norm_weight is not None}, residual "
                         f"{residual is not None}, summed {summed is not None}, act_in {act_in}")
    xh, xg = out if out is not None else empty_pairs(m, k, group, x2.device)
    if xh.shape != (m, k) or xg.shape != (m, 2, k // group) or not (xh.is_contiguous() and xg.is_contiguous()):
        raise ValueError(f"w4a16_mma pairs: scratch {tuple(xh.shape)} / {tuple(xg.shape)} for {m} rows "
                         f"of {k}")
    res = residual if residual is not None else x2
    sums = summed if summed is not None else (normed if normed is not None else x2)
    _prep_kernel[(triton.cdiv(k, PREP_VALUES), m)](
        x2, xh, xg, res, norm_weight if norm_weight is not None else x2, sums,
        normed if normed is not None else x2, float(eps), m, k, x2.stride(0), res.stride(0), sums.stride(0),
        GROUP=group, NORM=norm_weight is not None, RESIDUAL=residual is not None,
        ACT_IN=ACT_CODES[act_in], NORM_CHUNK=norm_chunk(k, 1) if norm_weight is not None else 1,
        NORM_OUT=normed is not None, num_warps=4, **pdl_args(x2.device))
    return xh, xg


def split_for(n_blocks: int, n_groups: int, tiles: MmaTiles, device: torch.device) -> tuple[int, int]:
    """(K splits across programs, groups a split): tiles.split, else enough programs for
    tiles.waves an SM; where one is near, a split whose programs' warps all get whole K ranges
    (EVEN_K: groups a split a multiple of warps_k, dividing the groups)."""
    if tiles.split:
        want = tiles.split
    else:
        want = max(1, min((device_sms(device) * tiles.waves) // max(1, n_blocks), n_groups // tiles.warps_k, 16))
    want = max(1, min(want, n_groups))
    even = [s for s in range(1, n_groups + 1)
            if n_groups % s == 0 and (n_groups // s) % tiles.warps_k == 0 and want / 2 <= s <= want * 3 / 2]
    if even and not tiles.split:
        split = min(even, key=lambda s: (abs(s - want), s))
    else:
        split = want
    per = -(-n_groups // split)
    return -(-n_groups // per), per


def w4a16_mma(x2: torch.Tensor, w: W4Weight, out: torch.Tensor, tiles: MmaTiles | None = None,
              pairs: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """out[M, N] = x2[M, K] @ W for 1..32 rows (x2 bf16/fp16 row-contiguous, out [M, N]
    row-contiguous). pairs: x2 already prepared (prep_pairs), else prepared by a launch of its
    own."""
    m, k = x2.shape
    n = w.out_features
    if not mma_fits(m, w) or k != w.in_features or x2.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"w4a16_mma: x {tuple(x2.shape)}, weight {tuple(w.qweight.shape)} group "
                         f"{w.group_size} (1..{MAX_ROWS} rows, group 128, no act-order, row-contiguous x and out)")
    t = tiles or mma_tiles(n, k, x2.device, m)
    row_tiles = 1 if m <= 8 else (2 if m <= 16 else 4)
    if row_tiles > 1 and t.quads != 1:
        t = dataclasses.replace(t, quads=1)  # a thread's registers: two row tiles or two quads
    xh, xg = pairs if pairs is not None else prep_pairs(x2, w.group_size)
    n_blocks = triton.cdiv(n, t.block_n)
    n_groups = k // w.group_size
    split, per = split_for(n_blocks, n_groups, t, x2.device)
    ws = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x2.device)
    _w4a16_mma_kernel[(n_blocks, split)](
        xh.view(torch.int32), xg, w.qweight, w.scales, w.biases, out, ws,
        ticket_buffer(x2.device, n_blocks), m, n, k, per, w.qweight.stride(0), w.scales.stride(0),
        out.stride(0), split, GROUP=w.group_size, WARPS_N=t.warps_n, WARPS_K=t.warps_k,
        EVEN_N=n % t.block_n == 0, EVEN_K=n_groups % per == 0 and per % t.warps_k == 0,
        QUADS=t.quads, USE_ASM=uses_ptx(x2.device), ROW_TILES=row_tiles, num_warps=t.warps_n * t.warps_k,
        **pdl_args(x2.device, "mma"))
    return out
