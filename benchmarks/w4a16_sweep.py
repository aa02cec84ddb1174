"""W4A16 decode kernels on a model's linears, every variant in one run (< 4 min on an H200).

    python3 benchmarks/w4a16_sweep.py [--quick] [--model 8b|27b|30b-a3b[,...]] [--m 1,2,4,8,16] [--tp 1,2]

For each linear shape (8b: Llama-3.1-8B's qkv, o, gate_up, down x 32 layers and the lm_head;
27b: the Qwen3.6-27B hybrid's; TP shards: column-parallel halves N, row-parallel halves K) and
each row count M, every kernel variant is timed inside one CUDA graph that cycles through enough
copies of the weight to overflow L2 (gpu_timing.py). Reported per shape: microseconds, GB/s of
the packed weight (nibbles + scales + biases), % of the copy rate of the same bytes measured in
the same run, the peers (torch bf16 matmul; torch's int4 tinygemm, gpt-fast's int4 kernel), and
the worst per-row relative error against the dequantized reference (bound 1e-2: bf16 output
rounding is ~4e-3).

Variants: "gemv" the older one-row GEMV, "rows*" the multi-row GEMV (tiles.RowsTiles; "rows" is
the arch table's entry, the others the candidates in ROWS_TILES), "h2*" the packed-half GEMV
(1-8 rows; "h2" the table's entry, the others H2_TILES), "dot*" the few-row tensor-core kernel,
"gemm" the prefill kernel. The summary weighs each shape by its layer count: per M, one decode
step's linear time per variant, the cost of M rows over 1 row, and the W4A16_ROUTES row for
engine/kernels/tuning.py that the numbers suggest; per M, the packed-half tiles for thin and for
wide outputs that do best over every model and TP given (`--model 8b,27b,30b-a3b`: one compile
pass), against the table's own.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import re
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_timing import copies_for, copy_rate_gbs, default_jobs, graph_ms, precompile  # noqa: E402
from homelab_llm.engine.kernels.ref import dequantize_w4_ref  # noqa: E402
from homelab_llm.engine.kernels.tuning import (THIN_N, GemmTiles, RowsTiles, dot_left_tiles,  # noqa: E402
                                               gemm_tiles, tiles_for)
from homelab_llm.engine.kernels.w4a16 import w4a16_matmul  # noqa: E402
from homelab_llm.engine.kernels.w4a16_deq import w4a16_deq_matmul  # noqa: E402
from homelab_llm.engine.kernels.pair_order import pair_order  # noqa: E402
from homelab_llm.engine.kernels.w4a16_dot import dot_grid, w4a16_dot  # noqa: E402
from homelab_llm.engine.kernels.w4a16_gemv import pick_split, w4a16_gemv  # noqa: E402
from homelab_llm.engine.kernels.w4a16_h2 import MAX_ROWS as H2_MAX_ROWS, w4a16_h2  # noqa: E402
from homelab_llm.engine.kernels.w4a16_mma import MAX_ROWS as MMA_MAX_ROWS, MmaTiles, prep_pairs, w4a16_mma  # noqa: E402
from homelab_llm.engine.kernels.w4a16_rows import w4a16_rows  # noqa: E402
from homelab_llm.engine.model.w4a16_dummy import random_w4  # noqa: E402

# name: (K, N, layers that run it per step, parallel style: "col" splits N, "row" splits K)
MODELS = {
    "8b": {
        "qkv": (4096, 6144, 32, "col"),
        "o_proj": (4096, 4096, 32, "row"),
        "gate_up": (4096, 2 * 14336, 32, "col"),
        "down": (14336, 4096, 32, "row"),
        "lm_head": (4096, 128256, 1, "col"),
    },
    "30b-a3b": {  # Qwen3-30B-A3B's attention linears (the experts have their own kernels)
        "attn.qkv": (2048, 32 * 128 + 2 * 4 * 128, 48, "col"),
        "attn.o_proj": (32 * 128, 2048, 48, "row"),
        "lm_head": (2048, 151936, 1, "col"),
    },
    "27b": {
        "gdn.in_proj_qkvz": (5120, 2 * 2048 + 2 * 6144, 48, "col"),
        "gdn.out_proj": (6144, 5120, 48, "row"),
        "attn.qkv": (5120, 2 * 24 * 256 + 2 * 4 * 256, 16, "col"),
        "attn.o_proj": (24 * 256, 5120, 16, "row"),
        "mlp.gate_up": (5120, 2 * 17408, 64, "col"),
        "mlp.down": (17408, 5120, 64, "row"),
    },
}

# Candidate entries for tuning.TABLE[arch].w4a16_rows (block_n, wrows, warps, stages, waves,
# min_steps): columns per thread c = block_n / (128 x warps) (c x 4 words per word row, 128-bit
# loads), word rows per step, programs per SM. sm_90 compiles (registers, PTX instructions per
# weight at 1 row): c8k8 80-96 regs 5.1; c16k8 255 regs 4.8; c8k16 168 regs 5.0; c4k16 255 regs
# 5.7. The table's own entry is the plain "rows".
ROWS_TILES = {  # name: (tiles, the row counts it is tried at: compiles are most of the run)
    "rows.c8k8w8": (RowsTiles(1024, 8, 4, waves=8, min_steps=1), (1, 2)),
    "rows.c16k8": (RowsTiles(2048, 8, 4), (1, 2)),
    "rows.c8k16": (RowsTiles(1024, 16, 4), (1,)),
    "rows.c4k16": (RowsTiles(512, 16, 4), (1,)),
    "rows.c8k4": (RowsTiles(1024, 4, 4), (2, 4)),
    "rows.c4k4": (RowsTiles(512, 4, 4), (4,)),
    "rows.c4k2w8": (RowsTiles(512, 2, 4, waves=8), (4, 8)),
}
# Candidate `w4a16_dot=` entries (block_m, block_n, block_k, warps, stages, waves). sm_90 compiles
# at 8 rows (PTX instructions per weight): table 128 x 8 warps 5.7; 256 x 8 warps 4.4 (128
# registers); 128 x 4 warps 5.0.
DOT_TILES = {
    "dot.bn256w8": GemmTiles(64, 256, 128, num_warps=8, num_stages=3, split_k=4),
    "dot.bn256w8s2": GemmTiles(64, 256, 128, num_warps=8, num_stages=2, split_k=4),
    "dot.bn128w4": GemmTiles(64, 128, 128, num_warps=4, num_stages=3, split_k=4),
    # 16 or 32 rows a program: more programs read each weight tile (from L2 after the first)
    "dot.bm16": GemmTiles(16, 128, 128, num_warps=8, num_stages=3, split_k=4),
    "dot.bm16w4": GemmTiles(16, 128, 128, num_warps=4, num_stages=3, split_k=4),
    "dot.bm32": GemmTiles(32, 128, 128, num_warps=8, num_stages=3, split_k=4),
    "dot.bm16bn64w4": GemmTiles(16, 64, 128, num_warps=4, num_stages=3, split_k=4),
    "dot.bm16k256": GemmTiles(16, 128, 256, num_warps=8, num_stages=3, split_k=4),
    "dot.bm16s4": GemmTiles(16, 128, 128, num_warps=8, num_stages=4, split_k=8),
    # deeper pipelines (the split comes from launch_fit.balance_split on a GPU, not split_k)
    "dot.bn64w4s5": GemmTiles(16, 64, 128, num_warps=4, num_stages=5, split_k=4),
    "dot.bn256s3": GemmTiles(16, 256, 128, num_warps=8, num_stages=3, split_k=4),
}
# Candidate `w4a16_h2=` entries (packed-half GEMV, w4a16_h2.py), named c<columns per thread>k<word
# rows>w<waves>[p: next-step prefetch][W<warps> where not 4]. sm_90 compiles (SASS instructions
# per weight; registers):
# 1 row c8k8 1.65 (80; p 168), c16k8 1.55 (122), c8k16 1.53 (154); 2 rows c8k8 2.7 (130; p
# 255), c8k16 (~2.5); 4 rows c8k4 5.1 (168; p 249), c4k4 6.1 (128); 8 rows c4k2 11.3 (168),
# c4k4 9.1 (255). The table's own entry is the plain "h2" (tuning.H2_TILES).
H2_TILES = {
    "h2.c8k8w8": (RowsTiles(1024, 8, 4, waves=8, min_steps=1), (1,)),
    "h2.c16k8w8": (RowsTiles(2048, 8, 4, waves=8, min_steps=1), (1,)),
    "h2.c8k16w8": (RowsTiles(1024, 16, 4, waves=8, min_steps=1), (1, 2)),
    "h2.c8k8w16": (RowsTiles(1024, 8, 4, waves=16, min_steps=1), (1, 2)),
    "h2.c8k8w8p": (RowsTiles(1024, 8, 4, waves=8, min_steps=1, prefetch=True), (2,)),
    "h2.c8k4w8p": (RowsTiles(1024, 4, 4, waves=8, min_steps=1, prefetch=True), (3, 4, 5)),
    "h2.c4k4": (RowsTiles(512, 4, 4), (3, 4, 5, 8)),
    # 3-8 rows (verify forwards, batch 2-8 decode) against the dot kernel that serves them
    "h2.c8k4w8": (RowsTiles(1024, 4, 4, waves=8, min_steps=1), (3, 4, 5, 8)),
    "h2.c4k4w8": (RowsTiles(512, 4, 4, waves=8, min_steps=1), (3, 4, 5, 8)),
    "h2.c4k8w8": (RowsTiles(512, 8, 4, waves=8, min_steps=1), (3, 4)),
    "h2.c2k8w8": (RowsTiles(256, 8, 4, waves=8, min_steps=1), (3, 4, 5, 8)),
    "h2.c2k4w8": (RowsTiles(256, 4, 4, waves=8, min_steps=1), (5, 8)),
    "h2.c4k2w8": (RowsTiles(512, 2, 4, waves=8, min_steps=1), (5, 8)),
    "h2.c4k4s2w8": (RowsTiles(512, 4, 4, num_stages=2, waves=8, min_steps=1), (3, 4, 5, 8)),
    "h2.c2k8W2w8": (RowsTiles(128, 8, 2, waves=8, min_steps=1), (3, 4, 5, 8)),
    # s<n>: the K loop software-pipelined through shared memory (cp.async, n stages, no register
    # prefetch). sm_90 compiles at 1 row: c8k8s3 100 registers 74 KB; c4k8s3 80 / 37 KB.
    "h2.c8k8s3": (RowsTiles(1024, 8, 4, num_stages=3, waves=8, min_steps=1), (1, 2)),
    "h2.c8k8s2": (RowsTiles(1024, 8, 4, num_stages=2, waves=8, min_steps=1), (1,)),
    "h2.c4k8s3": (RowsTiles(512, 8, 4, num_stages=3, waves=8, min_steps=1), (1, 2, 3, 4)),
    "h2.c4k8s4": (RowsTiles(512, 8, 4, num_stages=4, waves=8, min_steps=1), (1,)),
    "h2.c8k16s2": (RowsTiles(1024, 16, 4, num_stages=2, waves=8, min_steps=1), (1, 2)),
    "h2.c4k4s3": (RowsTiles(512, 4, 4, num_stages=3, waves=8, min_steps=1), (3, 4, 5, 8)),
    # fewer warps and columns a program, more programs (the bf16 GEMV's winning shape, BENCHMARKS 13.1)
    "h2.c8k16s2W2": (RowsTiles(512, 16, 2, num_stages=2, waves=8, min_steps=1), (1, 2)),
    "h2.c4k16s2W2": (RowsTiles(256, 16, 2, num_stages=2, waves=8, min_steps=1), (1, 2)),
    "h2.c4k16s2W1": (RowsTiles(128, 16, 1, num_stages=2, waves=8, min_steps=1), (1,)),
    "h2.c8k16s2W2w16": (RowsTiles(512, 16, 2, num_stages=2, waves=16, min_steps=1), (1,)),
    "h2.c4k16s2W2w16": (RowsTiles(256, 16, 2, num_stages=2, waves=16, min_steps=1), (1,)),
    "h2.c8k8s3W2": (RowsTiles(512, 8, 2, num_stages=3, waves=8, min_steps=1), (1, 2)),
    "h2.c4k8s3W2": (RowsTiles(256, 8, 2, num_stages=3, waves=8, min_steps=1), (1, 2)),
    "h2.c8k16W2": (RowsTiles(512, 16, 2, waves=8, min_steps=1), (1, 2)),
    "h2.c8k16s3W2": (RowsTiles(512, 16, 2, num_stages=3, waves=8, min_steps=1), (1,)),
    # pf: the first K step's lines requested from the L2 before the activation prologue
    "h2.c8k16s2pf": (RowsTiles(1024, 16, 4, num_stages=2, waves=8, min_steps=1, prefetch_l2=True), (1,)),
    "h2.c8k16pf": (RowsTiles(1024, 16, 4, waves=8, min_steps=1, prefetch_l2=True), (2,)),
    "h2.c4k8s3pf": (RowsTiles(512, 8, 4, num_stages=3, waves=8, min_steps=1, prefetch_l2=True), (2,)),
    "h2.c8k16s2pfw16": (RowsTiles(1024, 16, 4, num_stages=2, waves=16, min_steps=1, prefetch_l2=True),
                        (1,)),
}


def streaming_tiles(spec: str) -> RowsTiles:
    """A streaming packed-half tile from its name, c<columns a thread>k<word rows>[s<stages>]
    [W<warps>, 4 if absent]w<waves>m<min steps>[p: register prefetch]: few programs, each walking
    several K steps with the later steps' words in flight (shared-memory stages or the register
    double buffer), so their loads overlap this step's math (BENCHMARKS 19.1)."""
    f = re.fullmatch(r"c(\d+)k(\d+)(?:s(\d+))?(?:W(\d+))?w(\d+)m(\d+)(p?)", spec)
    if f is None:
        raise ValueError(f"streaming tile name {spec!r}")
    cols, wrows, stages, warps, waves, min_steps, pf = f.groups()
    warps = int(warps or 4)
    return RowsTiles(int(cols) * 32 * warps, int(wrows), warps, num_stages=int(stages or 1),
                     waves=int(waves), min_steps=int(min_steps), prefetch=pf == "p")


