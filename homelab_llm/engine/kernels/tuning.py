"""Tile sizes per GPU architecture, in one small table instead of constants inside kernels.

Why a table and not `triton.autotune`: autotuning benchmarks on first call, which breaks CUDA/HIP
graph capture and makes the first request slow; a table is deterministic and reviewable. The bench
script (benchmarks/kernels_bench.py) is where new entries are measured.

Portability rules the entries follow: RDNA3 (gfx1100) is wave32 with 64 KB LDS per workgroup, so
its tiles are smaller and use fewer pipeline stages; nothing here asks for Hopper-only features
(TMA, wgmma): sm90 gets the same kernels as sm80 with larger tiles.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionTiles:
    """block_n: KV tokens per inner step (block_n / page_size pages gathered through the page
    table per step). The decode split kernel's variants (decode_attention.py; the prefill kernel
    reads only the first three): int8_dot: int8 KV scores as int8 x int8 dots (K never converted);
    prefetch_scales: int8 KV's per-token scales (and the page indices they need) requested a tile
    ahead; prefetch_kv: the K/V rows too, into registers (with num_stages 1); fused_merge: the
    last split of a (sequence, KV head) merges the partials, no second kernel (decode_steps.py,
    decode_merge.py). Swept by benchmarks/int8kv_decode.py."""

    block_n: int
    num_warps: int
    num_stages: int
    int8_dot: bool = False
    prefetch_scales: bool = False
    prefetch_kv: bool = False
    fused_merge: bool = False
    max_regs: int = 0  # NVIDIA only: registers per thread the compiler must fit in (0: its choice)
    late_q: bool = False  # q prepared (rotation, int8 split) inside the first tile, after its loads
    # rotated int8 KV: the merge un-rotates each output once (False: every split program its partial)
    merge_unrotates: bool = True
    # a decode step's new K/V rotated and stored by the split kernel (decode_attention new_kv):
    # no rope_store_kv launch before it. Off: on the H200 it was within noise (BENCHMARKS 36.1:
    # 8B W4A16 batch 1 2.056 against 2.058-2.065 ms a step, int8 KV and the 30B-A3B 0.4% slower)
    new_kv: bool = False
    # heads of at least this size (0: none) re-derive q in the score dot's operand layout in
    # every KV tile (q_each_tile) instead of holding that copy through the loop (BENCHMARKS 63)
    tile_q_from: int = 0


@dataclass(frozen=True)
class WideDecode:
    """The decode split kernel's tiles for heads wider than 128 at min_sequences or more
    sequences a call (ArchTiles.decode_int8_wide)."""

    min_sequences: int
    tiles: AttentionTiles


@dataclass(frozen=True)
class PrefillTiles:
    block_m: int  # query tokens per program
    block_n: int
    num_warps: int
    num_stages: int
    # int8 K's per-token scales loaded without a mask (common.load_key_scales): gfx1100's int8
    # prefill spilled ~80 fewer VGPRs a lane so, sm_90's 32 bytes more (BENCHMARKS 62.3)
    unmasked_key_scales: bool = False
    # AttentionTiles.tile_q_from, for bf16 KV only: gfx1100's int8 prefill spilled more with it
    # (head_dim 256: 45 -> 85 VGPRs a lane; BENCHMARKS 63)
    tile_q_from: int = 0


@dataclass(frozen=True)
class GemmTiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # >1 only for skinny (decode) shapes with few output tiles
    # W4A16 left-operand loop only (w4a16_dot.wleft_steps): the weights formed as (q - z) s + r
    # in registers (each rounded once to bf16/fp16) instead of the offset form's per-step epilogue
    scaled: bool = False
    # ... or, for weights whose zero points are integers (W4Weight.int_zeros), q - z exactly in
    # registers and the scale applied by the step (one FMA an output element); others keep the
    # scaled or offset form
    int_zeros: bool = False
    # The left-operand loop (w4a16_dot(w_left=True), and the MoE GEMMs' with w_left) in the
    # scaled form with one accumulator a nibble pair over x in pair order (reordered before a
    # dense launch where its producer did not write it so), so no pair dot feeds another in the
    # step and every K-16 wgmma stays in flight (Triton's properly async dots) instead of a
    # wait after each pair
    pair_accs: bool = False
    # The dense left loop's other way to the same end: one dot a step of the four pair tiles
    # joined along K (no data movement) over x's whole step in pair order, one accumulator
    # (fewer registers than pair_accs); takes precedence over pair_accs
    joined: bool = False
    # The dense left-operand loop reads x in pair order (four contiguous slices a step, no split
    # in registers) where the linear's producer writes it so (the norm in front of it, the
    # SiLU-and-mul in front of a down projection: dispatch.w4a16_pairs_block); pair_accs tiles
    # want that order too (and reorder x themselves where no producer wrote it)
    x_pairs: bool = False
    # The fused MoE's 4-bit grouped GEMMs: the weights as the dots' left operand from registers
    # (wleft_steps over x in pair order; gate_up one dot of gate's block_n / 2 columns then
    # up's), in the scaled / int_zeros / offset form above
    w_left: bool = False

    @property
    def in_flight(self) -> bool:
        """pair_accs or joined: the scaled form over x in pair order, wgmmas kept in flight."""
        return self.pair_accs or self.joined


@dataclass(frozen=True)
class MoeGemmTiles:
    """The fused MoE's two grouped GEMMs (fused_moe.py): gate_up's tiles and down's, which share
    the align's block_m. paired: gate_up interleaves its gate and up columns in one dot of twice
    block_n (dense experts only: their rows are K-contiguous, so an interleaved tile still loads
    whole rows; 4-bit words are N-contiguous and keep two dots)."""
    up: GemmTiles
    down: GemmTiles
    paired: bool = False

    def __post_init__(self) -> None:
        if self.up.block_m != self.down.block_m:
            raise ValueError(f"MoeGemmTiles: gate_up and down share block_m, got "
                             f"{self.up.block_m} and {self.down.block_m}")


@dataclass(frozen=True)
class RowsTiles:
    """W4A16 multi-row GEMV (w4a16_rows.py). block_n: output columns per program; it should be
    4 x 32 x num_warps x c (c = 1, 2) so each thread owns whole 16-byte vectors of every word row
    and the K sum stays inside the thread. wrows: packed word rows per K step (8 x wrows values of
    k; clamped to the group). waves: programs per SM that K-splitting aims for; min_steps: K
    steps a split keeps at least. prefetch (w4a16_h2.py only): request the next K step's words
    before this step's math (twice the word registers, more bytes in flight). prefetch_l2
    (w4a16_h2.py, NVIDIA): ask the L2 for the program's first K step before its activation
    prologue, which the pipelined loop's own loads wait behind. whole_k (w4a16_h2.py, with
    prefetch): each program covers all of K, its threads split in lane_groups() K ranges (4
    columns a thread) and summed once in shared memory: no split-K tail (whole_k_fits says
    which calls can)."""

    block_n: int
    wrows: int
    num_warps: int
    num_stages: int = 1
    waves: int = 4
    min_steps: int = 2
    prefetch: bool = False
    prefetch_l2: bool = False
    whole_k: bool = False

    def lane_groups(self) -> int:
        """K ranges a whole_k program's threads split K into: 4 columns a thread, block_n / 4
        threads a range."""
        return 128 * self.num_warps // self.block_n


# K values (K rounded up to a power of two) a whole_k program's thread forms in the prologue's
# one trip of loads: 16,384 at 16 warps (the 8B's down projection), 8,192 at 8
WHOLE_K_THREAD_VALUES = 32


def whole_k_fits(tiles: RowsTiles, k: int, group_size: int) -> bool:
    """Whether whole_k tiles can take a K-long input: K in equal whole-step lane ranges (any
    count of steps), and K, rounded up to a power of two, within WHOLE_K_THREAD_VALUES a thread
    (the prologue forms it in one masked trip)."""
    block_k = 8 * min(tiles.wrows, group_size // 8)
    lanes = tiles.lane_groups()
    return (tiles.whole_k and tiles.prefetch and lanes >= 2 and tiles.block_n * lanes == 128 * tiles.num_warps
            and k % (lanes * block_k) == 0
            and 1 << (k - 1).bit_length() <= WHOLE_K_THREAD_VALUES * 32 * tiles.num_warps)


@dataclass(frozen=True)
class QueueTiles:
    """A pre-norm MoE block at decode sizes in one launch (fused_moe_queue.py): whole-K tiles of
    the experts' gate_up and down (one grid, so the same num_warps), the router's experts a
    program (router_block_e) and hidden values a step (router_block_k); default: the engine takes
    it without HOMELAB_LLM_MOE_QUEUE=1; poll_pause_ns: waiting items back off about that long
    between polls (work_queue.wait_count; 0: they spin)."""

    up: RowsTiles
    down: RowsTiles
    router_block_e: int
    router_block_k: int
    default: bool = False
    poll_pause_ns: int = 0


@dataclass(frozen=True)
class ArchTiles:
    name: str
    num_sms: int  # fallback when the device cannot be asked
    decode: AttentionTiles
    prefill: PrefillTiles
    gemv: GemmTiles  # W4A16 with M <= 16 through the GEMM kernel (tl.dot)
    gemv_rows: GemmTiles  # W4A16 GEMV kernel (M <= 8): block_n columns, block_k = 8 * word rows
    gemm_small: GemmTiles  # M <= 64
    gemm: GemmTiles  # large M (prefill)
    # W4A16 few-row kernel (w4a16_dot.py): block_m is the most rows per program, block_k = 8 x word
    # rows per K step (>= 128), split_k = programs per SM below which K is split.
    w4a16_dot: GemmTiles
    elementwise_warps: int  # norms, rope, silu
    # split-KV decode: upper bound on splits per sequence (eager path), and the batch-1 split count
    # of decode graphs on long contexts (cuda_graphs.kv_splits_for; shared out as batches grow)
    max_kv_splits: int
    # W4A16 multi-row GEMV: (max_rows, tiles), the first entry with m <= max_rows serves m rows.
    w4a16_rows: tuple[tuple[int, RowsTiles], ...]
    # W4A16 packed-half GEMV (w4a16_h2.py), the same shape of entries as w4a16_rows.
    w4a16_h2: tuple[tuple[int, RowsTiles], ...]
    # The decode split kernel's tiles for int8 KV when they differ from `decode` (its int8-only
    # switches, other tile sizes); None: `decode` serves both KV formats.
    decode_int8: AttentionTiles | None = None
    # int8 KV decode tiles for heads wider than 128 from a number of sequences a call on (a tile
    # is block_n x head_dim; verify groups look up as one sequence); None: decode_int8 serves
    # every call.
    decode_int8_wide: WideDecode | None = None
    # The prefill kernel's tiles for heads wider than 128 (the 27B's 256), where `prefill`'s
    # accumulator and q tile spill (BENCHMARKS 57.2); None: `prefill` serves every head size.
    prefill_wide: PrefillTiles | None = None
    # Packed-half GEMV tiles for outputs of at most THIN_N columns: (min_rows, max_rows, tiles),
    # consulted before w4a16_h2 (thin matrices pay the K split's reduction tail; narrower column
    # blocks split K less). Empty: w4a16_h2 serves every width.
    w4a16_h2_thin: tuple[tuple[int, int, RowsTiles], ...] = ()
    # Packed-half GEMV tiles for calls that form their input in the prologue (w4a16_prologue.py:
    # norm, residual add, SiLU-and-mul), same shape of entries as w4a16_h2 and consulted first: a
    # longer prologue favours tiles whose first weight loads are issued before it. Empty: none.
    w4a16_h2_fused: tuple[tuple[int, RowsTiles], ...] = ()
    # The same for fused calls with outputs of at most THIN_N columns ((min_rows, max_rows, tiles)
    # as w4a16_h2_thin), consulted before w4a16_h2_fused for rows that have a fused entry at all.
    w4a16_h2_fused_thin: tuple[tuple[int, int, RowsTiles], ...] = ()
    # W4A16 packed-half GEMV, programs over all of K (RowsTiles.whole_k): (max_rows, max_n,
    # max_k, tiles), consulted before the entries above; the first with m <= max_rows, n <= max_n
    # and k <= max_k that whole_k_fits the call's K takes it.
    w4a16_h2_whole_k: tuple[tuple[int, int, int, RowsTiles], ...] = ()
    # Decode-size 4-bit MoE experts on the packed-half GEMV (fused_moe_h2.py): (max_k, whole-K
    # tiles) entries, the first with K <= max_k that whole_k_fits serving each of the layer's two
    # GEMVs, for up to moe_h2_tokens tokens. Empty: the arch keeps fused_moe_decode's kernels.
    moe_h2: tuple[tuple[int, RowsTiles], ...] = ()
    moe_h2_tokens: int = 1
    # The MoE block's norm, router, gate_up and down as one launch's work queue (fused_moe_queue.py)
    # for up to moe_h2_tokens tokens; None: three launches (moe_router, fused_moe_h2).
    moe_queue: QueueTiles | None = None
    # W4A16 few-row kernel with the weights as the dot's left operand (route "dotL"): (max_rows,
    # tiles) entries, the first with m <= max_rows serving m rows (the last one past them); tiles
    # as w4a16_dot's (block_n is the MMA's M). Empty: the arch routes no rows there.
    w4a16_dot_left: tuple[tuple[int, GemmTiles], ...] = ()
    # The same for outputs of at most THIN_N columns, consulted first (fewer column blocks there
    # favour narrower programs). Empty: w4a16_dot_left serves every width.
    w4a16_dot_left_thin: tuple[tuple[int, GemmTiles], ...] = ()
    # (max_rows, max_k, tiles) entries consulted before both: m rows over at most max_k inputs
    # (fewer K steps a split program, where a deeper pipeline paid off). Empty: none.
    w4a16_dot_left_short_k: tuple[tuple[int, int, GemmTiles], ...] = ()
    # Fused MoE grouped GEMMs at prefill sizes (the `gemm` entry's rows) over 4-bit experts:
    # gate_up's and down's own tiles where measured (the kernel halves gate_up's block_n for
    # its gate and up dots). None: `gemm`'s for both.
    moe_w4_gemm: MoeGemmTiles | None = None
    # The same for dense (bf16/fp16) experts: gate_up's and down's own tiles, gate and up paired
    # in one dot where measured. None: `gemm`'s for both, two dots.
    moe_gemm: MoeGemmTiles | None = None
    # MXFP4 experts' (gpt-oss) gated GEMM at half the tiles' width, as 4-bit experts' always is:
    # its gate and up dots hold two accumulators. gfx1100: the 32 x 64 tile spilled 33 VGPRs a
    # lane, 32 x 32 none (BENCHMARKS 63.5); sm_90's 32 x 128 fits (255 registers), as timed.
    mx4_gated_half_width: bool = False
    # Decode graphs past batch 1: KV splits chosen for about this many (row, KV head, split)
    # programs an SM (cuda_graphs.kv_splits_at). 0: the batch-1 count shared out, at least 8.
    kv_programs_per_sm: int = 0
    # Decode graphs for short contexts (cuda_graphs.DecodeGraphs): where a shape's KV split count
    # is above this, a second graph with this many splits serves the steps whose longest
    # sequence wants no more (kv_splits_for). 0: one graph a shape.
    short_kv_splits: int = 0
    # int8 KV tiles converted to fp16 by the hardware's int-to-float conversion rather than
    # common.int8_to_fp16's integer ops (measured on NVIDIA, where the conversion is quarter
    # rate); on gfx1100 the integer form spilled (BENCHMARKS 62.2). The attention kernels' KV_CVT.
    int8_convert_hw: bool = False
    # Batch-1 decode programs (KV heads x splits) the split cap keeps on a rank with few KV
    # heads: the cap rises past max_kv_splits to this over the heads (kv_split_cap). 0: the cap
    # is max_kv_splits whatever the heads. sm_90 and gfx1100: 128 (BENCHMARKS 60.3, timed on
    # sm_90: the 27B's two KV heads a card at TP 2 get 64 splits; sm_80 and sm_120 cap at 64).
    kv_split_programs: int = 0
    # MB of the next W4A16 linear's weights a 1-2 row GEMV's tail asks the L2 for, and the row
    # bands a larger weight's share is spread over (l2_next.py; PTX archs only). 0: off, on every
    # arch: on the H100 it lost 4-11% (BENCHMARKS 60.2); sm_80 and sm_120 untimed
    # (HOMELAB_LLM_L2_NEXT=MB[,bands] for A/B runs).
    l2_next_mb: float = 0.0
    l2_next_bands: int = 16
    # Decode-path kernels launched with programmatic dependent launch (pdl.py, sm_90+ only): 0
    # off, 1 the next grid launched once every program has waited, 2 once every program is past
    # its main loop (GEMVs) or has exited (the rest).
    pdl: int = 0
    # kernel families (pdl.FAMILIES) launched plainly: their programs start only once the previous
    # grid has completed (they still let the next grid launch early)
    pdl_plain: tuple[str, ...] = ()


THIN_N = 8192  # output columns up to which a W4A16 linear counts as thin (w4a16_h2_thin)


# Packed-half GEMV (w4a16_h2.py) for 1, 2, 3-4 and 5-8 rows: 8 columns per thread (two 128-bit
# loads per word row), fewer word rows as rows grow (each thread holds rows x word rows x columns
# fp16x2 partial sums). sm_90 compiles (SASS instructions per weight; registers): 1 row 1.6
# (168 with the prefetch, 80 without); 2 rows 2.7 (130); 4 rows 5.1 (168); 8 rows 11.3 (168)
# -- the fp32 GEMVs: 4.7 (rows) and 6.1 (gemv) at 1 row. Not measured on a device yet:
# benchmarks/w4a16_sweep.py times candidates beside them. A decode GEMV is bound by the bytes in
# flight: 1 row prefetches the next step, 1-2 rows aim at 8 programs per SM. On the H200 (sm90's
# entries, BENCHMARKS 19.1) fewer programs walking 4+ K steps each won by 25-30% over these
# one-step programs: the sweep's h2.st* tiles are the first candidates for the other archs.
H2_TILES = ((1, RowsTiles(1024, 8, 4, waves=8, min_steps=1, prefetch=True)),
            (2, RowsTiles(1024, 8, 4, waves=8, min_steps=1)), (4, RowsTiles(1024, 4, 4)), (8, RowsTiles(512, 2, 4)))

TABLE: dict[str, ArchTiles] = {
    # Ampere / Ada (A100, RTX 3090/4090): 164/100 KB shared memory per SM.
    "sm80": ArchTiles(
        name="sm80", num_sms=108,
        decode=AttentionTiles(block_n=64, num_warps=4, num_stages=2),
        prefill=PrefillTiles(block_m=64, block_n=64, num_warps=4, num_stages=2),
        # head_dim 256: the same tiles in the one stage that fits 99 KB with bf16 KV (two need
        # 104 KB; launch_fit fell back to one at run time, so this is what ran), int8 KV too
        prefill_wide=PrefillTiles(block_m=64, block_n=64, num_warps=4, num_stages=1),
        gemv=GemmTiles(16, 64, 128, num_warps=4, num_stages=3, split_k=4),
        gemv_rows=GemmTiles(1, 64, 128, num_warps=4, num_stages=2),
        gemm_small=GemmTiles(32, 64, 64, num_warps=4, num_stages=3, split_k=2),
        gemm=GemmTiles(64, 128, 64, num_warps=4, num_stages=3),
        w4a16_dot=GemmTiles(64, 64, 128, num_warps=4, num_stages=3, split_k=4),
        elementwise_warps=4, max_kv_splits=64,
        w4a16_rows=((2, RowsTiles(1024, 8, 4)), (8, RowsTiles(512, 2, 4)), (16, RowsTiles(256, 2, 4))),
        w4a16_h2=H2_TILES),
    # Hopper (H100/H200) without TMA/wgmma-specific code: bigger tiles, more stages.
    "sm90": ArchTiles(
        name="sm90", num_sms=132,
        # decode (bf16) and decode_int8: `python3 benchmarks/int8kv_decode.py --quick` picks (H200,
        # 8B attention, us a layer incl. the merge, 64 splits at batch 1): bf16 8 warps, 5 stages
        # (two K/V buffers in flight): 16K b1 31.7 -> 30.6, b8 181.5 -> 142.5, 4K b64 283.9 ->
        # 260.3, no cell slower than 1.01x; int8 with its scales a tile ahead: 16K b1 38.1 ->
        # 32.9, b8 215.8 -> 176.7, 4K b64 407.8 -> 339.2. int8: with the int8 dot (it compiles on
        # Triton 3.6 since BENCHMARKS 12.6) and 128-token tiles in 5 stages (BENCHMARKS 13.2:
        # 16K b1 29.9 -> 27.3 us, b8 178.3 -> 138.8, 1K b64 95.7 -> 78.7, 4K b64 334.3 -> 247.7).
        decode=AttentionTiles(block_n=64, num_warps=8, num_stages=5),
        decode_int8=AttentionTiles(block_n=128, num_warps=4, num_stages=5, int8_dot=True,
                                   prefetch_scales=True),
        # The 27B's head_dim 256, int8 KV (V dim-major), 2+ sequences (BENCHMARKS 58.3, H100,
        # int8kv_decode.py --shape 27b, us a layer): 64-token tiles in 5 stages (16 KB of K a
        # stage, as 128 tokens at head_dim 128) against the 128-token ones at 32 splits (batch 2,
        # as the engine's graphs split it): 4K 26.8 -> 22.3, 16K 53.0 -> 45.8, 64K 139.9 -> 126.8;
        # batch 8 at 16 splits 151.0 -> 140.8 (the engine's graphs take 8). Engine steps, 27B
        # W4A16 at 16K: batch 2 8.700 -> 8.634 ms, batch 8 11.179 -> 11.114. One sequence keeps
        # the wider tiles (16K 29.3 vs 32.1, 64K 84.5 vs 91.2, 128K 133.6 vs 170.8: 4 KV heads x
        # 32 splits are 128 programs, under one an SM).
        # bf16 KV keeps `decode`: 32-token tiles on 2 warps won 0-15% a layer in the same runs at
        # 4+ sequences, and the engine's batch-8 step at 4K did not move (10.194 -> 10.190 ms).
        decode_int8_wide=WideDecode(2, AttentionTiles(block_n=64, num_warps=4, num_stages=5, int8_dot=True,
                                                      prefetch_scales=True)),
        # head_dim 256 (the 27B's) keeps these tiles: 64 rows spill nothing where these spill 280
        # bytes a thread (int8 KV) / 40 (bf16), yet took 1.02-1.79x their time on an H100
        # (BENCHMARKS 57.6, prefill_attention_ab.py --shape 27b)
        prefill=PrefillTiles(block_m=128, block_n=64, num_warps=8, num_stages=3),
        gemv=GemmTiles(16, 64, 128, num_warps=4, num_stages=4, split_k=4),
        gemv_rows=GemmTiles(1, 64, 128, num_warps=4, num_stages=2),
        gemm_small=GemmTiles(32, 128, 64, num_warps=4, num_stages=4, split_k=2),
        gemm=GemmTiles(128, 128, 64, num_warps=8, num_stages=3),
        # H200 sweeps (docs/BENCHMARKS.md 8.7, 10.2): 128 columns x 8 warps won at 8 rows; 16
        # rows a program (x permuted past 16 rows) at 24-64 rows: 27B step linears at 40 rows
        # 28.7 ms vs 55.6 with 64-row programs (the same at 8 and 16 rows).
        w4a16_dot=GemmTiles(16, 128, 128, num_warps=8, num_stages=3, split_k=4),
        # 32 KV splits at batch 1 (int8kv_decode.py, 4K and 16K, both KV formats): bf16 16K 26.4 us
        # a layer against 30.6 at 64 splits (w8s5), int8 31.0 against 34.9 (5 stages).
        elementwise_warps=8, max_kv_splits=32,
        # 1-2 rows: 8 columns per thread (2 x 128-bit loads per word row), 8 word rows per step:
        # ~5 PTX instructions per weight at 1 row, 80-128 registers; more rows: fewer word rows
        # and columns per thread, so the hoisted activations fit (sm_90/gfx1100: no spills).
        w4a16_rows=((2, RowsTiles(1024, 8, 4)), (8, RowsTiles(512, 2, 4)), (16, RowsTiles(256, 2, 4))),
        # H200 sweeps 10.7, 11.2 (step linears): 1 row 16 word rows a step streamed through
        # shared memory in 2 stages, 27B 6.37 ms / 8B 2.57 (the prefetching tiles 6.54 / 2.69;
        # the older GEMV 8.48 / 2.84); 2 rows 16 word rows a step 9.22 ms (the dot kernel 10.71).
        # 1 row (BENCHMARKS 19.1): streaming programs, about 3 an SM (168 registers), each
        # walking 4+ K steps of 1024 columns x 8 word rows with the next step's words requested
        # before this step's math: 8B gate_up 35.8 -> 24.7 us, 27B mlp.gate_up 45.0 -> 32.6 (a
        # one-wave 4-stage tile won the 8B's by 2 us but left half the SMs idle on the 27B's 34
        # column blocks).
        w4a16_h2=((1, RowsTiles(1024, 8, 4, waves=3, min_steps=4, prefetch=True)),
                  (2, RowsTiles(1024, 16, 4, waves=8, min_steps=1))) + H2_TILES[2:],
        # 2 rows, thin outputs (27B N = 5120: out_proj, o_proj, down; BENCHMARKS 12.2): 512 columns,
        # 8 word rows, 3 stages: 17.3 / 17.5 / 37.2 us against 25.6 / 25.8 / 41.6. 1 row (19.1):
        # 512 columns streamed in 4 stages, 4+ K steps a program: 8B o_proj 10.4 -> 7.9 us,
        # down 18.4 -> 14.8, 27B out_proj 12.5 -> 11.5. 2 rows (19.2): 1024 columns in 4 stages,
        # one wave: 8B o_proj 15.6 -> 13.1 us, down 30.6 -> 23.7.
        w4a16_h2_thin=((1, 1, RowsTiles(512, 8, 4, num_stages=4, waves=3, min_steps=4)),
                       (2, 2, RowsTiles(1024, 8, 4, num_stages=4, waves=1, min_steps=4))),
        # 1 row with a prologue form: the register prefetch issues the first step's words before
        # the norm's row read (engine, BENCHMARKS 14.4: 8B 310.2 -> 334.7 tok/s, 27B 126.8 ->
        # 129.3); since 19.1 the plain wide calls' tile too (shared-memory stages issue theirs
        # after the prologue: 8B 389.5 tok/s with them, 407.7 with the prefetch). 2 rows: the plain
        # 2-row tile with the prologue (27B verify K = 1 forward 10.05 -> 9.68 ms, BENCHMARKS
        # 17.2; the 1-row tile there: 12.34). Only rows with an entry here take the fused path
        # (dispatch.w4a16_prologue_route).
        w4a16_h2_fused=((1, RowsTiles(1024, 8, 4, waves=3, min_steps=4, prefetch=True)),
                        (2, RowsTiles(1024, 16, 4, waves=8, min_steps=1))),
        # Thin fused calls (19.1): 1 row 512 columns, the register prefetch, 4+ K steps; 2 rows
        # the thin plain tile (8B batch 2 511.8 -> 566.7 tok/s with both, 27B 213.4 -> 213.9).
        w4a16_h2_fused_thin=((1, 1, RowsTiles(512, 8, 4, waves=4, min_steps=4, prefetch=True)),
                             (2, 2, RowsTiles(1024, 8, 4, num_stages=4, waves=1, min_steps=4))),
        # 1 row, K <= 6144 (whole_k_fits): programs over all of K, no split-K tail. Outputs of
        # at most 4,096 columns: 32 columns a program, so twice as many programs (SMs) stream
        # the matrix, in 4-row steps (BENCHMARKS 35.1: 8B o_proj 5.89 -> 4.61 us, the 30B-A3B's
        # 6.01 -> 4.43; K <= 2048 in 8 warps, 4.1-4.2 -> 3.1-3.4). Other thin outputs 64 columns
        # in 16 lane groups (8 warps), wide ones 128 in 8. K 6144 (the 27B's out_proj and o_proj:
        # 9.70 -> 7.93 us) in 32 groups (16 warps). Past that (K 5120, 14336, 17408) split K wins:
        # a whole-K prologue forms all of K in every program.
        w4a16_h2_whole_k=((1, 4096, 2048, RowsTiles(32, 4, 8, prefetch=True, whole_k=True)),
                          (1, 4096, 4096, RowsTiles(32, 4, 16, prefetch=True, whole_k=True)),
                          (1, THIN_N, 4096, RowsTiles(64, 8, 8, prefetch=True, whole_k=True)),
                          (1, THIN_N, 6144, RowsTiles(64, 8, 16, prefetch=True, whole_k=True)),
                          (1, 1 << 30, 4096, RowsTiles(128, 8, 8, prefetch=True, whole_k=True))),
        # One token's 4-bit experts (fused_moe_h2.py; BENCHMARKS 36.2, the layer at batch 1, us,
        # against fused_moe_decode's 19.91 / 16.51): gate_up (K = H = 2048) as the attention's
        # 1-row calls of that K, 32 columns in 8 warps; down (K = I, 768 / 512 on the A3B
        # models) 64 columns in 4 warps (8 lane groups): 30B-A3B 14.84 us (up 64 columns 15.41-
        # 15.48, 16 warps 16.41-17.84; down 128 x 8 rows in 4 warps 14.94, 2 warps 17.55-18.64),
        # 256 experts of I 512 12.36 (32 columns in 4 warps 12.04); engine 461.8 -> 521.0 tok/s
        # (the landed form, another machine: 456.6 -> 509.7)
        moe_h2=((1024, RowsTiles(64, 4, 4, prefetch=True, whole_k=True)),
                (2048, RowsTiles(32, 4, 8, prefetch=True, whole_k=True)),
                (4096, RowsTiles(32, 4, 16, prefetch=True, whole_k=True))),
        # Up to 8 tokens (BENCHMARKS 38.3; an expert two tokens pick is read twice, yet at 8
        # tokens, `moe_h2_gpu.py --tokens 1,8`, us a layer against fused_moe_decode's: 30B-A3B
        # 57.7 against 122.7, 256 experts of I 512 44.3 against 119.1; engine 30B-A3B W4A16
        # batch 8 1,304.0 -> 1,716.4 tok/s, the same tokens). 9+ tokens not timed.
        moe_h2_tokens=8,
        # The block in one launch (fused_moe_queue.py): untimed, so taken only with
        # HOMELAB_LLM_MOE_QUEUE=1; gate_up as moe_h2's (32 columns in 8 warps), down 128 columns in
        # 8 warps (moe_h2's 64 in 4 with 8 lane groups, at 8 warps).
        moe_queue=QueueTiles(RowsTiles(32, 4, 8, prefetch=True, whole_k=True),
                             RowsTiles(128, 4, 8, prefetch=True, whole_k=True), 4, 2048),
        # 3-64 rows: the few-row kernel with the weights as the left operand (four nibble-pair
        # wgmmas a K step; w4a16_dot(w_left=True)); block_m is a cap (dot_grid: 16 rows a
        # program up to 16 rows, the next power of two past them). Up to 16 rows (BENCHMARKS
        # 20.4): 128 columns, two warpgroups, 3 stages: 27B step linears at 3 / 8 / 16 rows
        # 10.02 / 10.11 / 10.24 ms against 64 columns, 4 warps, 4 stages 10.70 / 10.69 / 10.71
        # (8B 3.44 / 3.49 / 3.54 against 3.51 / 3.52 / 3.54). 17-64 rows, up to 64 a program,
        # on outputs past THIN_N columns the same 128 columns and two warpgroups (BENCHMARKS
        # 26.4, us at 32 / 40 rows against 64 columns, 4 warps, 4 stages: 27B mlp.gate_up
        # 91.1 / 149.4 against 102.9 / 174.8, gdn.in_proj_qkvz 43.3 / 63.2 against 47.8 / 69.0;
        # engine 27B batch-8 verify K = 2 / 3 / 4 (24 / 32 / 40 rows) 18.13 / 19.22 / 28.19 ms
        # -> 17.58 / 18.23 / 25.98); the thin ones keep 64 columns (below: o_proj 31.5 against
        # 35.3 at 40 rows). Before (20.4): at 24 / 40 rows 8B 4.85 / 7.48 ms, 27B 15.04 / 22.94;
        # before the pair dots (17.1) 27B 18.1 / 26.3 against the eight-dot kernel's 20.5 /
        # 29.2, deq's 29.9 / 29.8.
        # Before 38.1, outputs of at most THIN_N columns up to 16 rows kept 64 columns (20.4, 8
        # rows, us: 8B qkv 15.7 against 17.5 with 128 columns, o_proj 13.2 / 13.8, down 29.1 /
        # 29.8; the engine's 8B batch 8 lost 2.5% with 128 columns everywhere, the 27B gained
        # 2.3%: its wide calls gain 2-6%, its thin ones lose 0-3%); 17-64 rows too (26.4: 27B
        # attn.o_proj at 32 / 40 rows 25.3 / 31.5 us against 25.8 / 35.3 with 128 columns).
        # 17-64 rows (32- and 64-row programs, both widths): the weights formed in registers
        # (GemmTiles.scaled; BENCHMARKS 27.4, one step's linears at 17 / 24 / 32 / 40 / 64
        # rows: 8B 4.62 / 4.71 / 4.81 / 6.86 / 6.90 -> 4.16 / 4.25 / 4.37 / 5.91 / 6.18 ms, 27B
        # 13.50 / 13.57 / 13.61 / 20.40 / 20.70 -> 11.63 / 11.72 / 11.80 / 17.84 / 18.61;
        # engine 27B batch-8 verify K = 2 / 3 / 4 (24 / 32 / 40 rows) 17.29 / 18.03 / 25.79 ->
        # 15.77 / 16.21 / 23.43 ms). Up to 16 rows that form lost 1-3% (its two packed FMAs a
        # register outweigh the epilogue it saves: 8 output elements a thread there).
        # Weights with integer zero points (GPTQ / AWQ / AutoRound / symmetric) take the
        # integer-zero form at every row count (GemmTiles.int_zeros, BENCHMARKS 28.1): as fast
        # (one step's linears within +-1% of the forms above at 3-40 rows; engine batch 8 8B
        # 2,159.1 -> 2,169.2 / 2,176.4 tok/s, 27B 674.7 -> 677.2) and exact where the scaled
        # form rounds every weight to bf16 (per-row error ~5e-8 against 2e-3).
        # 38.1 (H200, BENCHMARKS 38): every entry joined (GemmTiles.joined: the four pair tiles
        # one dot a step, kept in flight) over x in pair order (x_pairs: the norm / SiLU-and-mul
        # write it), 64 columns on 4 warps (108-122 registers: 4 programs an SM). Engine batch 8
        # (w4a16_regress, one call): 27B 682.0 -> 753.3 tok/s, 8B 2,155.6 -> 2,237.6 (with the
        # short-K entry; 3 stages there 2,130.3, 4 everywhere 27B 724.4). Stages by shape, us at
        # 8 rows, 3 / 4 stages: 27B mlp.gate_up 55.1 / 58.0, in_proj_qkvz 28.2 / 31.1, attn.qkv
        # 26.0 / 27.2; 8B gate_up (K 4,096) 42.5 / 37.8; thin outputs
        # (o_proj, down, 8B qkv) within 1% either way, 4 kept. 27B verify (spec_gpu --quick)
        # batch 1 K = 2-4 1.83-1.88 -> 1.68-1.73x a plain step, batch 8 1.29-1.91 -> 1.23-1.56.
        w4a16_dot_left=((64, GemmTiles(64, 64, 128, num_warps=4, num_stages=3, split_k=4,
                                       joined=True, x_pairs=True)),),
        w4a16_dot_left_thin=((64, GemmTiles(64, 64, 128, num_warps=4, num_stages=4, split_k=4,
                                            joined=True, x_pairs=True)),),
        w4a16_dot_left_short_k=((16, 4096, GemmTiles(64, 64, 128, num_warps=4, num_stages=4, split_k=4,
                                                     joined=True, x_pairs=True)),),
        # Qwen3-30B-A3B layer at 2,048 tokens, 4-bit experts (BENCHMARKS 30.1): the weights as
        # the dots' left operand, scaled form, 128 x 128 x 64 on 8 warps, 3 stages, for both
        # GEMMs: 622 us a layer (31.6% of the matmul rate) against 856 for the right-operand
        # loop's tiles (BENCHMARKS 29.1: gate_up 128 x 128 x 64, 4 warps, 4 stages; down
        # 128 x 256 x 128, 8 warps, 3 stages). The integer-zero form: 818 us (exact weights, but
        # a second accumulator: ~190 registers a thread against ~120); the offset form slower.
        moe_w4_gemm=MoeGemmTiles(GemmTiles(128, 128, 64, num_warps=8, num_stages=3, scaled=True, w_left=True),
                                 GemmTiles(128, 128, 64, num_warps=8, num_stages=3, scaled=True, w_left=True)),
        # Dense experts there (BENCHMARKS 24.2, the GEMMs timed apart, random routing): gate_up
        # with gate and up paired in one 256-wide dot, 4 stages, 322.7 us against `gemm`'s two
        # dots 338.3; down 128 x 256, 4 stages, 199.1 against 221.5
        moe_gemm=MoeGemmTiles(GemmTiles(128, 128, 64, num_warps=8, num_stages=4),
                              GemmTiles(128, 256, 64, num_warps=8, num_stages=4), paired=True),
        # 8B attention, us a layer at 512 / 16K tokens (BENCHMARKS 18.3, int8kv_decode.py
        # --splits): batch 8 4 splits 12.8 / 139.5 against 8 splits 16.5 / 143.4 (int8 KV
        # 14.1 / 132.1 against 16.3 / 137.6); batch 16 2 splits 16.8 / 259.0 against 29.2 /
        # 272.8; batch 32 1 split 23.1 / 554.2 against 54.1 / 536.6 (int8 24.6 / 470.7 against
        # 51.2 / 512.1): about two programs an SM
        kv_programs_per_sm=2,
        # Qwen3-30B-A3B batch 1 at a 32-token context (BENCHMARKS 23.4, max_kv_splits patched):
        # 32 splits bf16 345.7 tok/s, 16 348.0, 8 348.7, 4 353.9, 2 352.8, 1 354.8; W4A16 1
        # split 382.9 against 373.5. Four splits serve contexts below 640 tokens (16-token pages).
        short_kv_splits=4,
        # Qwen3.6-27B at TP 2 (2 KV heads of 256 a card, int8 KV; BENCHMARKS 60.3, H100,
        # int8kv_decode.py --shape 27b-tp2, us a layer): 32 splits (max_kv_splits) -> 64, batch
        # 1 16K / 128K 24.4 / 124.8 -> 21.9 / 74.6, batch 2 32.3 / 167.9 -> 30.7 / 129.2, batch 8
        # 73.7 / 440.3 -> 75.8 / 443.8 (its count comes from kv_programs_per_sm either way). TP 1
        # shapes keep 32 (8B 8 heads, 27B 4).
        kv_split_programs=128,
        # decode kernels start while the previous one drains (pdl.py; BENCHMARKS 21.1, greedy
        # tokens equal): 8B W4A16 batch 1 413.3 -> 425.2 tok/s, batch 8 1,989 -> 2,040; 27B
        # 151.3 -> 153.1, batch 8 627.2 -> 637.7; 30B-A3B bf16 316.7 -> 336.4, W4A16 350.9 ->
        # 366.5. Every GEMV but the bf16 experts' is launched plainly: launched early, the 1-2
        # row W4A16 GEMV cost the 8B 7% (383.3 with every kernel early, 410.6 with only its
        # wide calls early), the 4-bit experts the 30B-A3B 2% (358.6) and the few-row kernel
        # its batch 8 3% (1,160 against 1,194), the bf16 GEMV the 27B 2% (150.2). An early
        # grid's programs pack onto the SMs a draining GEMV grid frees (BENCHMARKS 35.2), but
        # an experts layer's attention GEMVs ("h2_experts_layer", not plain) gain early: the
        # 30B-A3B W4A16 445.5 -> 461.8. The mma.sync kernel ("mma") gains early (BENCHMARKS
        # 49.2): 8B W4A16 batch 8 (4-bit head) 2.948 -> 2.845 ms, 27B 10.674 -> 10.481.
        pdl=1, pdl_plain=("h2", "h2_wide", "dot", "dense", "moe_w4")),
    # Blackwell consumer (RTX 5090, sm120): Ampere-style MMA path, ~100 KB shared memory.
    "sm120": ArchTiles(
        name="sm120", num_sms=170,
        decode=AttentionTiles(block_n=64, num_warps=4, num_stages=2),
        prefill=PrefillTiles(block_m=64, block_n=64, num_warps=4, num_stages=2),
        prefill_wide=PrefillTiles(block_m=64, block_n=64, num_warps=4, num_stages=1),  # as sm80's
        gemv=GemmTiles(16, 64, 128, num_warps=4, num_stages=3, split_k=4),
        gemv_rows=GemmTiles(1, 64, 128, num_warps=4, num_stages=2),
        gemm_small=GemmTiles(32, 64, 64, num_warps=4, num_stages=3, split_k=2),
        gemm=GemmTiles(64, 128, 64, num_warps=4, num_stages=3),
        w4a16_dot=GemmTiles(64, 64, 128, num_warps=4, num_stages=3, split_k=4),
        elementwise_warps=4, max_kv_splits=64,
        w4a16_rows=((2, RowsTiles(1024, 8, 4)), (8, RowsTiles(512, 2, 4)), (16, RowsTiles(256, 2, 4))),
        w4a16_h2=H2_TILES),
    # RDNA3 (7900 XTX, gfx1100): wave32, 64 KB LDS, WMMA 16x16x16; two stages keep LDS in budget.
    # Attention tiles chosen by registers, untimed (no RDNA3 device; BENCHMARKS 57.1): spilled
    # VGPRs a lane, 32-token tiles on 4 waves -> 16-token tiles on 8 waves, int8 KV with int8
    # score dots: decode head_dim 128 bf16 16 -> 0, int8 226 -> 0, verify group of 5 rows int8
    # 339 -> 0, head_dim 256 (the 27B's) bf16 247 -> 65, int8 683 -> 44; prefill bf16 76 -> 0,
    # int8 423 -> 75-123. DECODE_TILES_ENV / PREFILL_TILES_ENV ("block_n=32,num_warps=4") A/B them.
    "gfx1100": ArchTiles(
        name="gfx1100", num_sms=96,
        # head_dim 256 (the 27B's) re-derives q a tile (BENCHMARKS 63): spilled VGPRs a lane, bf16
        # 65-67 -> 0, int8 44-47 -> 0; untimed
        decode=AttentionTiles(block_n=16, num_warps=8, num_stages=1, tile_q_from=256),
        decode_int8=AttentionTiles(block_n=16, num_warps=8, num_stages=1, int8_dot=True, tile_q_from=256),
        prefill=PrefillTiles(block_m=64, block_n=16, num_warps=8, num_stages=1, unmasked_key_scales=True),
        # head_dim 256, spilled VGPRs a lane (BENCHMARKS 57.2, untimed): int8 423 -> 321, bf16
        # 112 -> 83 (on sm_90 the spill-free tiles lost: BENCHMARKS 57.6); int8 with the
        # hardware conversion and unmasked K scales 45 (62.2-62.3), bf16 with q a tile 0 (63)
        prefill_wide=PrefillTiles(block_m=32, block_n=16, num_warps=8, num_stages=1,
                                  unmasked_key_scales=True, tile_q_from=256),
        gemv=GemmTiles(16, 64, 64, num_warps=4, num_stages=2, split_k=4),
        gemv_rows=GemmTiles(1, 64, 64, num_warps=4, num_stages=1),
        gemm_small=GemmTiles(32, 64, 32, num_warps=4, num_stages=2, split_k=2),
        gemm=GemmTiles(64, 64, 32, num_warps=4, num_stages=2),
        w4a16_dot=GemmTiles(32, 64, 128, num_warps=4, num_stages=1, split_k=4),
        elementwise_warps=4, max_kv_splits=32,
        mx4_gated_half_width=True,
        # the 27B at TP 2 (2 KV heads a card) as sm_90 (BENCHMARKS 60.3): 64 splits, 128 programs
        # on the 96 CUs where 32 splits left a third idle; untimed on RDNA3 (sm_80 and sm_120
        # cap at 64 splits for any head count already)
        kv_split_programs=128,
        # int8 prefill spilled VGPRs a lane with int8_to_fp16's integer form (BENCHMARKS 62.2):
        # head_dim 128 75 -> 0, with a window 123 -> 35, head_dim 256 321 -> 125; untimed
        int8_convert_hw=True,
        w4a16_rows=((2, RowsTiles(1024, 8, 4)), (8, RowsTiles(512, 2, 4)), (16, RowsTiles(256, 2, 4))),
        w4a16_h2=H2_TILES),
    # TRITON_INTERPRET=1 on the CPU: the smallest tiles tl.dot accepts, one config, fast tests.
    "interpret": ArchTiles(
        name="interpret", num_sms=4,
        decode=AttentionTiles(block_n=16, num_warps=1, num_stages=1),
        prefill=PrefillTiles(block_m=16, block_n=16, num_warps=1, num_stages=1),
        gemv=GemmTiles(16, 32, 32, num_warps=1, num_stages=1, split_k=2),
        gemv_rows=GemmTiles(1, 32, 32, num_warps=1, num_stages=1),
        gemm_small=GemmTiles(16, 32, 32, num_warps=1, num_stages=1, split_k=1),
        gemm=GemmTiles(16, 32, 32, num_warps=1, num_stages=1),
        w4a16_dot=GemmTiles(16, 32, 128, num_warps=1, num_stages=1, split_k=2),
        elementwise_warps=1, max_kv_splits=4,
        w4a16_rows=((16, RowsTiles(32, 4, 1, waves=2, min_steps=1)),),
        w4a16_h2=((8, RowsTiles(32, 4, 1, waves=2, min_steps=1)),),
        moe_h2=((1024, RowsTiles(32, 4, 1, prefetch=True, whole_k=True)),), moe_h2_tokens=8,
        moe_queue=QueueTiles(RowsTiles(32, 4, 1, prefetch=True, whole_k=True),
                             RowsTiles(32, 4, 1, prefetch=True, whole_k=True), 4, 32)),
}


def interpreting() -> bool:
    """Triton kernels run in the numpy interpreter (CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def arch_name(device: torch.device | None = None) -> str:
    """Table key for a device: 'interpret', 'gfx1100', 'sm80', 'sm90' or 'sm120'."""
    if interpreting() or device is None or device.type != "cuda":
        return "interpret"
    return _cuda_arch_name(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_arch_name(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip is not None:
        gcn = getattr(props, "gcnArchName", "") or ""
        # Every RDNA part gets the conservative wave32/64 KB entry; CDNA would want its own.
        return "gfx1100" if gcn.startswith("gfx11") or gcn.startswith("gfx12") else "gfx1100"
    major = props.major
    if major >= 12:
        return "sm120"
    if major == 9 or major == 10:
        return "sm90"
    return "sm80"


def tiles_for(device: torch.device | None = None) -> ArchTiles:
    return TABLE[arch_name(device)]


def uses_ptx(device: torch.device | None = None) -> bool:
    """Whether kernels on this device take their inline-PTX forms (USE_ASM, the V tile's
    int8 conversion): NVIDIA arches;
    the interpreter and gfx1100 run the plain-Triton twins."""
    return tiles_for(device).name.startswith("sm")


def decode_tiles(device: torch.device | None, int8_kv: bool, head_dim: int = 128,
                 sequences: int = 1) -> AttentionTiles:
    """The decode split kernel's tiles on this device for a KV format, a head size and the
    sequences of a call (ArchTiles.decode_int8_wide for int8 heads past 128 from its sequence
    count on; DECODE_TILES_ENV's changes applied)."""
    t = tiles_for(device)
    tiles = t.decode
    if int8_kv:
        wide = t.decode_int8_wide
        use_wide = wide is not None and head_dim > 128 and sequences >= wide.min_sequences
        tiles = wide.tiles if use_wide else t.decode_int8 or tiles
    return env_tiles(tiles, DECODE_TILES_ENV)


def q_each_tile(tiles: AttentionTiles | PrefillTiles, head_dim: int, int8_kv: bool) -> bool:
    """Whether an attention kernel with these tiles re-derives q in every KV tile at this head
    size and KV format (tile_q_from; the prefill's for bf16 KV only; the kernels' TILE_Q,
    common.per_tile)."""
    if isinstance(tiles, PrefillTiles) and int8_kv:
        return False
    return 0 < tiles.tile_q_from <= head_dim


def prefill_tiles(device: torch.device | None, head_dim: int = 128) -> PrefillTiles:
    """The prefill attention kernel's tiles on this device for a head size (ArchTiles.prefill_wide
    past 128; PREFILL_TILES_ENV's changes applied)."""
    t = tiles_for(device)
    return env_tiles(t.prefill_wide if head_dim > 128 and t.prefill_wide is not None else t.prefill,
                     PREFILL_TILES_ENV)


# A/B runs without a patched tree: "field=value,..." over this device's attention tiles, e.g.
# "block_n=32,num_warps=4,int8_dot=0" (gfx1100's tiles before BENCHMARKS 57.1)
DECODE_TILES_ENV = "HOMELAB_LLM_DECODE_TILES"
PREFILL_TILES_ENV = "HOMELAB_LLM_PREFILL_TILES"


def env_tiles(tiles, env: str):
    """`tiles` (a tiles dataclass) with the A/B switch `env`'s "field=value,..." changes applied."""
    change = tiles_override(env, os.environ.get(env, ""), type(tiles))
    return dataclasses.replace(tiles, **change) if change else tiles


@functools.lru_cache(maxsize=16)
def tiles_override(env: str, spec: str, cls: type) -> dict:
    """A tiles A/B switch's text as field changes of the dataclass cls ({} when empty)."""
    kinds = {f.name: bool if f.type == "bool" else int for f in dataclasses.fields(cls)}
    return field_override(env, spec, kinds)


@functools.lru_cache(maxsize=None)
def num_sms(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


# A/B runs without a patched tree: ArchTiles.kv_split_programs for this process ("0": off)
KV_SPLIT_PROGRAMS_ENV = "HOMELAB_LLM_KV_SPLIT_PROGRAMS"


def kv_split_cap(device: torch.device | None, kv_heads: int) -> int:
    """The most KV splits a decode call of one sequence takes on this device with kv_heads KV
    heads a rank: the arch's max_kv_splits, or the power of two at most kv_split_programs /
    kv_heads where that is more (KV_SPLIT_PROGRAMS_ENV overriding the arch's count)."""
    t = tiles_for(device)
    programs = split_programs_override(os.environ.get(KV_SPLIT_PROGRAMS_ENV, ""))
    want = (t.kv_split_programs if programs is None else programs) // max(1, kv_heads)
    return max(t.max_kv_splits, 1 << (want.bit_length() - 1) if want else 0)


@functools.lru_cache(maxsize=8)
def split_programs_override(spec: str) -> int | None:
    """KV_SPLIT_PROGRAMS_ENV's text as a program count (None when empty)."""
    spec = spec.strip()
    if spec and not spec.isdigit():
        raise ValueError(f"{KV_SPLIT_PROGRAMS_ENV} must be a whole number of programs, got {spec!r}")
    return int(spec) if spec else None


def device_sms(device: torch.device) -> int:
    if device.type != "cuda" or interpreting():
        return tiles_for(None).num_sms
    return num_sms(device.index if device.index is not None else torch.cuda.current_device())


# Which W4A16 kernel serves M rows, per arch: the first (max_rows, kernel) with m <= max_rows.
# "rows": w4a16_rows.py (multi-row GEMV: reads each word once for all rows, CUDA-core FMAs);
# "h2": w4a16_h2.py (1-8 rows, packed fp16x2 dequant and FMAs: two weights per instruction);
# "gemv": w4a16_gemv.py (the older one-row GEMV); "dot": w4a16_dot.py (dequantize once,
# tensor-core dots; a few rows); "dotL": the same with the weights as the dots' left operand
# (four nibble-pair dots a K step, ArchTiles.w4a16_dot_left); "gemm": w4a16.py (prefill). Each
# kernel's tiles come from its ArchTiles entry. Update from `python benchmarks/w4a16_sweep.py`
# (its summary prints a row).
W4A16_ROUTES: dict[str, tuple[tuple[int, str], ...]] = {
    # H200 sweep (benchmarks/w4a16_sweep.py --quick, 8B shapes, one step's linears): 1 row: the
    # older GEMV 2.88 ms, the multi-row GEMV 3.46-3.61, the dot kernel 3.95; 8 rows: dot 4.19 ms
    # (1.46x the 1-row time), the multi-row GEMV 10.4. The multi-row kernel ("rows") compiles
    # everywhere and stays in the interpreter's entry (its tests route through it) until a device
    # measures it ahead; the others keep the older GEMV where they were not measured.
    # Prefill chunks ("deq": the weight dequantized once into the BLAS GEMM, w4a16_deq.py): on the
    # H200 the Triton GEMM ran a 27B model's linears at 2,048 rows in 420 ms, bf16 BLAS in 126;
    # a margin that wide is taken on every GPU above 256 rows until each is measured.
    "sm80": ((2, "gemv"), (64, "dot"), (256, "gemm"), (1 << 62, "deq")),
    # H200 sweep 10.2 (27B shapes, one step's linears): 16-row dot programs with permuted x up to
    # 40 rows (28.9 ms; deq 29.8, the Triton GEMM 80.7), then deq (64 rows 30.5 ms vs dot 39.2;
    # 256: 35.5 vs GEMM 71.4; 2,048: 142.7 vs GEMM 420.9, bf16 BLAS 127.7). 1-2 rows: the
    # packed-half GEMV (sweep 10.7: 6.52 / 9.24 ms vs the older GEMV 8.49 / the dot kernel 12.37).
    # 17.1: 17-64 rows on the left-operand kernel (12-14% below the eight-dot kernel and deq).
    # 20.1: since its four nibble-pair dots a step, 3-64 rows (8B step linears at 3 / 8 / 16
    # rows 3.48 / 3.48 / 3.54 ms against the eight-dot kernel's 3.64 / 4.03 / 5.21).
    # 49: 2-8 rows on the mma.sync kernel, its pairs' launch forming the norm or the SiLU (H100,
    # engine steps' graph GPU time, same tokens, against these rows on h2 / dotL): 8B W4A16
    # (4-bit head) batch 2 / 4 / 8 3.139 / 3.112 / 3.214 -> 2.564 / 2.613 / 2.725 ms; 27B batch
    # 4 / 8 10.394 / 10.885 -> 9.323 / 10.026, batch 8 with int8 KV 11.274 -> 10.502.
    "sm90": ((1, "h2"), (8, "mma"), (64, "dotL"), (1 << 62, "deq")),
    "sm120": ((2, "gemv"), (64, "dot"), (256, "gemm"), (1 << 62, "deq")),
    "gfx1100": ((2, "gemv"), (32, "dot"), (256, "gemm"), (1 << 62, "deq")),
    # The interpreter routes decode rows to the packed-half GEMV so the kernel tests run it
    # (its plain-Triton twin of the PTX); GPUs keep their measured kernels until a sweep says.
    "interpret": ((2, "h2"), (32, "dot"), (64, "gemm"), (1 << 62, "deq")),
}


# A/B runs without a patched tree: "lo-hi" (or one count) routes that many rows to the
# hand-placed mma.sync kernel (kernels/w4a16_mma.py) on NVIDIA GPUs, ahead of the table;
# "off" routes the table's mma rows to the kernels they took before it (MMA_OFF_ROUTES)
MMA_ROWS_ENV = "HOMELAB_LLM_W4A16_MMA"
MMA_OFF = (0, 0)
MMA_OFF_ROUTES = ((2, "h2"), (64, "dotL"))


@functools.lru_cache(maxsize=8)
def mma_rows_override(spec: str) -> tuple[int, int] | None:
    """MMA_ROWS_ENV's text as an inclusive row range (None when empty, MMA_OFF for "off")."""
    if not spec.strip():
        return None
    if spec.strip().lower() == "off":
        return MMA_OFF
    lo, _, hi = spec.strip().partition("-")
    try:
        rows = (int(lo), int(hi or lo))
    except ValueError:
        raise ValueError(f"{MMA_ROWS_ENV}={spec!r}: expected rows 'lo-hi', one count or 'off', e.g. '2-8'") from None
    if not 1 <= rows[0] <= rows[1]:
        raise ValueError(f"{MMA_ROWS_ENV}={spec!r}: expected 1 <= lo <= hi")
    return rows


def w4a16_route(m: int, device: torch.device | None = None) -> str:
    """The W4A16 kernel ("rows", "h2", "gemv", "dot", "dotL", "mma", "gemm" or "deq") the table
    picks for m rows on this device (MMA_ROWS_ENV first, on NVIDIA GPUs)."""
    arch = arch_name(device)
    mma = mma_rows_override(os.environ.get(MMA_ROWS_ENV, ""))
    if mma is not None and mma != MMA_OFF and arch.startswith("sm") and mma[0] <= m <= mma[1]:
        return "mma"
    kernel = next(kernel for rows, kernel in W4A16_ROUTES[arch] if m <= rows)
    if kernel == "mma" and mma == MMA_OFF:
        return next(kernel for rows, kernel in MMA_OFF_ROUTES if m <= rows)
    return kernel


def rows_entry(entries: tuple, m: int, past_last: bool = False):
    """The tiles of the first (max_rows, tiles) entry with m <= max_rows; past them the last
    entry's tiles with past_last, else None (None for no entries either way)."""
    fallback = entries[-1][1] if past_last and entries else None
    return next((t for rows, t in entries if m <= rows), fallback)


def dot_left_tiles(m: int, device: torch.device | None = None,
                   n: int | None = None, k: int | None = None) -> GemmTiles | None:
    """The left-operand few-row tiles (ArchTiles.w4a16_dot_left) this device's table gives m rows
    (over k inputs: a w4a16_dot_left_short_k entry covering both first; of n output columns:
    outputs of at most THIN_N columns take a w4a16_dot_left_thin entry covering m where there
    is one), None where it has none; DOT_LEFT_ENV's fields changed."""
    arch = tiles_for(device)
    short = next((t for rows, max_k, t in arch.w4a16_dot_left_short_k if m <= rows and k <= max_k),
                 None) if k is not None else None
    thin = rows_entry(arch.w4a16_dot_left_thin, m) if n is not None and n <= THIN_N else None
    t = short or thin or rows_entry(arch.w4a16_dot_left, m, past_last=True)
    change = dot_left_override(os.environ.get(DOT_LEFT_ENV, ""))
    return dataclasses.replace(t, **change) if t is not None and change else t


# A/B runs without a patched tree: "field=value,..." over every left-operand entry the table
# gives (the GemmTiles form switches, stages and tiles: "x_pairs=1", "num_stages=2", "block_m=32":
# rows a program at most)
DOT_LEFT_ENV = "HOMELAB_LLM_DOT_LEFT"
_DOT_LEFT_FIELDS = {"scaled": bool, "int_zeros": bool, "pair_accs": bool, "joined": bool, "x_pairs": bool,
                    "num_stages": int, "num_warps": int, "block_n": int, "block_m": int}


@functools.lru_cache(maxsize=8)
def dot_left_override(spec: str) -> dict:
    """DOT_LEFT_ENV's text as GemmTiles field changes ({} when empty)."""
    return field_override(DOT_LEFT_ENV, spec, _DOT_LEFT_FIELDS)


def field_override(env: str, spec: str, kinds: dict[str, type]) -> dict:
    """An A/B switch's "field=number,..." text as dataclass field changes ({} when empty); an
    unknown field or a value that is not a number is an error naming the fields."""
    change = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        name, _, value = item.partition("=")
        kind = kinds.get(name.strip())
        if kind is None or not value.strip().isdigit():
            raise ValueError(f"{env}={spec!r}: expected field=number items, fields {', '.join(sorted(kinds))}")
        change[name.strip()] = kind(int(value))
    return change


def rows_tiles(m: int, device: torch.device | None = None) -> RowsTiles:
    """The multi-row GEMV tiles (w4a16_rows.py) this device's table gives m rows."""
    return rows_entry(tiles_for(device).w4a16_rows, m, past_last=True)


def h2_fused_tiles(m: int, device: torch.device | None = None) -> RowsTiles | None:
    """The packed-half GEMV tiles for m rows whose input is formed in the prologue, where this
    device's table has an entry (ArchTiles.w4a16_h2_fused), else None."""
    return rows_entry(tiles_for(device).w4a16_h2_fused, m)


def thin_entry(entries: tuple[tuple[int, int, RowsTiles], ...], m: int) -> RowsTiles | None:
    """The tiles of the first (min_rows, max_rows, tiles) entry covering m rows, else None."""
    return next((t for lo, hi, t in entries if lo <= m <= hi), None)


def h2_tiles(m: int, device: torch.device | None = None, n: int | None = None,
             fused: bool = False, k: int | None = None, group_size: int = 128) -> RowsTiles:
    """The packed-half GEMV tiles (w4a16_h2.py) this device's table gives m rows (of n output
    columns: thin outputs may have their own entry; fused: the call forms its input in the
    prologue, which may have its own entry too; k and group_size: the input, for whole-K
    entries)."""
    arch = tiles_for(device)
    if n is not None and k is not None:
        whole = next((t for rows, max_n, max_k, t in arch.w4a16_h2_whole_k
                      if m <= rows and n <= max_n and k <= max_k and whole_k_fits(t, k, group_size)),
                     None)
        if whole is not None:
            return whole
    thin_n = n is not None and n <= THIN_N
    if fused:
        entry = h2_fused_tiles(m, device)
        if entry is not None:
            thin = thin_entry(arch.w4a16_h2_fused_thin, m) if thin_n else None
            return thin or entry
    thin = thin_entry(arch.w4a16_h2_thin, m) if thin_n else None
    return thin or rows_entry(arch.w4a16_h2, m, past_last=True)


def gemm_tiles(m: int, device: torch.device | None) -> GemmTiles:
    t = tiles_for(device)
    if m <= 16:
        return t.gemv
    if m <= 64:
        return t.gemm_small
    return t.gemm


@dataclass(frozen=True)
class GdnTiles:
    """Gated DeltaNet kernels (gdn_*.py). chunk: tokens per chunk of the prefill rule (64 on GPUs,
    as the issue fixes; the interpreter takes 16 so small tests cross chunks); block_v: value
    columns per program of the sequential chunk kernel and of the decode step (the state tile is
    Dk x block_v fp32 in registers); conv_t x conv_c: tokens x channels per conv program.
    split: the prefill's sequential walk only carries the state (state_warps per program) and a
    parallel kernel computes the outputs from the stored per-chunk states, out_block_v value
    columns per program (gdn_chunk_split.py); False: outputs inside the walk (gdn_chunk.py).
    verify_*: a verify step of at most verify_groups sequences (rows_per_seq > 1) carries each
    state tile through K + 1 rows, a chain of dependent sums over Dk: there the decode step takes
    verify_block_v columns and verify_warps warps a program instead (one warp: its sums stay in
    the warp; narrower: twice the programs for the few heads of one sequence); verify_groups 0:
    none (the other two are then unread). verify_wide_*: a verify step of more sequences takes
    these (0: the decode tiles). solve_rows: the diagonal blocks of the prep kernel's triangular
    solve (gdn_chunk._unit_lower_inverse): chunk / solve_rows - 1 fp32 dots fold the blocks
    together; solve_rows = chunk is forward substitution alone, no dots."""

    chunk: int
    block_v: int
    chunk_warps: int
    chunk_stages: int
    decode_block_v: int
    decode_warps: int
    conv_t: int
    conv_c: int
    conv_warps: int
    split: bool
    state_warps: int
    out_block_v: int
    verify_groups: int = 0
    verify_block_v: int = 0
    verify_warps: int = 0
    verify_wide_block_v: int = 0
    verify_wide_warps: int = 0
    solve_rows: int = 16


GDN_TABLE: dict[str, GdnTiles] = {
    "sm80": GdnTiles(64, 32, 8, 2, 32, 4, 32, 128, 4, True, 4, 64),
    # verify: the 27B's 48 heads x 128, graph-timed on the H100 (BENCHMARKS 43.3), us at 32 x 4
    # warps -> 16 x 1: one sequence, 2 / 3 / 5 rows 7.96 / 10.47 / 15.87 -> 7.15 / 9.22 / 13.48;
    # two 10.63 / 15.57 / 23.14 -> 9.32 / 11.77 / 21.17; four 18.29 / 27.43 / 46.95 -> 14.48 /
    # 21.19 / 40.65; eight 38.1 / 64.2 / 78.7 at 2 / 4 / 5 rows -> 35.6 / 66.2 / 78.8 (even, kept)
    # and at 1 row (plain decode) 15.22 -> 17.75 (a loss). More than four sequences (BENCHMARKS
    # 45.4, eight at 2 / 3 / 4 / 5 rows): 32 x 4 37.64 / 51.98 / 64.19 / 78.33 -> 32 x 2 34.37 /
    # 46.29 / 63.35 / 75.71 (16 x 1 35.80 / 49.62 / 66.65 / 79.64, 64 x 4 34.20 / 46.08 / 67.22 /
    # 79.61). Since the verify kernel keeps rows pending instead of storing a state a row (BENCHMARKS
    # 47.2, H100, the 27B's batch-8 verify, x a plain step at K = 1 / 2 / 3 / 4): 32 x 2 1.048 /
    # 1.211 / 1.239 / 1.513 -> 16 x 1 1.043 / 1.179 / 1.198 / 1.462 (32 x 1 1.075 / 1.234 at K =
    # 1 / 2, 16 x 2 1.069 / 1.222): the verify tiles for any count of sequences.
    "sm90": GdnTiles(64, 32, 8, 2, 32, 4, 32, 128, 4, True, 4, 64,
                     verify_groups=4, verify_block_v=16, verify_warps=1,
                     verify_wide_block_v=16, verify_wide_warps=1),
    "sm120": GdnTiles(64, 32, 8, 2, 32, 4, 32, 128, 4, True, 4, 64),
    # RDNA3: the chunk kernel's dot operands sit in the 64 KB LDS; a narrower value tile keeps it in.
    # Output kernel at 32 value columns: 239 VGPRs, no spills (64 spilled 16). The prep kernel
    # (the only one chunk_warps sizes under `split`; BENCHMARKS 57.1, 60, untimed): its solve's
    # fp32 dots have no WMMA form on RDNA3, and their FMA form spilled (VGPRs a lane, 16-row
    # blocks) 1,940-2,022 on 4 waves, 1,199-1,249 on 8, 583-623 on 16; as forward substitution
    # over the whole chunk (solve_rows 64, no dots) 161-228 / 0-76 / 0 (197-228 VGPRs). The state
    # walk on 8 waves (BENCHMARKS 63.5): 4 spilled 8 VGPRs a lane in one scenario, 8 none (202
    # VGPRs), at the same program count (the 27B at TP 2: 96 a sequence, one a CU), untimed.
    "gfx1100": GdnTiles(64, 32, 16, 1, 32, 4, 32, 128, 4, True, 8, 32, solve_rows=64),
    "interpret": GdnTiles(16, 16, 1, 1, 16, 1, 16, 32, 1, True, 1, 16,
                          verify_groups=1, verify_block_v=8, verify_warps=1,
                          verify_wide_block_v=8, verify_wide_warps=2),
}


def gdn_tiles(device: torch.device | None = None) -> GdnTiles:
    return env_tiles(GDN_TABLE[arch_name(device)], GDN_TILES_ENV)


# A/B runs without a patched tree: "field=value,..." over this device's GdnTiles
# ("verify_wide_block_v=32,verify_wide_warps=2": other verify tiles for 5+ sequences)
GDN_TILES_ENV = "HOMELAB_LLM_GDN_TILES"


def gdn_step_tiles(device: torch.device | None, groups: int, rows_per_seq: int) -> tuple[int, int]:
    """(block_v, warps) of the decode / verify step kernel for `groups` sequences of
    rows_per_seq rows each (GdnTiles.verify_*)."""
    t = gdn_tiles(device)
    if rows_per_seq > 1 and groups <= t.verify_groups:
        return t.verify_block_v, t.verify_warps
    if rows_per_seq > 1 and t.verify_wide_block_v:
        return t.verify_wide_block_v, t.verify_wide_warps
    return t.decode_block_v, t.decode_warps


@dataclass(frozen=True)
class MoeDecodeTiles:
    """The fused MoE decode kernels (fused_moe_decode.py). block_n: output columns per program;
    block_k: K values per step (4-bit: 8 x word rows, capped at the group); steps: K steps per
    program, so K splits into K / (block_k x steps) programs whatever the batch (results do not
    depend on T); num_warps."""

    block_n: int
    block_k: int
    steps: int
    num_warps: int


@dataclass(frozen=True)
class RouterTiles:
    """The fused router (moe_router.route_gate_topk): block_e experts' logits per program, block_k
    hidden values per step; one_token_warps: num_warps for a single token (0: num_warps), where
    the last program's softmax top-k, a chain of reductions, is most of the launch."""

    block_e: int
    block_k: int
    num_warps: int
    one_token_warps: int = 0


@dataclass(frozen=True)
class MoeDecodeArch:
    w4: MoeDecodeTiles
    dense: MoeDecodeTiles  # bf16/fp16 experts: a [block_n, block_k] tile of rows, K contiguous
    router: RouterTiles


# Decode is latency bound at batch 1: one K step per program keeps every load of a program in
# flight at once, and the grid (experts x column blocks x K splits) fills the device in one wave.
# Starting points, to be measured with `python3 benchmarks/moe_gpu.py --sections sweep_decode`.
MOE_DECODE_TABLE: dict[str, MoeDecodeArch] = {
    "sm80": MoeDecodeArch(MoeDecodeTiles(64, 128, 1, 4), MoeDecodeTiles(32, 128, 2, 4),
                          RouterTiles(1, 1024, 4)),
    # H200, Qwen3-30B-A3B layer (router + gate_up + down, us): 4-bit block_n 64 with 2 warps
    # b1 30.6 / b8 140.9 against 4 warps 30.9 / 179.9 (block_n 128: 33.6 / 163.1; 32: 36.1 /
    # 228.7). Router (BENCHMARKS 18.2): one warp for one token, b1 28.3 against 29.5 with 4
    # warps; at b8 one warp lost (143.9 against 137.9). The whole 2048-wide row a step (22.2):
    # whole model bf16 b1 344.5 against 339.1 tok/s, W4A16 373.3 / 369.4, b8 +1.0-1.2%.
    "sm90": MoeDecodeArch(MoeDecodeTiles(64, 128, 1, 2), MoeDecodeTiles(32, 128, 2, 4),
                          RouterTiles(1, 2048, 4, one_token_warps=1)),
    "sm120": MoeDecodeArch(MoeDecodeTiles(64, 128, 1, 4), MoeDecodeTiles(32, 128, 2, 4),
                           RouterTiles(1, 1024, 4)),
    # RDNA3: wave32, so 4 warps are 128 lanes as on NVIDIA; fewer SMs (96): same tiles.
    "gfx1100": MoeDecodeArch(MoeDecodeTiles(64, 128, 1, 4), MoeDecodeTiles(32, 128, 2, 4),
                             RouterTiles(1, 1024, 4)),
    "interpret": MoeDecodeArch(MoeDecodeTiles(32, 32, 1, 1), MoeDecodeTiles(16, 32, 2, 1),
                               RouterTiles(4, 32, 1)),
}


def moe_decode_tiles(device: torch.device | None = None) -> MoeDecodeArch:
    return MOE_DECODE_TABLE[arch_name(device)]


def moe_h2_tiles(device: torch.device | None, k: int, group_size: int) -> RowsTiles | None:
    """The whole-K tiles of this device's moe_h2 entries for one of a token's expert GEMVs over
    a K-long input, or None (fused_moe_decode's kernels serve it)."""
    return next((t for max_k, t in tiles_for(device).moe_h2
                 if k <= max_k and whole_k_fits(t, k, group_size)), None)


@dataclass(frozen=True)
class DenseGemvTiles:
    """bf16/fp16 decode GEMV (dense_gemv.py): block_n weight rows x block_k columns per K step
    (block_k / (32 x num_warps) x 8 = 16-byte loads per thread per row), num_stages: 1 loads
    one K step at a time, more stream the step's words through shared memory; waves: programs
    per SM that split-K aims for (w4a16_gemv.pick_split). max_rows: the most activation rows it
    serves (more go to the BLAS GEMM); 0 turns the route off on that arch. kinds: tiles of their
    own for "plain", "norm" (RMSNorm prologue) or "gated" (SiLU-and-mul epilogue) calls."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 1
    waves: int = 4
    max_rows: int = 4
    # K step at 2-4 rows: each row keeps its own [block_n, block_k / 8] accumulator, so a
    # shorter step keeps registers near the 1-row kernel's (sm_90 compile: 1 row x 512 80-94,
    # gated 166; 4 rows x 256 96-122, gated 168; no spills)
    rows_block_k: int = 256
    kinds: tuple[tuple[str, "DenseGemvTiles"], ...] = ()
    # outputs at most this narrow take the GEMV up to dispatch.SKINNY_GEMV_ROWS rows (0: none)
    skinny_n: int = 0


# On the H200 (docs/BENCHMARKS.md 13.1) the GEMV with 1-4 weight rows a program and 2-4 warps
# (tiles the earlier sweeps never tried) beats cuBLAS at 1 row on the 8B's linears with the norm
# and SiLU folded in (the 8B engine at batch 1: 240.4 tok/s against 214.5): sm_90 takes the
# route for 1 row. At 2-4 rows its best tiles read 45-131% of the copy rate where cuBLAS reads
# 88-150%: BLAS there.
# ("% of copy" counts read + write bytes of a device copy: a GEMV that only reads can pass 100%.)
# Elsewhere it is off until a device measures it ahead; HOMELAB_LLM_DENSE_GEMV=1 forces it for
# measurement (benchmarks/bf16_gemv_gpu.py --sweep).
DENSE_GEMV_TABLE: dict[str, DenseGemvTiles] = {
    "sm80": DenseGemvTiles(16, 512, 4, max_rows=0),
    # bf16_gemv_gpu.py --sweep, 8B shapes at 1 row (us): qkv with the norm 15.6 (4 x 512, 2
    # warps), o 10.2 and down 29.1 (1 x 1024, 2 warps), gate_up with both 58.2 (2 x 1024, 4)
    # skinny_n: Qwen3.6-27B's in_proj_ba (5120 -> 96) at 2 rows, verify K = 1 forward 10.05 ->
    # 9.95 ms against cuBLAS's split-K + reduce (BENCHMARKS 17.2)
    "sm90": DenseGemvTiles(1, 1024, 2, max_rows=1,
                           kinds=(("norm", DenseGemvTiles(4, 512, 2)),
                                  ("gated", DenseGemvTiles(2, 1024, 4))), skinny_n=128),
    "sm120": DenseGemvTiles(16, 512, 4, max_rows=0),
    # RDNA3: wave32, so 4 warps are 128 lanes as on NVIDIA; a smaller K step keeps VGPRs low.
    "gfx1100": DenseGemvTiles(16, 256, 4, rows_block_k=128, max_rows=0),
    "interpret": DenseGemvTiles(4, 32, 1, waves=2, rows_block_k=16),
}


def dense_gemv_tiles(device: torch.device | None = None, kind: str = "plain") -> DenseGemvTiles:
    """This device's GEMV tiles for a call of `kind` ("plain", "norm" or "gated"); max_rows
    always comes from the arch's entry."""
    arch = DENSE_GEMV_TABLE[arch_name(device)]
    return next((t for name, t in arch.kinds if name == kind), arch)
