"""moe_align: sort the (token, pick) slots of a batch by expert, each expert's run padded to a
multiple of BLOCK_M, so the grouped GEMM (fused_moe.py) gives every program one expert's rows.

Output (reference: moe_ref.moe_align_ref, same values):
  sorted_slots int32 [P]      slot t * K + k, grouped by expert in slot order; padding = T * K
  block_expert int32 [P / BM] the expert of each block of BLOCK_M sorted slots; -1 when unused
  num_padded   int32 [1]      slots in use (a multiple of BLOCK_M)
P = moe_ref.max_padded_slots(T * K, E, BLOCK_M) depends only on the shapes, so nothing is read
back to the host and the launch sequence is fixed (CUDA/HIP graphs can capture it).

Small batches (T * K <= ONE_LAUNCH_MAX_SLOTS, decode and short prefills): one launch, one program
per expert; each counts every expert's slots (a [BLOCK_E, CHUNK] compare per chunk), places its
run after the padded runs of the experts before it and writes its slots with a running prefix sum.
That walk is serial in T * K: at a 2,048-token prefill (16,384 slots) it took 0.39 ms on an H200
against 0.53 ms for the layer's two GEMMs together (BENCHMARKS 18.1). Above, two launches over
chunks of slots (21 us there):
  1. count: program c counts each expert's slots in chunk c into counts [chunks, E], and fills
     its share of sorted_slots with the padding value;
  2. scatter: program c sums the whole counts table (chunks x E <= TABLE values) into the runs'
     starts, adds the counts of the chunks before its own, and writes each of its slots at its
     expert's base plus its rank among the chunk's slots of that expert (a cumsum of the one-hot
     [E, SUB] compare); it also writes its share of block_expert (the expert of block b is the
     number of runs ending at or before b * BLOCK_M) and program 0 the total.
Both orders are the reference's: experts ascending, slots ascending within an expert.
E <= 1024 experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.moe_ref import max_padded_slots

CHUNK = 64
MAX_EXPERTS = 1024
ONE_LAUNCH_MAX_SLOTS = 256  # above, the two-launch chunked path
TABLE = 8192  # counts a scatter program holds: chunks = TABLE // BLOCK_E (64 at 128 experts)
ONE_HOT = 8192  # the [BLOCK_E, SUB] one-hot tile of a chunk step: SUB = ONE_HOT // BLOCK_E, <= 64


@triton.jit
def _one_hot(ids, experts):
    """[BLOCK_E, n] int32: 1 where slot i picked expert e (ids -1 match nothing)."""
    return (ids[None, :] == experts[:, None]).to(tl.int32)


@triton.jit
def _moe_align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_slots, num_blocks,
                      BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
                      CHUNK: tl.constexpr):
    e = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    offs = tl.arange(0, CHUNK)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for start in range(0, num_slots, CHUNK):
        ids = tl.load(ids_ptr + start + offs, mask=start + offs < num_slots, other=-1)
        counts += tl.sum(_one_hot(ids, experts), axis=1)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    run_start = tl.sum(tl.where(experts < e, padded, 0), axis=0)
    count = tl.sum(tl.where(experts == e, counts, 0), axis=0)
    run_len = tl.sum(tl.where(experts == e, padded, 0), axis=0)
    placed = tl.full([], 0, tl.int32)  # typed: the compiler rejects a loop var changing type
    for start in range(0, num_slots, CHUNK):
        ids = tl.load(ids_ptr + start + offs, mask=start + offs < num_slots, other=-1)
        mine = (ids == e).to(tl.int32)
        rank = placed + tl.cumsum(mine, axis=0) - 1
        tl.store(sorted_ptr + run_start + rank, start + offs, mask=mine > 0)
        placed += tl.sum(mine, axis=0)
    pad = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + run_start + count + pad, tl.zeros([BLOCK_M], tl.int32) + num_slots,
             mask=pad < run_len - count)
    for b in range(0, run_len // BLOCK_M):
        tl.store(block_expert_ptr + run_start // BLOCK_M + b, e)
    if e == 0:
        # Program 0 also marks the blocks past the last run unused, pads their slots, and
        # writes the total.
        total = tl.sum(padded, axis=0)
        tl.store(num_padded_ptr, total)
        for start in range(total, num_blocks * BLOCK_M, CHUNK):
            tl.store(sorted_ptr + start + offs, tl.zeros([CHUNK], tl.int32) + num_slots,
                     mask=start + offs < num_blocks * BLOCK_M)
        for start in range(total // BLOCK_M, num_blocks, CHUNK):
            tl.store(block_expert_ptr + start + offs, tl.zeros([CHUNK], tl.int32) - 1,
                     mask=start + offs < num_blocks)


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, sorted_ptr, num_slots, chunk, fill, padded_slots,
                  BLOCK_E: tl.constexpr, SUB: tl.constexpr, FILL: tl.constexpr):
    """counts[c, e] = slots of expert e in chunk c; sorted_slots[c * fill, +fill) = padding."""
    c = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    end = tl.minimum(c * chunk + chunk, num_slots)
    for start in range(c * chunk, end, SUB):
        offs = start + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + offs, mask=offs < end, other=-1)
        counts += tl.sum(_one_hot(ids, experts), axis=1)
    tl.store(counts_ptr + c * BLOCK_E + experts, counts)
    fill_end = tl.minimum(c * fill + fill, padded_slots)
    for start in range(c * fill, fill_end, FILL):
        offs = start + tl.arange(0, FILL)
        tl.store(sorted_ptr + offs, tl.zeros([FILL], tl.int32) + num_slots, mask=offs < fill_end)


@triton.jit
def _scatter_kernel(ids_ptr, counts_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_slots,
                    chunk, chunks, num_blocks, blocks_per_program,
                    CHUNKS_P2: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
                    SUB: tl.constexpr, BLOCK_B: tl.constexpr):
    """Chunk c's slots to their sorted places; blocks [c * blocks_per_program, +...) their
    experts; program 0 the padded total."""
    c = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    rows = tl.arange(0, CHUNKS_P2)[:, None]
    table = tl.load(counts_ptr + rows * BLOCK_E + experts[None, :], mask=rows < chunks, other=0)
    padded = (tl.sum(table, axis=0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    run_end = tl.cumsum(padded, axis=0)
    base = run_end - padded + tl.sum(tl.where(rows < c, table, 0), axis=0)
    end = tl.minimum(c * chunk + chunk, num_slots)
    for start in range(c * chunk, end, SUB):
        offs = start + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + offs, mask=offs < end, other=-1)
        one_hot = _one_hot(ids, experts)
        rank = tl.cumsum(one_hot, axis=1) - 1
        at = tl.sum(one_hot * (base[:, None] + rank), axis=0)
        tl.store(sorted_ptr + at, offs, mask=offs < end)
        base += tl.sum(one_hot, axis=1)
    total = tl.sum(padded, axis=0)
    b_end = tl.minimum(c * blocks_per_program + blocks_per_program, num_blocks)
    for b0 in range(c * blocks_per_program, b_end, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        first = (blocks * BLOCK_M)[:, None]
        expert = tl.sum((run_end[None, :] <= first).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(blocks * BLOCK_M < total, expert, -1),
                 mask=blocks < b_end)
    if c == 0:
        tl.store(num_padded_ptr, total)


def _align_chunked(ids: torch.Tensor, num_experts: int, block_m: int, sorted_slots: torch.Tensor,
                   block_expert: torch.Tensor, num_padded: torch.Tensor) -> None:
    n = ids.numel()
    block_e = triton.next_power_of_2(num_experts)
    sub = max(8, min(64, ONE_HOT // block_e))
    chunks = max(1, min(TABLE // block_e, triton.cdiv(n, sub)))
    chunk = triton.cdiv(triton.cdiv(n, chunks), sub) * sub
    chunks = triton.cdiv(n, chunk)
    counts = torch.empty((chunks, block_e), dtype=torch.int32, device=ids.device)
    fill_block = 1024
    fill = triton.cdiv(triton.cdiv(sorted_slots.numel(), chunks), fill_block) * fill_block
    _count_kernel[(chunks,)](ids, counts, sorted_slots, n, chunk, fill, sorted_slots.numel(),
                             BLOCK_E=block_e, SUB=sub, FILL=fill_block, num_warps=4)
    num_blocks = block_expert.numel()
    block_b = max(1, min(64, ONE_HOT // block_e))
    _scatter_kernel[(chunks,)](
        ids, counts, sorted_slots, block_expert, num_padded, n, chunk, chunks, num_blocks,
        triton.cdiv(num_blocks, chunks), CHUNKS_P2=triton.next_power_of_2(chunks), BLOCK_E=block_e,
        BLOCK_M=block_m, SUB=sub, BLOCK_B=block_b, num_warps=8)


def moe_align(topk_ids: torch.Tensor, num_experts: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] int32 -> (sorted_slots, block_expert, num_padded); see the module doc."""
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"moe_align handles up to {MAX_EXPERTS} experts, got {num_experts}")
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    n = ids.numel()
    total = max_padded_slots(n, num_experts, block_m)
    sorted_slots = torch.empty(total, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(total // block_m, dtype=torch.int32, device=ids.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=ids.device)
    if n > ONE_LAUNCH_MAX_SLOTS:
        _align_chunked(ids, num_experts, block_m, sorted_slots, block_expert, num_padded)
        return sorted_slots, block_expert, num_padded
    block_e = triton.next_power_of_2(num_experts)
    # the [BLOCK_E, CHUNK] one-hot of a step within ONE_HOT values: at 512 experts (Qwen3-Next)
    # 64-slot steps spilled 904 bytes a thread on sm_90 (BENCHMARKS 57.3)
    _moe_align_kernel[(num_experts,)](
        ids, sorted_slots, block_expert, num_padded, n, total // block_m,
        BLOCK_E=block_e, BLOCK_M=block_m, CHUNK=min(CHUNK, max(16, ONE_HOT // block_e)), num_warps=4)
    return sorted_slots, block_expert, num_padded