# h2.st.*: streaming tiles at 1 row; h2.st2.*: at 2 rows (batch-2 decode, K = 1 verify)
H2_TILES.update({f"h2.st.{n}": (streaming_tiles(n), (1,)) for n in (
    "c8k8s3w2m2", "c8k8s4w1m4", "c4k8s3w4m2", "c4k8s4w3m2", "c4k8s3W2w4m2", "c4k8s4W2w6m2",
    "c4k16s3W2w4m2", "c8k16s3W2w2m2", "c4k4s4W1w8m4", "c8k8w2m4p", "c4k8w4m4p", "c4k16W2w4m2p",
    "c8k8s3w1m4", "c8k8s5w1m4", "c8k4s6w1m8", "c8k16s2w1m2", "c8k8w1m4p", "c8k8w3m4p",
    "c4k8s4w3m4", "c4k8s4w2m2", "c4k8s6w2m2", "c8k8s3W8w1m4", "c4k8s4w3m8", "c8k8w4m4p",
    "c8k8w3m8p",
)})
H2_TILES.update({f"h2.st2.{n}": (streaming_tiles(n), (2,)) for n in (
    "c8k8s4w1m4", "c8k8s3w2m2", "c4k8s4w3m2", "c4k8s4w2m4", "c8k16s2w1m2", "c8k8w2m4p",
    "c4k8w4m4p",
)})

