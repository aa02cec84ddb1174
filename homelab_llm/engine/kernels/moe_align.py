"""moe_align: sort the (token, pick) slots of a batch by expert, each expert's run padded to a
multiple of BLOCK_M, so the grouped GEMM (fused_moe.py) gives every program one expert's rows.

Output (reference: moe_ref.moe_align_ref, same values):
  sorted_slots int32 [P]      slot t * K + k, grouped by expert in slot order; padding = T * K
  block_expert int32 [P / BM] the expert of each block of BLOCK_M sorted slots; -1 when unused
  num_padded   int32 [1]      slots in use (a multiple of BLOCK_M)
P = moe_ref.max_padded_slots(T * K, E, BLOCK_M) depends only on the shapes, so nothing is read
back to the host and the launch sequence is fixed (CUDA/HIP graphs can capture it).

One program per expert: it counts every expert's slots (a [BLOCK_E, CHUNK] compare per chunk;
T * K is small next to the GEMMs), places its run after the padded runs of the experts before it,
and writes its slots in order with a running prefix sum. E <= 1024 experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.moe_ref import max_padded_slots

CHUNK = 64
MAX_EXPERTS = 1024


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
        counts += tl.sum((ids[None, :] == experts[:, None]).to(tl.int32), axis=1)
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
    _moe_align_kernel[(num_experts,)](
        ids, sorted_slots, block_expert, num_padded, n, total // block_m,
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_M=block_m,
        CHUNK=CHUNK, num_warps=4)
    return sorted_slots, block_expert, num_padded
