"""W4A16 decode GEMV in packed half math (M = 1..8 rows): ~1.1 instructions per weight at 1 row.

Why (issue 19): the fp32 GEMVs (w4a16_gemv.py, w4a16_rows.py) spend ~3 instructions per weight
on the nibble (AND-OR, subtract, FMA), with the integer op at half rate on sm_90, and read only
34-45% of the copy rate at batch 1. Here (w4a16_half2.py has the arithmetic) one shift and four
LOP3s turn a word into four exact fp16 pairs (q_j, q_j+4) (subnormals: the powers of two go into
the activations), and each pair costs one fma.rn.f16x2 per activation row: 9 instructions per
word (8 weights) at 1 row, plus 4 per extra row. The activations come pre-scaled and paired:

  prologue  each program converts its own K range of x (whole K steps) into fp16 pairs scaled
            by 2^-e per (row, K step), plus each step's sum of x and 2^e (prep_x_pairs), into a
            small scratch buffer [M, K] fp16 + [2, M, K / BLOCK_K] fp32; programs that share a K
            range write identical bits. A barrier, then every thread reads the pairs as uniform
            loads.
  main loop per K step (8 * WROWS values of k inside one group): one [WROWS, BLOCK_N] load of
            words (each thread all word rows of its columns), fp16x2 products chained per word
            and summed over word rows in-thread, then in fp32
            acc += inner * 2^e * scale + sum_k(x) * bias (W = q s + b within a group).

The prologue can also form its input from the ops before the linear (w4a16_prologue.py): the
RMSNorm (with the residual add) of a pre-norm layer, or the SiLU-and-mul of a gated MLP, so
those kernels are not launched at batch 1.

Thin matrices split K across programs exactly like w4a16_rows.py (the fp32 partials reduced by
the last program of each column block: w4a16_gemv.store_or_reduce). K ranges are whole steps
(each step's 2^e is computed by whichever programs cover it, identically). Tiles: the arch
table's w4a16_h2 entry (tuning.RowsTiles: block_n = 4 x 32 x warps x columns-per-thread/4).

With the register prefetch, a program whose K range is one prep chunk issues every prologue
load (the norm's row, its own inputs) before its first step's words (LOADS_FIRST): loads issued
behind 16-32 KB of words in flight arrived only with them. The split-K epilogue sums up to 16
slots in one round trip (REDUCE_VALUES, REDUCE_SLOTS). Both: 8B W4A16 batch 1 442.9 -> 453.4
tok/s on the H200 (docs/BENCHMARKS.md 33.2-33.3).

Calls whose K fits one program (RowsTiles.whole_k: tuning.whole_k_fits) can split K inside
the program instead: its threads form lane_groups() groups, each streaming its own K range of
the program's 32-128 columns, summed once in shared memory (lanes_loop), with each program
forming its own copy of the whole K's pairs in one trip masked past K. That drops the split-K
tail (1.7-3.9 us a call) for a prologue over all of K: Llama-3.1-8B W4A16 batch 1 453.9 ->
464.4 tok/s, Qwen3-30B-A3B 411.1 -> 426.6 (docs/BENCHMARKS.md 34); with 32-column programs for
outputs of at most 4,096 columns (twice the programs) and both words of a two-step range
requested before the prologue, 465.5 -> 475.3 and 427.7 -> 446.1 (35).

A decode step reads every weight once, so the words, scales and biases are loaded evict_first:
the L2 keeps what the step does reuse (activations, the scratch pairs, split-K partials, the KV
cache). Llama-3.1-8B W4A16 batch 1 on the H200: 433.2 -> 442-443 tok/s (docs/BENCHMARKS.md 32.2).

Invariants: qweight [K // 8, N] int32, K a multiple of the group size, BLOCK_M = next pow2 >= M
(padding rows read row M - 1, their results are dropped), 8 * WROWS <= group size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.common import next_pow2
from homelab_llm.engine.kernels import program_trace
from homelab_llm.engine.kernels.l2_next import next_plan, picked_plan, prefetch_next
from homelab_llm.engine.kernels.pdl import pdl_args, pdl_enter, pdl_late
from homelab_llm.engine.kernels.program_trace import stamp, trace_begin, trace_clock
from homelab_llm.engine.kernels.tuning import THIN_N, RowsTiles, h2_tiles, uses_ptx, whole_k_fits
from homelab_llm.engine.kernels.w4a16_gemv import store_or_reduce, ticket_buffer
from homelab_llm.engine.kernels.w4a16_half2 import (chunk_coords, l2_prefetch, prep_x_pairs,
                                                    rows_sum, store_x_pairs, tile_dot,
                                                    word_products)
from homelab_llm.engine.kernels.w4a16_pack import W4Weight
from homelab_llm.engine.kernels.w4a16_prologue import (ACT_CODES, input_from_loads, input_loads,
                                                       norm_chunk, row_parts, row_rstd,
                                                       rstd_of_parts)
from homelab_llm.engine.kernels.w4a16_rows import split_plan
from homelab_llm.engine.kernels.work_queue import wait_count

REDUCE_VALUES, REDUCE_SLOTS = tl.constexpr(16384), tl.constexpr(16)
CHUNK_VALUES = 512  # K values a prep_x_pairs chunk covers (CHUNK_SEGS steps)
MAX_ROWS = 8  # each row costs one packed FMA per two weights; more rows belong to w4a16_dot.py


@triton.jit
def load_words(w_tile, offset, n_mask, EVEN_N: tl.constexpr):
    """One K step's [1, WROWS, BLOCK_N] packed words; unmasked when N fills the column blocks (a
    masked load zero-fills its registers first: one extra move per two words)."""
    if EVEN_N:
        return tl.load(w_tile + offset, eviction_policy="evict_first")
    return tl.load(w_tile + offset, mask=n_mask[None, None, :], other=0,
                   eviction_policy="evict_first")


@triton.jit
def first_words(w_tile, k_first, stride_qw, n_mask, WROWS: tl.constexpr, EVEN_N: tl.constexpr,
                TWO_STEPS: tl.constexpr):
    """The first step's words, and with TWO_STEPS (a two-step whole-K range) the second's too
    (else the first's again): both requested before the prologue."""
    words = load_words(w_tile, k_first, n_mask, EVEN_N)
    words_b = words
    if TWO_STEPS:
        words_b = load_words(w_tile, k_first + WROWS * stride_qw, n_mask, EVEN_N)
    return words, words_b


@triton.jit
def group_terms(scales_ptr, biases_ptr, g_off, n_mask, EVEN_N: tl.constexpr):
    """A K step's scales and biases (fp32) at g_off (columns last); unmasked when N fills the
    column blocks (a masked load zero-fills its registers first)."""
    if EVEN_N:
        s = tl.load(scales_ptr + g_off, eviction_policy="evict_first")
        b = tl.load(biases_ptr + g_off, eviction_policy="evict_first")
    else:
        s = tl.load(scales_ptr + g_off, mask=n_mask, other=0.0, eviction_policy="evict_first")
        b = tl.load(biases_ptr + g_off, mask=n_mask, other=0.0, eviction_policy="evict_first")
    return s.to(tl.float32), b.to(tl.float32)


@triton.jit
def lane_word_rows(k_start, k_per_lane, WROWS: tl.constexpr, KSPLIT: tl.constexpr):
    """The word rows of a whole-K program's first step, [WROWS * KSPLIT]: row w * KSPLIT + g is
    word row w of thread group g's K range (k_start + g * k_per_lane onwards)."""
    r = tl.arange(0, WROWS * KSPLIT)
    return k_start // 8 + (r % KSPLIT) * (k_per_lane // 8) + r // KSPLIT


@triton.jit
def lane_step(words, scales_ptr, biases_ptr, xp_rows, xg_rows, k0, offs_n, n_mask, M, n_segs,
              stride_sg, GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              WROWS: tl.constexpr, KSPLIT: tl.constexpr, EVEN_N: tl.constexpr,
              USE_ASM: tl.constexpr):
    """One whole-K step at the groups' K offsets k0 [KSPLIT]: [BLOCK_M, KSPLIT, BLOCK_N] fp32
    (W = q s + b within a group: inner * 2^e * s + sum(x) * b). xp_rows: the step's pairs."""
    BLOCK_K: tl.constexpr = WROWS * 8
    seg = (k0 // BLOCK_K)[None, :, None]
    g_off = (k0 // GROUP_SIZE)[:, None] * stride_sg + tl.max_contiguous(offs_n, 4)[None, :]
    s, b = group_terms(scales_ptr, biases_ptr, g_off, n_mask[None, :], EVEN_N)
    x_sum = tl.load(xg_rows + seg)
    undo = tl.load(xg_rows + M * n_segs + seg)
    part = word_products(words, xp_rows, USE_ASM)  # [BM, WROWS * KSPLIT, BN]
    inner = rows_sum(tl.reshape(part, [BLOCK_M, WROWS, KSPLIT, BLOCK_N]), 1, USE_ASM)
    return inner * undo * s[None, :, :] + x_sum * b[None, :, :]


@triton.jit
def lanes_loop(words, words_b, w_tile, scales_ptr, biases_ptr, xp_ptr, xg_ptr, row, lane_rows,
               k_start, k_per_lane, offs_n, n_mask, M, K, stride_qw, stride_sg,
               GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               WROWS: tl.constexpr, KSPLIT: tl.constexpr, EVEN_N: tl.constexpr,
               USE_ASM: tl.constexpr, TWO_STEPS: tl.constexpr):
    """The K loop of a program that covers all of K (KSPLIT > 1): thread group g takes k in
    [k_start + g k_per_lane, + k_per_lane), whole steps; [BLOCK_M, BLOCK_N] fp32 summed over the
    groups once, through shared memory, where a K split across programs pays a store, a fence
    and ticket and the slots' loads (the split-K tail, 1.7-3.9 us a call on the 8B:
    docs/BENCHMARKS.md 33.2). words: the first step's [1, WROWS * KSPLIT, BLOCK_N] tile (the
    register prefetch: each step requests the next one's before its math), lane_rows its word
    rows (lane_word_rows), w_tile [1, 1, BLOCK_N] pointers; row [BLOCK_M, 1]. TWO_STEPS: the
    range is two steps and words_b is the second's, requested with the first before the
    prologue (in the loop each step after the first waits a DRAM round trip for its words).

    The tile is 2-D in (word row, column) so that every Triton orders its threads the same way:
    columns, then rows, whose layout repeats every KSPLIT rows, so each thread holds all WROWS
    rows of one group in registers (a 4-D [.., WROWS, KSPLIT, ..] tile was laid out with the
    word rows across threads by Triton 3.6's ordering of equal-contiguity axes). The products
    are then viewed as [BLOCK_M, WROWS, KSPLIT, BLOCK_N] and summed over the word rows in-thread."""
    BLOCK_K: tl.constexpr = WROWS * 8
    n_segs = K // BLOCK_K
    xp_rows = xp_ptr + row[:, :, None].to(tl.int64) * (K // 2) + 4 * lane_rows[None, :, None]
    xg_rows = xg_ptr + row[:, :, None] * n_segs  # [BM, 1, 1]
    lane_k = k_start + tl.arange(0, KSPLIT) * k_per_lane  # [KSPLIT]
    if TWO_STEPS:
        acc = lane_step(words, scales_ptr, biases_ptr, xp_rows, xg_rows, lane_k, offs_n, n_mask, M,
                        n_segs, stride_sg, GROUP_SIZE, BLOCK_M, BLOCK_N, WROWS, KSPLIT, EVEN_N,
                        USE_ASM)
        acc += lane_step(words_b, scales_ptr, biases_ptr, xp_rows + BLOCK_K // 2, xg_rows,
                         lane_k + BLOCK_K, offs_n, n_mask, M, n_segs, stride_sg, GROUP_SIZE,
                         BLOCK_M, BLOCK_N, WROWS, KSPLIT, EVEN_N, USE_ASM)
    else:
        acc = tl.zeros([BLOCK_M, KSPLIT, BLOCK_N], tl.float32)
        for i in range(0, k_per_lane, BLOCK_K):
            i_next = tl.minimum(i + BLOCK_K, k_per_lane - BLOCK_K)  # the last step re-requests itself
            words_next = load_words(w_tile, ((lane_rows + i_next // 8) * stride_qw)[None, :, None],
                                    n_mask, EVEN_N)
            acc += lane_step(words, scales_ptr, biases_ptr, xp_rows + i // 2, xg_rows, lane_k + i,
                             offs_n, n_mask, M, n_segs, stride_sg, GROUP_SIZE, BLOCK_M, BLOCK_N,
                             WROWS, KSPLIT, EVEN_N, USE_ASM)
            words = words_next
    return tl.sum(acc, axis=1)


@triton.jit
def w4a16_h2_kernel(
    x_ptr, qw_ptr, scales_ptr, biases_ptr, out_ptr, ws_ptr, ticket_ptr, xh_ptr, xp_ptr, xg_ptr,
    res_ptr, nw_ptr, sum_ptr, normed_ptr, eps, trace_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_qw, stride_sg, stride_om, stride_rm, stride_sm,
    num_splits,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WROWS: tl.constexpr,
    CHUNK_SEGS: tl.constexpr, EVEN_N: tl.constexpr, PREFETCH: tl.constexpr, USE_ASM: tl.constexpr,
    LOOP_STAGES: tl.constexpr, PREFETCH_L2: tl.constexpr,
    NORM: tl.constexpr, RESIDUAL: tl.constexpr, ACT_IN: tl.constexpr, NORM_CHUNK: tl.constexpr,
    NORM_OUT: tl.constexpr = False, PDL: tl.constexpr = False, TRACE: tl.constexpr = False,
    LOADS_FIRST: tl.constexpr = False, KSPLIT: tl.constexpr = 1, TWO_STEPS: tl.constexpr = False,
    pick_ptr=None, pick_w_ptr=None, stride_we=0, stride_se=0, stride_xp=0, stride_op=0,
    picks_k=1, x_div=1, add_ptr=None, add_w_ptr=None, stride_add=0,
    PICKS: tl.constexpr = False, PICKS_SUM: tl.constexpr = False, PICKS_ADD: tl.constexpr = False,
    nx_w_ptr=None, nx_s_ptr=None, nx_b_ptr=None, nx_w_count=0, nx_w_per=1, nx_w_stride=1, nx_w_last=0,
    nx_g_count=0, nx_g_per=1, nx_g_stride=1, nx_g_last=0, NEXT_LINES: tl.constexpr = 0,
    nx_stride_we=0, nx_stride_se=0, nx_stride_be=0, NEXT_PICKED: tl.constexpr = False,
    item_n=0, item_k=0, item_cols=0, ready_ptr=None, ready_count=0, ITEM: tl.constexpr = False,
    READY: tl.constexpr = False, READY_SLEEP: tl.constexpr = 0,
):
    """A grid of programs, each column block program_id(0) of num_programs(0) and K split (or
    pick) program_id(1); or (ITEM) one such program, column block item_n of item_cols and split
    or pick item_k, as an item of fused_moe_queue.py's work queue, where READY waits (after the
    first words are requested; work_queue.wait_count with READY_SLEEP) until ready_ptr's count
    reaches ready_count, i.e. until the items that write this one's inputs are done."""
    if ITEM:
        pid_n = item_n
        pid_k = item_k
        n_cols = item_cols
    else:
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        n_cols = tl.num_programs(0)
    t_start = trace_clock(pid_n, TRACE)  # program_trace: marks 3-5 end the prologue, loop, program;
    # 6 the norm's row scale
    BLOCK_K: tl.constexpr = WROWS * 8
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    if PICKS:  # MoE experts (Picks): axis 1 is the pick (token t's k-th: t * picks_k + k), all of K
        k_start = 0
        k_end = K
    else:
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
    wr3 = tl.arange(0, WROWS)[None, :, None]
    if KSPLIT > 1:
        # whole K in one program: KSPLIT groups of its threads take KSPLIT equal K ranges; a
        # step's [1, WROWS * KSPLIT, BLOCK_N] tile holds word row w of group g at row
        # w * KSPLIT + g (lanes_loop). It forms its own copy of the pairs: with all programs
        # writing one shared copy, a call took 0.8-1.0 us a program (H200, the 8B's qkv: 76 us)
        copy = pid_n + pid_k * n_cols if PICKS else pid_n  # a pick's row its own
        xh_ptr += copy * (M * K)
        xp_ptr += copy * (M * (K // 2))
        xg_ptr += copy * (2 * M * (K // BLOCK_K))
        k_per_lane = (k_end - k_start) // KSPLIT
        lane_rows = lane_word_rows(k_start, k_per_lane, WROWS, KSPLIT)
        k_first = (lane_rows * stride_qw)[None, :, None]
        w_tile = qw_ptr + offs_n[None, None, :]  # [1, 1, BLOCK_N]
    else:
        k_first = k_start // 8 * stride_qw
        w_tile = qw_ptr + wr3 * stride_qw + offs_n[None, None, :]  # [1, WROWS, BLOCK_N]
    if PREFETCH and not LOADS_FIRST and not PICKS:
        # The first step's words are requested before the prologue, so its latency hides
        # theirs; then each step requests the next one's before its math (register double buffer).
        words, words_b = first_words(w_tile, k_first, stride_qw, n_mask, WROWS, EVEN_N, TWO_STEPS)
    if PREFETCH_L2 and not PICKS:
        # one request per 128-byte line of the first step's words (32 columns of each word row)
        lines = pid_n * BLOCK_N + tl.arange(0, (BLOCK_N + 31) // 32) * 32
        l2_prefetch(qw_ptr + (k_start // 8 + tl.arange(0, WROWS))[:, None] * stride_qw
                    + tl.minimum(lines, N - 1)[None, :])
    # with PDL the words above are requested while the previous kernel drains; its outputs (x,
    # the residual) and the shared scratch and tickets are touched only after this
    pdl_enter(PDL)
    if PICKS:
        # the pick's expert (the router's, an earlier grid's output): its weights and input row
        e = tl.load(pick_ptr + pid_k).to(tl.int64)
        w_tile += e * stride_we
        scales_ptr += e * stride_se
        biases_ptr += e * stride_se
        x_ptr += (pid_k // x_div) * stride_xp  # the token's row, or the pick's own
        if PREFETCH and not LOADS_FIRST:
            words, words_b = first_words(w_tile, k_first, stride_qw, n_mask, WROWS, EVEN_N,
                                         TWO_STEPS)
    if READY:  # a work queue's item (fused_moe_queue.py): its inputs are written in this grid
        wait_count(ready_ptr, ready_count, READY_SLEEP)
    trace = trace_begin(trace_ptr, t_start, TRACE)
    rstd = tl.zeros([BLOCK_M], tl.float32)
    # column block 0's programs (all K splits) store the summed (and normalized) input, once
    # per element
    sum_limit = tl.where(pid_n == 0, K, 0)
    if LOADS_FIRST:
        # Every load of the prologue goes out ahead of the first words: issued behind 16-32 KB
        # of them (DRAM), the row and the program's own inputs (L2) arrived only with them, and
        # the prologue took 1.5-2.8 us (docs/BENCHMARKS.md 33.2). One chunk: k_start's.
        if NORM:
            x_row, r_row = row_parts(x_ptr, res_ptr, M, K, stride_xm, stride_rm, BLOCK_M,
                                     NORM_CHUNK, RESIDUAL)
        rows_c, k_c, ok_c = chunk_coords(k_start, k_end, M, BLOCK_K, BLOCK_M, CHUNK_SEGS)
        in_a, in_b, in_w = input_loads(x_ptr, res_ptr, nw_ptr, rows_c, k_c, ok_c, K, stride_xm,
                                       stride_rm, NORM, RESIDUAL, ACT_IN)
        words, words_b = first_words(w_tile, k_first, stride_qw, n_mask, WROWS, EVEN_N, TWO_STEPS)
        if NORM:
            rstd = rstd_of_parts(x_row, r_row, K, eps, RESIDUAL)
            stamp(trace, 6, TRACE)
        x_in = input_from_loads(in_a, in_b, in_w, sum_ptr, normed_ptr, rows_c, k_c, ok_c, stride_sm,
                                rstd[:, None, None], sum_limit, NORM, RESIDUAL, ACT_IN, NORM_OUT)
        store_x_pairs(x_in, k_c, ok_c, k_start, xh_ptr, xg_ptr, M, K, k_end, BLOCK_K, BLOCK_M,
                      CHUNK_SEGS)
    else:
        if NORM:  # the norm's scale needs the whole row: every program reads it (L2 hits)
            rstd = row_rstd(x_ptr, res_ptr, M, K, eps, stride_xm, stride_rm, BLOCK_M, NORM_CHUNK,
                            RESIDUAL)
            stamp(trace, 6, TRACE)
        prep_x_pairs(x_ptr, xh_ptr, xg_ptr, M, K, stride_xm, k_start, k_end,
                     res_ptr, nw_ptr, sum_ptr, stride_rm, stride_sm, rstd, sum_limit,
                     SEG=BLOCK_K, BLOCK_M=BLOCK_M, CHUNK_SEGS=CHUNK_SEGS, NORM=NORM,
                     RESIDUAL=RESIDUAL, ACT_IN=ACT_IN, normed_ptr=normed_ptr, NORM_OUT=NORM_OUT)
    tl.debug_barrier()  # the program's own pairs are written before any thread reads them
    stamp(trace, 3, TRACE)
    n_segs = K // BLOCK_K
    row = tl.minimum(offs_m, M - 1)[:, None]  # [BLOCK_M, 1]; padding rows repeat row M - 1
    if KSPLIT > 1:
        acc = lanes_loop(words, words_b, w_tile, scales_ptr, biases_ptr, xp_ptr, xg_ptr, row, lane_rows,
                         k_start, k_per_lane, offs_n, n_mask, M, K, stride_qw, stride_sg, GROUP_SIZE,
                         BLOCK_M, BLOCK_N, WROWS, KSPLIT, EVEN_N, USE_ASM, TWO_STEPS)
    else:
        xp_rows = xp_ptr + row[:, :, None].to(tl.int64) * (K // 2) + 4 * wr3  # [BM, WROWS, 1]
        xg_rows = xg_ptr + row * n_segs
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        # LOOP_STAGES > 1: the compiler streams the words through shared memory (cp.async),
        # stages in flight without holding registers; 1: plain loads (with PREFETCH, a register
        # double buffer)
        for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=LOOP_STAGES):
            if PREFETCH:
                # The last step re-requests itself (unmasked; the bytes are still in L2).
                k_next = tl.minimum(k0 + BLOCK_K, k_end - BLOCK_K)
                words_next = load_words(w_tile, k_next // 8 * stride_qw, n_mask, EVEN_N)
            else:
                words = load_words(w_tile, k0 // 8 * stride_qw, n_mask, EVEN_N)
            seg = k0 // BLOCK_K
            # 4 columns per vector, as the words (16 bytes): 8 would need a shared-memory shuffle
            g_off = (k0 // GROUP_SIZE) * stride_sg + tl.max_contiguous(offs_n, 4)
            s, b = group_terms(scales_ptr, biases_ptr, g_off, n_mask, EVEN_N)
            x_sum = tl.load(xg_rows + seg)
            undo = tl.load(xg_rows + M * n_segs + seg)
            inner = tile_dot(words, xp_rows + k0 // 2, USE_ASM)
            acc += inner * undo * s[None, :] + x_sum * b[None, :]
            if PREFETCH:
                words = words_next
    stamp(trace, 4, TRACE)
    pdl_late(PDL)
    if NEXT_PICKED:  # this pick's share of its own expert in the next call's experts (l2_next)
        prefetch_next(pid_n, nx_w_ptr + e * nx_stride_we, nx_s_ptr + e * nx_stride_se,
                      nx_b_ptr + e * nx_stride_be, nx_w_count, nx_w_per, nx_w_stride, nx_w_last,
                      nx_g_count, nx_g_per, nx_g_stride, nx_g_last, NEXT_LINES)
    elif NEXT_LINES > 0:  # the program's own loads are out: ask the L2 for the next linear's (l2_next)
        prefetch_next(pid_n + pid_k * n_cols, nx_w_ptr, nx_s_ptr, nx_b_ptr, nx_w_count,
                      nx_w_per, nx_w_stride, nx_w_last, nx_g_count, nx_g_per, nx_g_stride, nx_g_last,
                      NEXT_LINES)
    slot = pid_k  # the split-K epilogue's slot
    if PICKS:
        if PICKS_SUM:  # a token's picks summed (weighted) through the epilogue's slots, in order
            token = pid_k // picks_k
            slot = pid_k % picks_k
            acc *= tl.load(pick_w_ptr + pid_k)
            if PICKS_ADD:  # a gated shared expert's row rides in the token's first slot
                if slot == 0:
                    add = tl.load(add_ptr + token * stride_add + offs_n, mask=n_mask,
                                  other=0.0).to(tl.float32)
                    acc += tl.load(add_w_ptr + token) * add[None, :]
            out_ptr += token * stride_op
            ws_ptr += token * (picks_k * N)  # the token's [picks_k, 1, N] slots
            ticket_ptr += token * n_cols
        else:  # each pick its own output row
            out_ptr += pid_k * stride_op
    store_or_reduce(acc, out_ptr, ws_ptr, ticket_ptr + pid_n, slot, offs_m, offs_n, M, N, stride_om,
                    num_splits, REDUCE_VALUES, REDUCE_SLOTS)
    stamp(trace, 5, TRACE)


def two_steps(tiles: RowsTiles, k: int, block_k: int) -> bool:
    """Whether a whole-K call's two steps both request their words before the prologue: where
    K is two steps a lane group and the program has at most 8 warps (H200: the 30B-A3B's qkv
    4.33 -> 3.93 us; with 16 warps, 128 registers a thread, it lost up to 0.9 us)."""
    return tiles.whole_k and k == 2 * tiles.lane_groups() * block_k and tiles.num_warps <= 8


def loads_first(tiles: RowsTiles, m: int, k: int, k_per_split: int, norm: bool, pdl: dict,
                chunk_values: int = CHUNK_VALUES) -> bool:
    """Whether a call issues its prologue's loads (the norm's row, its own K range's inputs)
    ahead of its first words (LOADS_FIRST): tiles that request those words in the prologue, a
    K range of one prep chunk (chunk_values) and a norm row of one trip, and no early launch (an
    early-launched grid requests its words ahead of its PDL wait instead)."""
    return (tiles.prefetch and k_per_split <= chunk_values
            and (not norm or norm_chunk(k, next_pow2(m)) >= k) and not pdl.get("launch_pdl", False))


@dataclass(frozen=True)
class Picks:
    """T tokens' experts for w4a16_h2 over MoE weights (a W4Weight whose tensors carry a leading
    E dim: qweight [E, K // 8, N]): ids int32 [T, P] on the device (a graph replays them), pick
    (t, p) the program column t * P + p; weights fp32 [T, P]: out [T, N], row t = sum_p
    weights[t, p] x_tp W_ids[t, p], summed in pick order through the split-K epilogue
    (deterministic, and a token's row the same in any batch), or None: out [T * P, N], row
    t * P + p = x_tp W_ids[t, p]. x_tp is row t * P + p of x2 (x2 [T * P, K], or [T * P, 2K]
    with act_in) or, with token_x, x2's row t (x2 [T, K]). add (with weights): (rows [T, N],
    gates fp32 [T]) whose gate * row joins token t's sum (a gated shared expert's output, as
    moe_ref.add_shared_ref adds it)."""

    ids: torch.Tensor
    weights: torch.Tensor | None = None
    token_x: bool = False
    add: tuple[torch.Tensor, torch.Tensor] | None = None
    # the experts (qweight [E, ...]) of the next call: each pick's programs ask the L2 for their
    # share of its own expert there (l2_next.picked_plan; gate_up's for down's)
    next_experts: W4Weight | None = None


def picks_check(x2: torch.Tensor, w: W4Weight, out: torch.Tensor, picks: Picks,
                t: RowsTiles) -> None:
    """ValueError unless the call fits w4a16_h2's picks form (whole-K tiles, shapes)."""
    ids = picks.ids
    tokens, p = ids.shape if ids.dim() == 2 else (0, 0)
    rows = tokens if picks.token_x else tokens * p
    n = w.qweight.shape[-1]
    want_out = (tokens, n) if picks.weights is not None else (tokens * p, n)
    add = picks.add
    if (w.qweight.dim() != 3 or w.perm is not None or ids.dim() != 2 or not ids.is_contiguous()
            or x2.shape[0] != rows or tuple(out.shape) != want_out or ids.dtype != torch.int32
            or x2.stride(-1) != 1 or out.stride(-1) != 1
            or (picks.weights is not None and (picks.weights.dtype != torch.float32
                                               or picks.weights.shape != ids.shape
                                               or not picks.weights.is_contiguous()))
            or not whole_k_fits(t, w.qweight.shape[-2] * 8, w.group_size) or not 0 < p <= REDUCE_SLOTS
            or (add is not None and (picks.weights is None or add[0].shape != want_out
                                     or add[0].stride(-1) != 1 or add[1].dtype != torch.float32
                                     or add[1].shape != (tokens,)))):
        raise ValueError(f"w4a16_h2 picks: ids {ids.dtype} {tuple(ids.shape)} (int32 [T, P], P at "
                         f"most {REDUCE_SLOTS}; fp32 weights the same), x {tuple(x2.shape)} "
                         f"({rows} rows), out {tuple(out.shape)} (want {want_out}; added rows "
                         f"the same, with a summed call and fp32 gates [T]), qweight "
                         f"{tuple(w.qweight.shape)} [E, K // 8, N] without act-order, tiles {t} "
                         f"(whole-K tiles that fit K, group {w.group_size})")


def w4a16_h2(x2: torch.Tensor, w: W4Weight, out: torch.Tensor, tiles: RowsTiles | None = None,
             split: int | None = None, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
             residual: torch.Tensor | None = None, summed: torch.Tensor | None = None,
             act_in: str | None = None, normed: torch.Tensor | None = None,
             picks: Picks | None = None) -> torch.Tensor:
    """out[M, N] = x2[M, K] @ W for 1..MAX_ROWS rows; x2 already permuted (act-order) and
    row-contiguous (bf16 or fp16), out [M, N] row-contiguous. tiles: the arch table's entry for
    M rows and N columns unless given (the sweep passes variants); split: K splits (None: rows_split).

    Prologue forms (w4a16_prologue.py; none with act-order): norm_weight: the GEMV reads
    RMSNorm(x2 (+ residual)) * norm_weight (eps its epsilon), and with a residual stores x2 +
    residual into `summed` ([M, K], x2's dtype, not aliasing x2 or residual); normed (with the
    norm; a new [M, K] tensor shaped and strided as summed): also store the normalized rows
    there, for other linears that read the same norm; act_in ("silu" or "gelu_tanh"): x2 is
    [M, 2K] gate | up and the GEMV reads act(gate) * up.

    picks (Picks, with whole-K tiles, no norm): W holds experts, and each pick's row goes
    through its own expert, one program column per pick, one row a program."""
    if picks is not None:
        if norm_weight is not None or residual is not None or summed is not None \
                or normed is not None or tiles is None:
            raise ValueError("w4a16_h2 picks: the caller's whole-K tiles, no norm or residual "
                             "prologue")
        picks_check(x2, w, out, picks, tiles)
        return launch(x2, w, out, tiles, 1, act_in=act_in, picks=picks)
    m = x2.shape[0]
    k = w.in_features
    n = w.out_features
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"w4a16_h2 takes 1..{MAX_ROWS} rows, got {m}")
    if act_in not in ACT_CODES:
        raise ValueError(f"w4a16_h2: act_in {act_in!r}, expected one of {list(ACT_CODES)}")
    if x2.shape[1] != (2 * k if act_in else k) or (residual is not None) != (summed is not None) \
            or (residual is not None and norm_weight is None) or (act_in and norm_weight is not None):
        raise ValueError(f"w4a16_h2: x {tuple(x2.shape)} for K {k} with norm "
                         f"{norm_weight is not None}, residual {residual is not None}, summed "
                         f"{summed is not None}, act_in {act_in}")
    if summed is not None and summed.data_ptr() in (x2.data_ptr(), residual.data_ptr()):
        raise ValueError("w4a16_h2: summed must not alias x or residual (other programs read them)")
    if normed is not None:
        read = {x2.data_ptr()} | ({residual.data_ptr()} if residual is not None else set())
        if norm_weight is None or normed.shape != x2.shape or normed.data_ptr() in read \
                or (summed is not None and normed.stride() != summed.stride()):
            raise ValueError("w4a16_h2: normed takes a new [M, K] tensor (strided as summed) "
                             "and a norm")
    # (a K split asked for keeps the table's split-K entries: whole-K tiles split nothing)
    t = tiles or h2_tiles(m, x2.device, n, fused=bool(act_in) or norm_weight is not None,
                          k=k if split in (None, 1) else None, group_size=w.group_size)
    if t.whole_k and not (whole_k_fits(t, k, w.group_size) and split in (None, 1)):
        raise ValueError(f"w4a16_h2: whole-K tiles {t} cannot take K {k} (group "
                         f"{w.group_size}, split {split})")
    return launch(x2, w, out, t, split, norm_weight=norm_weight, eps=eps, residual=residual,
                  summed=summed, act_in=act_in, normed=normed)


def launch(x2: torch.Tensor, w: W4Weight, out: torch.Tensor, t: RowsTiles, split: int | None, *,
           norm_weight: torch.Tensor | None = None, eps: float = 0.0,
           residual: torch.Tensor | None = None, summed: torch.Tensor | None = None,
           act_in: str | None = None, normed: torch.Tensor | None = None,
           picks: Picks | None = None) -> torch.Tensor:
    """w4a16_h2's launch, its arguments checked (picks: w holds the experts)."""
    n = w.qweight.shape[-1]
    pdl = pdl_args(x2.device, "moe_w4" if picks is not None else ("h2" if n <= THIN_N else "h2_wide"))
    grid, args = kernel_args(x2, w, out, t, split, pdl, norm_weight=norm_weight, eps=eps,
                             residual=residual, summed=summed, act_in=act_in, normed=normed,
                             picks=picks)
    w4a16_h2_kernel[grid](**args, num_warps=t.num_warps, num_stages=t.num_stages, **pdl)
    return out


def kernel_args(x2: torch.Tensor, w: W4Weight, out: torch.Tensor, t: RowsTiles, split: int | None,
                pdl: dict, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                residual: torch.Tensor | None = None, summed: torch.Tensor | None = None,
                act_in: str | None = None, normed: torch.Tensor | None = None,
                picks: Picks | None = None) -> tuple[tuple[int, int], dict]:
    """The grid and w4a16_h2_kernel's arguments (by name, constexprs included) of one call, with its
    scratch buffers allocated; pdl: the launch's pdl_args. launch runs them as a grid,
    fused_moe_queue.py as work-queue items."""
    qw = w.qweight
    k, n = qw.shape[-2] * 8, qw.shape[-1]
    m = 1 if picks is not None else x2.shape[0]
    n_picks = picks.ids.numel() if picks is not None else 1
    tokens, picks_k = picks.ids.shape if picks is not None else (1, 1)
    pick_sum = picks is not None and picks.weights is not None
    p = split_plan(n, k, w.group_size, t, x2.device, split)
    block_k = p.wrows * 8
    # a whole-K program forms all of its K's pairs in one chunk, masked past K (whole_k_fits)
    chunk_segs = next_pow2(k // block_k) if t.whole_k else max(1, CHUNK_VALUES // block_k)
    slots = picks_k if pick_sum else p.split  # the split-K epilogue's slots (picks: a token's)
    ws = out if slots == 1 else torch.empty((tokens, slots, m, n), dtype=torch.float32,
                                            device=x2.device)
    # prep_x_pairs' scratch: the activations as scaled fp16 pairs, and per K step sum(x) and 2^e
    # (whole-K tiles: one copy a column block and pick)
    copies = (p.n_blocks * n_picks,) if t.whole_k else ()
    xh = torch.empty(copies + (m, k), dtype=torch.float16, device=x2.device)
    xg = torch.empty(copies + (2, m, k // block_k), dtype=torch.float32, device=x2.device)
    tickets = ticket_buffer(x2.device, p.n_blocks * tokens)
    use_asm = uses_ptx(x2.device)
    nxt = next_plan(w, p.n_blocks * (n_picks if picks is not None else p.split), picks is None,
                    x2.device, use_asm)
    picked = {}
    if picks is not None and picks.next_experts is not None:
        nxt = picked_plan(picks.next_experts, p.n_blocks, use_asm, x2.device)
        if nxt is not None:
            picked = dict(nx_stride_we=picks.next_experts.qweight.stride(0),
                          nx_stride_se=picks.next_experts.scales.stride(0),
                          nx_stride_be=picks.next_experts.biases.stride(0), NEXT_PICKED=True)
    res = residual if residual is not None else x2
    trace = program_trace.buffer(
        p.n_blocks * p.split * n_picks, lambda: f"h2 m={m} n={n} k={k} "
        f"{'norm' if norm_weight is not None else (act_in or 'plain')}", use_asm)
    sums = summed if summed is not None else (normed if normed is not None else x2)
    first = loads_first(t, m, k, p.k_per_split, norm_weight is not None, pdl, chunk_segs * block_k)
    pick_args = {}
    if picks is not None:
        pick_args = dict(pick_ptr=picks.ids, pick_w_ptr=picks.weights if pick_sum else picks.ids,
                         stride_we=qw.stride(0), stride_se=w.scales.stride(0),
                         stride_xp=x2.stride(0), stride_op=out.stride(0), picks_k=picks_k,
                         x_div=picks_k if picks.token_x else 1, PICKS=True, PICKS_SUM=pick_sum)
        if picks.add is not None:
            pick_args.update(add_ptr=picks.add[0], add_w_ptr=picks.add[1],
                             stride_add=picks.add[0].stride(0), PICKS_ADD=True)
    args = dict(
        x_ptr=x2, qw_ptr=qw, scales_ptr=w.scales, biases_ptr=w.biases, out_ptr=out, ws_ptr=ws,
        ticket_ptr=tickets, xh_ptr=xh, xp_ptr=xh.view(torch.int32), xg_ptr=xg, res_ptr=res,
        nw_ptr=norm_weight if norm_weight is not None else x2, sum_ptr=sums,
        normed_ptr=normed if normed is not None else x2, eps=float(eps),
        trace_ptr=out if trace is None else trace,
        M=m, N=n, K=k, k_per_split=p.k_per_split,
        stride_xm=x2.stride(0), stride_qw=qw.stride(-2), stride_sg=w.scales.stride(-2),
        stride_om=out.stride(0), stride_rm=res.stride(0), stride_sm=sums.stride(0), num_splits=slots,
        GROUP_SIZE=w.group_size, BLOCK_M=next_pow2(m), BLOCK_N=t.block_n, WROWS=p.wrows,
        CHUNK_SEGS=chunk_segs, EVEN_N=n % t.block_n == 0,
        PREFETCH=t.prefetch, USE_ASM=use_asm, LOOP_STAGES=t.num_stages,
        PREFETCH_L2=t.prefetch_l2 and use_asm,
        NORM=norm_weight is not None, RESIDUAL=residual is not None, ACT_IN=ACT_CODES[act_in],
        NORM_CHUNK=norm_chunk(k, next_pow2(m)) if norm_weight is not None else 1,
        NORM_OUT=normed is not None, TRACE=trace is not None, LOADS_FIRST=first,
        KSPLIT=t.lane_groups() if t.whole_k else 1,
        TWO_STEPS=two_steps(t, k, block_k),
        **pick_args, **(nxt.kernel_args() if nxt is not None else {}), **picked)
    return (p.n_blocks, n_picks if picks is not None else p.split), args