# h2.wk1.* / h2.wk2.*: whole-K tiles (no K split, the 1-row table's form for K <= 6144) at 1 row
# (each shape's program count: the table gives 4,096-6,144-column outputs 64-column programs,
# 96 on the 8B's qkv, 80 on the 27B's o_proj, BENCHMARKS 58.4) and at 2 rows (the K = 1 verify
# at batch 1, batch-2 decode); a shape they cannot take reports the variant as failed
H2_TILES.update({f"h2.wk{m}.c{n}k{r}W{w}": (RowsTiles(n, r, w, prefetch=True, whole_k=True), (m,))
                 for m in (1, 2)
                 for n, r, w in ((16, 4, 4), (16, 4, 8), (32, 4, 4), (32, 4, 8), (32, 4, 16), (64, 8, 8),
                                 (64, 8, 16), (128, 8, 8), (128, 8, 16))})

# The same kernel with the weights as the dots' left operand (w4a16_dot(w_left=True): out^T =
# W^T x^T, four nibble-pair dots a K step, on sm_90 wgmmas with the weights in registers):
# block_n is the MMA's M (64 a warpgroup), block_m the rows (its N, >= 16).
DOTL_TILES = {
    "dotL": None,  # the table's w4a16_dot_left entry (w4a16_dot where it has none)
    "dotL.bn64w4": GemmTiles(16, 64, 128, num_warps=4, num_stages=3, split_k=4),
    "dotL.bn64w4s4": GemmTiles(16, 64, 128, num_warps=4, num_stages=4, split_k=4),
    "dotL.bn128w4": GemmTiles(16, 128, 128, num_warps=4, num_stages=3, split_k=4),
    "dotL.bn128w8s2": GemmTiles(16, 128, 128, num_warps=8, num_stages=2, split_k=4),
    "dotL.bn256w8": GemmTiles(16, 256, 128, num_warps=8, num_stages=3, split_k=4),
    # since the pair dots (BENCHMARKS 20.2): L1 was the busiest unit at 8 rows (69%, DRAM 28%).
    # Steps stay inside a group: block_k 128 for the group-128 weights swept here.
    "dotL.bn64w4s2": GemmTiles(16, 64, 128, num_warps=4, num_stages=2, split_k=4),
    "dotL.bn64w4s5": GemmTiles(16, 64, 128, num_warps=4, num_stages=5, split_k=4),
    "dotL.bn128w4s4": GemmTiles(16, 128, 128, num_warps=4, num_stages=4, split_k=4),
    "dotL.bn128w8s3": GemmTiles(16, 128, 128, num_warps=8, num_stages=3, split_k=4),
    "dotL.bn128w8s4": GemmTiles(16, 128, 128, num_warps=8, num_stages=4, split_k=4),
    "dotL.bm64": GemmTiles(64, 128, 128, num_warps=8, num_stages=3, split_k=4),
    "dotL.bm64bn64w4": GemmTiles(64, 64, 128, num_warps=4, num_stages=3, split_k=4),
    "dotL.bm32bn64w4": GemmTiles(32, 64, 128, num_warps=4, num_stages=3, split_k=4),
    "dotL.bm64bn64w4s4": GemmTiles(64, 64, 128, num_warps=4, num_stages=4, split_k=4),
    "dotL.bm64bn128w8": GemmTiles(64, 128, 128, num_warps=8, num_stages=3, split_k=4),
    # wider programs: the step's fixed work (x's tile and sum, barriers, the wgmma issue) spread
    # over more words (sm_90 SASS a weight at 16 rows: 128 columns 4.1, 256 2.8, 512 2.4)
    "dotL.bn256w8s2": GemmTiles(16, 256, 128, num_warps=8, num_stages=2, split_k=4),
    "dotL.bn256w8s4": GemmTiles(16, 256, 128, num_warps=8, num_stages=4, split_k=4),
    "dotL.bn512w8": GemmTiles(16, 512, 128, num_warps=8, num_stages=3, split_k=4),
    "dotL.bn512w8s2": GemmTiles(16, 512, 128, num_warps=8, num_stages=2, split_k=4),
    "dotL.bm32bn256w8": GemmTiles(32, 256, 128, num_warps=8, num_stages=3, split_k=4),
    "dotL.bm64bn256w8": GemmTiles(64, 256, 128, num_warps=8, num_stages=3, split_k=4),
}
# family -> default variant
DEFAULTS = {"rows": "rows", "gemv": "gemv", "dot": "dot", "gemm": "gemm", "deq": "deq", "h2": "h2"}


def pow2_split_dot(x: torch.Tensor, w) -> int:
    """The few-row kernel's split before launch_fit (pick_split at tiles.split_k programs per SM)."""
    t = tiles_for(x.device).w4a16_dot
    _, wrows, grid_m, grid_n = dot_grid(x.shape[0], w.out_features, t)
    return pick_split(grid_m * grid_n, x.shape[1], 8 * wrows, x.device, waves=t.split_k)


def without_integer_zeros(x: torch.Tensor, w) -> GemmTiles:
    """The tiles the table gives the left-operand kernel for x's rows and w's width, int_zeros
    cleared: the offset / scaled forms that GGUF-min weights run on those tiles."""
    return table_left_tiles(x, w, int_zeros=False)


def table_left_tiles(x: torch.Tensor, w, **change) -> GemmTiles:
    """The table's left-operand tiles for x's rows and w's width, these fields changed."""
    t = dot_left_tiles(x.shape[0], x.device, w.out_features, w.in_features) or tiles_for(x.device).w4a16_dot
    return dataclasses.replace(t, **change)


_PAIRED: dict = {}  # (x's pointer, block_k) -> x in pair order (dotL.pa.pre: reordered once, untimed)


def paired_once(x: torch.Tensor, w, tiles: GemmTiles) -> torch.Tensor:
    block_k = 8 * dot_grid(x.shape[0], w.out_features, tiles)[1]
    key = (x.data_ptr(), tuple(x.shape), block_k)
    if key not in _PAIRED or _PAIRED[key][0] is not x:  # a new x at a freed one's address
        _PAIRED[key] = (x, pair_order(x, block_k))
    return _PAIRED[key][1]


def mma_pairs_once(x: torch.Tensor, w) -> tuple[torch.Tensor, torch.Tensor]:
    """x prepared once for w4a16_mma (the ".pre" variants: the main kernel alone)."""
    key = (x.data_ptr(), tuple(x.shape), "mma")
    if key not in _PAIRED or _PAIRED[key][0] is not x:
        _PAIRED[key] = (x, prep_pairs(x, w.group_size))
    return _PAIRED[key][1]


# Candidate w4a16_mma tiles (warps_n column tiles of 32 x quads x warps_k K ranges a program;
# split 0: programs for `waves` an SM): name "mma.n<warps_n>k<warps_k>w<waves>[q<quads>]"
MMA_TILES = {f"mma.n{wn}k{wk}w{wv}" + (f"q{q}" if q > 1 else ""): MmaTiles(wn, wk, 0, wv, q)
             for wn, wk, wv, q in ((1, 1, 16, 1), (1, 2, 8, 1), (2, 2, 8, 1), (2, 2, 16, 1), (4, 1, 8, 1),
                                   (1, 4, 8, 1), (2, 1, 16, 1), (4, 2, 4, 1), (2, 4, 4, 1), (1, 2, 16, 1),
                                   (1, 4, 8, 2), (2, 2, 8, 2), (1, 2, 16, 2), (1, 1, 8, 1), (1, 1, 32, 1),
                                   (1, 2, 32, 1), (1, 4, 4, 1), (1, 4, 16, 1), (1, 8, 4, 1), (1, 8, 8, 1),
                                   (2, 4, 8, 1), (1, 1, 24, 1), (1, 2, 12, 1), (1, 2, 4, 1), (1, 2, 6, 1),
                                   (2, 2, 4, 1))}


ONLY: list[str] = []  # --only: variant name globs kept (empty: all)
PEERS = ("bf16", "int4mm")  # columns timed beside ours (torch bf16 matmul, torch int4 tinygemm)


def variants(m: int, dev: torch.device, quick: bool) -> dict:
    """name -> (family, fn(x, w, out)) for m rows (those --only keeps)."""
    return {k: v for k, v in all_variants(m, dev, quick).items()
            if not ONLY or any(fnmatch.fnmatchcase(k, p) for p in ONLY)}


def all_variants(m: int, dev: torch.device, quick: bool) -> dict:
    v = {}
    if m == 1:
        v["gemv"] = ("gemv", lambda x, w, out: w4a16_gemv(x, w, out))
    v["rows"] = ("rows", lambda x, w, out: w4a16_rows(x, w, out))
    for name, (t, at) in ROWS_TILES.items():
        if m in at and (not quick or name == "rows.c8k8w8"):
            v[name] = ("rows", lambda x, w, out, t=t: w4a16_rows(x, w, out, t))
    if m <= H2_MAX_ROWS:
        v["h2"] = ("h2", lambda x, w, out: w4a16_h2(x, w, out))
        if m <= 2 and not quick:  # fixed K splits: small matrices pay the split reduction's tail
            for sp in (2, 4, 8, 16):
                v[f"h2.s{sp}"] = ("h2", lambda x, w, out, sp=sp: w4a16_h2(x, w, out, split=sp))
        for name, (t, at) in H2_TILES.items():
            if m in at and not quick:
                v[name] = ("h2", lambda x, w, out, t=t: w4a16_h2(x, w, out, t))
    if m <= MMA_MAX_ROWS:  # the hand-placed mma.sync kernel; ".pre": x prepared outside the graph
        v["mma"] = ("mma", lambda x, w, out: w4a16_mma(x, w, out))
        v["mma.pre"] = ("mma", lambda x, w, out: w4a16_mma(x, w, out, pairs=mma_pairs_once(x, w)))
        for name, t in MMA_TILES.items():
            v[name] = ("mma", lambda x, w, out, t=t: w4a16_mma(x, w, out, t))
            v[name + ".pre"] = ("mma", lambda x, w, out, t=t: w4a16_mma(x, w, out, t, pairs=mma_pairs_once(x, w)))
    v["dot"] = ("dot", lambda x, w, out: w4a16_dot(x, w, out))
    v["dot.pow2"] = ("dot", lambda x, w, out: w4a16_dot(x, w, out, split=pow2_split_dot(x, w)))
    for name, t in DOTL_TILES.items():
        if not quick and (t is None or t.block_m == 16 or m > 16):
            v[name] = ("dot", lambda x, w, out, t=t: w4a16_dot(x, w, out, t, w_left=True))
    # the table's left-operand tiles without the integer-zero form (the swept weights are
    # symmetric, so "dotL" runs it where the table sets GemmTiles.int_zeros)
    v["dotL.noz"] = ("dot", lambda x, w, out: w4a16_dot(x, w, out, without_integer_zeros(x, w), w_left=True))
    # pair_accs / joined: the wgmmas kept in flight (one accumulator a pair, or one joined dot a
    # step; x reordered per call: the reorder's launch is timed); .pre reorders x once outside
    # the timed graph (what x_pairs' producers give); .sN other stage counts
    v["dotL.pa"] = ("dot", lambda x, w, out: w4a16_dot(x, w, out, table_left_tiles(x, w, pair_accs=True),
                                                        w_left=True))
    v["dotL.jn"] = ("dot", lambda x, w, out: w4a16_dot(x, w, out, table_left_tiles(x, w, joined=True),
                                                        w_left=True))
    for name, change in (("dotL.pa.pre", dict(pair_accs=True)),
                         ("dotL.pa.pre.s2", dict(pair_accs=True, num_stages=2)),
                         ("dotL.pa.pre.s4", dict(pair_accs=True, num_stages=4)),
                         # narrower programs: pair_accs holds ~115 registers a thread, so 4 warps
                         # of 64 columns fit 4 programs an SM where 8 of 128 fit 2
                         ("dotL.pa.pre.bn64w4", dict(pair_accs=True, block_n=64, num_warps=4)),
                         ("dotL.jn.pre", dict(joined=True)),  # one joined dot a step
                         ("dotL.jn.pre.bn64w4", dict(joined=True, block_n=64, num_warps=4)),
                         ("dotL.jn.pre.bn64w4s4", dict(joined=True, block_n=64, num_warps=4, num_stages=4)),
                         ("dotL.jn.pre.bn64w4s2", dict(joined=True, block_n=64, num_warps=4, num_stages=2)),
                         # 128 columns on one warpgroup: sm_90 loop 455 instructions a step for
                         # 8 KB of words against 304 for 4 KB (133 registers: 3 programs an SM)
                         ("dotL.jn.pre.bn128w4", dict(joined=True, block_n=128, num_warps=4)),
                         ("dotL.jn.pre.bn128w4s4", dict(joined=True, block_n=128, num_warps=4, num_stages=4)),
                         ("dotL.jn.pre.bn128w4s2", dict(joined=True, block_n=128, num_warps=4, num_stages=2)),
                         # 256 columns: 802 instructions for 16 KB, 241 registers (2 programs an SM)
                         ("dotL.jn.pre.bn256w4s2", dict(joined=True, block_n=256, num_warps=4, num_stages=2)),
                         ("dotL.jn.pre.bn256w4", dict(joined=True, block_n=256, num_warps=4)),
                         ("dotL.jn.pre.s4", dict(joined=True, num_stages=4)),
                         ("dotL.xp.pre", {})):  # the table's form reading x in pair order (no split)
        v[name] = ("dot", lambda x, w, out, c=change: w4a16_dot(
            paired_once(x, w, table_left_tiles(x, w, **c)), w, out, table_left_tiles(x, w, **c), w_left=True,
            x_paired=True))
    # one stage: no cp.async pipeline, so the words load as 16-byte vectors (a pipelined copy
    # into the left operand's K-major shared tile is one 4-byte word a copy) and reach the
    # registers through one layout conversion (BENCHMARKS 37.4)
    v["dotL.s1"] = ("dot", lambda x, w, out: w4a16_dot(x, w, out, table_left_tiles(x, w, num_stages=1),
                                                        w_left=True))
    if m > 16:  # the default permutes x per K step past 16 rows; the stride-8 gathers beside it
        v["dot.gather"] = ("dot", lambda x, w, out: w4a16_dot(x, w, out, permute=False))
    if not quick:  # at 1 row too: wide dot tiles compile to fewer instructions per weight than the GEMV
        for name, t in DOT_TILES.items():
            v[name] = ("dot", lambda x, w, out, t=t: w4a16_dot(x, w, out, t))
    if m >= 16:
        v["gemm"] = ("gemm", lambda x, w, out: w4a16_matmul(x, w, tiles=gemm_tiles(m, dev)))
        v["deq"] = ("deq", lambda x, w, out: w4a16_deq_matmul(x, w, out))
    return v


class Shape(NamedTuple):
    k: int
    n: int
    layers: int  # calls a decode step
    tp: int
    model: str


def shapes_for(models: list[str], tps: list[int]) -> dict[str, Shape]:
    """shape name -> Shape (a TP rank's shard); names carry "model:" with several models."""
    out = {}
    for model in models:
        for tp in tps:
            for name, (k, n, layers, style) in MODELS[model].items():
                k_s, n_s = (k, n // tp) if style == "col" else (k // tp, n)
                key = (f"{model}:" if len(models) > 1 else "") + name + (f"/tp{tp}" if tp > 1 else "")
                out[key] = Shape(k_s, n_s, layers, tp, model)
    return out


def compile_shape(k: int, n: int, m: int, quick: bool, vname: str) -> None:
    """Call one variant once at this shape (a precompile worker: compiles, times nothing)."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev)
    gen.manual_seed(k * 7 + n)
    w = random_w4(k, n, 128, gen, dev)
    x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
    variants(m, dev, quick)[vname][1](x, w, torch.empty((m, n), dtype=torch.bfloat16, device=dev))
    torch.cuda.synchronize()


def int4mm_peer(k: int, n: int, copies: int, dev: torch.device):
    """The peer: torch's int4 GEMV/GEMM (aten._weight_int4pack_mm, the tinygemm kernel gpt-fast's
    int4 path runs; group 128, inner-K tiles 8) on `copies` random packed weights of the shape, cycled
    past the L2 like ours: fn(x) -> ms a call. None where this torch lacks it or rejects the shape
    (timing only: the values are not checked)."""
    try:
        packed = [torch._convert_weight_to_int4pack(
            torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev), 8) for _ in range(copies)]
        sz = torch.rand(k // 128, n, 2, device=dev, dtype=torch.bfloat16)
        torch._weight_int4pack_mm(torch.zeros(1, k, device=dev, dtype=torch.bfloat16), packed[0], 128, sz)
    except (RuntimeError, AttributeError, TypeError) as exc:
        print(f"  int4mm peer unavailable at {k}x{n}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        return None
    return lambda x: graph_ms(lambda i: torch._weight_int4pack_mm(x, packed[i], 128, sz), copies)


def bench_shape(name: str, k: int, n: int, ms_list: list[int], dev: torch.device, quick: bool,
                t0: float) -> tuple[dict, float]:
    """(m -> variant -> ms, worst error) for one shape; prints one line per M."""
    gen = torch.Generator(device=dev)
    gen.manual_seed(k * 7 + n)
    w0 = random_w4(k, n, 128, gen, dev)
    nbytes = w0.qweight.numel() * 4 + w0.scales.numel() * 2 + w0.biases.numel() * w0.biases.element_size()
    copies = copies_for(nbytes)
    ws = [w0] + [random_w4(k, n, 128, gen, dev) for _ in range(copies - 1)]
    dense_copies = copies_for(k * n * 2, cap=16)
    dense = [torch.randn(k, n, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(dense_copies)]
    copy = copy_rate_gbs(dev, nbytes)
    int4mm = int4mm_peer(k, n, copies, dev)
    ref_w = dequantize_w4_ref(w0)
    rows, worst = {}, 0.0
    for m in ms_list:
        x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        want = x.float() @ ref_w
        out = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
        row = {"bf16": graph_ms(lambda i: torch.matmul(x, dense[i]), dense_copies)}
        if int4mm is not None:
            row["int4mm"] = int4mm(x)
        cells = []
        for vname, (_, fn) in variants(m, dev, quick).items():
            try:
                got = fn(x, w0, out).float()
                err = float(((got - want).norm(dim=1) / want.norm(dim=1)).max())
                row[vname] = graph_ms(lambda i: fn(x, ws[i], out), copies)
            except Exception as exc:  # a variant that fails is reported, not fatal
                print(f"  {name} M={m} {vname}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            worst = max(worst, err)
            pct = 100 * nbytes / row[vname] / 1e6 / copy
            cells.append(f"{vname} {row[vname] * 1e3:6.1f}us {pct:3.0f}%" + (" BAD" if err > 1e-2 else ""))
        rows[m] = row
        peer = f"int4mm {row['int4mm'] * 1e3:6.1f}us | " if "int4mm" in row else ""
        print(f"[{time.perf_counter() - t0:4.0f}s] M={m:2d} {name:14s} {k:5d}x{n:6d} {nbytes / 1e6:6.1f}MB "
              f"copy {copy:5.0f}GB/s | bf16 {row['bf16'] * 1e3:6.1f}us | {peer}" + " | ".join(cells), flush=True)
    return rows, worst


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="M 1,8 and fewer tile variants")
    p.add_argument("--model", default="8b",
                   help=f"one or more of {','.join(sorted(MODELS))}, comma-separated (one compile pass; "
                        "with several, a joint pick of the packed-half tiles for thin and wide outputs)")
    p.add_argument("--m", default="1,2,4,8,16")
    p.add_argument("--tp", default="1")
    p.add_argument("--jobs", type=int, default=default_jobs(), help="processes that compile first (1: none)")
    p.add_argument("--only", default="", help="comma-separated variant names or globs to run (e.g. 'h2,dot,h2.s*')")
    a = p.parse_args()
    ONLY[:] = [v for v in a.only.split(",") if v]
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    ms_list = [1, 8] if a.quick else [int(v) for v in a.m.split(",")]
    models = [v for v in a.model.split(",") if v]
    unknown = [v for v in models if v not in MODELS]
    if unknown or not models:
        p.error(f"--model: {unknown or a.model!r} not among {sorted(MODELS)}")
    shapes = shapes_for(models, [int(v) for v in a.tp.split(",")])
    print(f"{torch.cuda.get_device_name(dev)}: copy rate {copy_rate_gbs(dev):,.0f} GB/s (read + write, "
          f"1 GiB); % below = GB/s read over the copy rate of the same bytes", flush=True)
    jobs = {(k, n, m, a.quick, v) for k, n, *_ in shapes.values() for m in ms_list for v in variants(m, dev, a.quick)}
    secs = precompile(compile_shape, sorted(jobs), a.jobs)
    print(f"[{time.perf_counter() - t0:4.0f}s] compiled in {a.jobs} processes ({secs:.0f} s)", flush=True)
    results: dict[tuple[str, int], dict[str, float]] = {}  # (shape, m) -> variant -> ms
    worst_err = 0.0
    for name, (k, n, *_) in shapes.items():
        rows, worst = bench_shape(name, k, n, ms_list, dev, a.quick, t0)
        torch.cuda.empty_cache()  # the shape's weight copies went with bench_shape's frame
        worst_err = max(worst_err, worst)
        results.update({(name, m): r for m, r in rows.items()})
    summary(results, shapes, ms_list)
    for m in ms_list:
        joint_h2_pick(results, shapes, m)
    print("rows tiles:", "; ".join(f"{k} = {t}" for k, (t, _) in ROWS_TILES.items()))
    print("dot tiles:", "; ".join(f"{k} = {t}" for k, t in DOT_TILES.items()))
    print("dotL tiles:", "; ".join(f"{k} = {t}" for k, t in DOTL_TILES.items()))
    print("h2 tiles:", "; ".join(f"{k} = {t}" for k, (t, _) in H2_TILES.items()))
    print("mma tiles:", "; ".join(f"{k} = {t}" for k, t in MMA_TILES.items()))
    print(f"worst per-row relative error {worst_err:.1e} (bound 1e-2); {time.perf_counter() - t0:.0f} s", flush=True)
    return 0 if worst_err < 1e-2 else 1


def summary(results: dict, shapes: dict, ms_list: list[int]) -> None:
    """Per model, TP and M: one decode step's linear time (each shape x its layer count) per variant."""
    print("\nSUMMARY: one decode step's W4A16 linear time (ms), each shape x its layers per step")
    families: dict[int, str] = {}
    for model, tp in sorted({(v.model, v.tp) for v in shapes.values()}):
        names = [s for s, v in shapes.items() if (v.model, v.tp) == (model, tp)]
        base = None
        for m in ms_list:
            rows = [results.get((s, m), {}) for s in names]
            common = sorted(set.intersection(*(set(r) for r in rows))) if rows else []
            tot = {v: sum(results[(s, m)][v] * shapes[s].layers for s in names) for v in common}
            if len(tot) < 2:
                continue
            best = min((v for v in tot if v not in PEERS), key=tot.get)
            base = base if base is not None else tot[best]
            print(f"{model} TP={tp} M={m:2d}: best {best} {tot[best]:.3f} ms = {tot[best] / base:.2f}x the 1-row time "
                  f"({m * base / tot[best]:.1f}x batch-1 throughput) | "
                  + " | ".join(f"{v} {t:.3f}" for v, t in sorted(tot.items(), key=lambda kv: kv[1])))
            if tp == 1:  # the table routes to each family's default tiles
                fam = {f: tot[v] for f, v in DEFAULTS.items() if v in tot}
                if fam:
                    families[m] = min(fam, key=fam.get)
    if families:
        print("suggested tuning.W4A16_ROUTES entry (TP=1 step totals, each family at its default "
              f"tiles): {suggest_routes(families)}")


def joint_h2_pick(results: dict, shapes: dict, m: int, top: int = 3) -> None:
    """The packed-half tiles to give thin outputs (N <= tuning.THIN_N) and wide ones at m rows,
    scored over every (model, TP) measured: the sum of each one's step linears (lm_head left out:
    bf16 in the engine) over the table's own. One tile can win a model and starve another (a
    power-of-two K split that leaves SMs idle at some column count, BENCHMARKS 19.1)."""
    groups: dict[tuple, list[str]] = {}
    for s, v in shapes.items():
        if not s.split(":")[-1].startswith("lm_head") and (s, m) in results:
            groups.setdefault((v.model, v.tp), []).append(s)
    if not groups:
        return
    h2 = sorted(set.intersection(*(set(results[(s, m)]) for ss in groups.values() for s in ss)))
    h2 = [v for v in h2 if v == "h2" or v.startswith("h2.")]
    if "h2" not in h2 or len(h2) < 2:
        return

    def step(names: list[str], thin: str, wide: str) -> float:
        return sum(results[(s, m)][thin if shapes[s].n <= THIN_N else wide] * shapes[s].layers for s in names)

    table = {g: step(ss, "h2", "h2") for g, ss in groups.items()}
    scored = sorted((sum(step(ss, t, w) / table[g] for g, ss in groups.items()) / len(groups), t, w)
                    for t in h2 for w in h2)
    print(f"\nJOINT M={m}: thin / wide packed-half tiles over {len(groups)} model shape sets, step linears "
          "against the table's (1.00 = the table)")
    for score, t, w in scored[:top]:
        print(f"  {score:.3f}  thin {t}  wide {w}  | " + " | ".join(
            f"{g[0]} TP={g[1]} {step(ss, t, w):.3f} ms (table {table[g]:.3f})" for g, ss in groups.items()))


def suggest_routes(families: dict[int, str]) -> str:
    """The routes tuple text for the best family per measured M (runs of one family merged)."""
    found = sorted(families)
    routes = [(m, families[m]) for i, m in enumerate(found)
              if i + 1 == len(found) or families[found[i + 1]] != families[m]]
    if routes[-1][1] in ("gemm", "deq"):
        routes[-1] = (1 << 62, routes[-1][1])
    else:
        routes.append((1 << 62, "deq"))
    return "(" + ", ".join(f"({'1 << 62' if r == 1 << 62 else r}, {f!r})" for r, f in routes) + ")"


if __name__ == "__main__":
    raise SystemExit(main())
