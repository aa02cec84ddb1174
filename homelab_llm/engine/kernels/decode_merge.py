"""The merge of split-KV decode partials (decode_attention.py's stage 2), two ways.

Partials: part_out [rows, Hq, NUM_SPLITS, HEAD_DIM_PAD] float32 (each split's normalized output,
still rotated for rotated int8 KV: the merge is linear, so it un-rotates once per output row) and
part_lse [rows, Hq, NUM_SPLITS] (its log2-sum-exp; -inf for a split with no keys, whose
partial output was never written and is never used, even as 0 * NaN).

- A second kernel (merge_partials): one program per (row, query head).
- Fused (AttentionTiles.fused_merge): every split program takes a ticket for its (row group, KV
  head) after writing its partials; the last to arrive merges the group's heads and resets the
  ticket, so there is no second launch and the merge of one group overlaps other groups' splits.
  Tickets are w4a16_gemv's zeroed counters (every user leaves them at zero, calls on a stream do
  not overlap), so decode graphs replay it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.common import fwht
from homelab_llm.engine.kernels.pair_order import pair_position
from homelab_llm.engine.kernels.pdl import pdl_args, pdl_enter
from homelab_llm.engine.kernels.w4a16_gemv import ticket_buffer


@triton.jit
def merge_head(part_out_ptr, part_lse_ptr, row0, NUM_SPLITS: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """The merged output [HEAD_DIM_PAD] float32 of one (row, query head) whose partials start at
    split row `row0` (int64). Both loads are issued together: an empty split's garbage row is
    dropped by a select after the load, not by a mask that would wait for the lse. Zeros for a
    row with no keys at all (a padded, empty sequence), not NaN."""
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    lse = tl.load(part_lse_ptr + row0 + offs_s, cache_modifier=".cg")
    parts = tl.load(part_out_ptr + (row0 + offs_s)[:, None] * HEAD_DIM_PAD + offs_d[None, :],
                    cache_modifier=".cg")
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # 0 for an empty split
    total = tl.sum(w, axis=0)
    parts = tl.where((lse > float("-inf"))[:, None], parts, 0.0)
    return tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)


@triton.jit
def unrotate_row(out, HEAD_DIM: tl.constexpr, LOG2_D: tl.constexpr, ROTATE: tl.constexpr):
    """A merged output row [HEAD_DIM] back from rotated int8 rows (common.unrotate_out for one
    row; with ROTATE, HEAD_DIM = 2^LOG2_D)."""
    if ROTATE:
        out = tl.reshape(fwht(tl.reshape(out, [1, HEAD_DIM]), LOG2_D), [HEAD_DIM]) * (1.0 / HEAD_DIM)
    return out


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, gate_ptr, query_start_ptr, stride_ot, stride_oh,
    stride_gt, stride_gh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    ROTATE: tl.constexpr, LOG2_D: tl.constexpr, HAS_GATE: tl.constexpr, PDL: tl.constexpr = False,
    PAIR_BLOCK: tl.constexpr = 0,
):
    pdl_enter(PDL)
    b = tl.program_id(0)
    head = tl.program_id(1)
    row0 = (b * tl.num_programs(1) + head).to(tl.int64) * NUM_SPLITS
    out = merge_head(part_out_ptr, part_lse_ptr, row0, NUM_SPLITS, HEAD_DIM_PAD)
    out = unrotate_row(out, HEAD_DIM_PAD, LOG2_D, ROTATE)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_row = tl.load(query_start_ptr + b).to(tl.int64)
    if HAS_GATE:  # gated attention's output gate: out * sigmoid(gate), as elementwise.sigmoid_mul
        g = tl.load(gate_ptr + q_row * stride_gt + head * stride_gh + offs_d, mask=offs_d < HEAD_DIM,
                    other=0.0).to(tl.float32)
        out = out / (1.0 + tl.exp(-g))
    tl.store(out_ptr + q_row * stride_ot + pair_position(head * stride_oh + offs_d, PAIR_BLOCK),
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit
def finish_split(part_out_ptr, part_lse_ptr, out_ptr, ticket_ptr, row, q_row, kv_head, num_q_heads,
                 stride_ot, stride_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                 HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, ROTATE: tl.constexpr,
                 LOG2_D: tl.constexpr, PAIR_BLOCK: tl.constexpr):
    """Fused merge, called by every split program of one decode row (int64 `row`, its output row
    q_row) and KV head once its partials are stored: the last of the NUM_SPLITS to take the
    ticket writes the GROUP heads' merged outputs (in pair order at PAIR_BLOCK) and resets the
    ticket."""
    tl.debug_barrier()  # every thread's partial is written before the ticket is taken
    ticket_at = ticket_ptr + row * tl.num_programs(1) + kv_head
    if tl.atomic_add(ticket_at, 1, sem="acq_rel") == NUM_SPLITS - 1:
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        for g in tl.static_range(GROUP):  # unrolled: every head's loads in flight at once
            head = kv_head * GROUP + g
            out = merge_head(part_out_ptr, part_lse_ptr, (row * num_q_heads + head) * NUM_SPLITS,
                             NUM_SPLITS, HEAD_DIM_PAD)
            out = unrotate_row(out, HEAD_DIM_PAD, LOG2_D, ROTATE)
            tl.store(out_ptr + q_row * stride_ot + pair_position(head * stride_oh + offs_d, PAIR_BLOCK),
                     out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
        tl.atomic_xchg(ticket_at, 0)


def decode_tickets(device: torch.device, rows: int, num_kv_heads: int) -> torch.Tensor:
    """The zeroed ticket counters a fused-merge launch over rows x KV heads programs uses."""
    return ticket_buffer(device, rows * num_kv_heads)


def merge_partials(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                   query_start_loc: torch.Tensor, head_dim: int, rotate: bool, log2_d: int,
                   num_warps: int, gate: torch.Tensor | None = None, pair_block: int = 0) -> None:
    """Stage 2 as its own kernel: out[query_start_loc[b], h] = the merge of row b, head h
    (un-rotated when the partials come from rotated int8 rows), times sigmoid(gate[row, h]) when
    a gate [T, Hq, D] (D contiguous) is given; pair_block: each row's values in that pair order
    (kernels/pair_order.py; `out` contiguous)."""
    batch, num_q_heads, num_splits, d_pad = part_out.shape
    _decode_reduce_kernel[(batch, num_q_heads)](
        part_out, part_lse, out, out if gate is None else gate, query_start_loc,
        out.stride(0), out.stride(1), 0 if gate is None else gate.stride(0),
        0 if gate is None else gate.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad, NUM_SPLITS=num_splits, ROTATE=rotate, LOG2_D=log2_d,
        HAS_GATE=gate is not None, num_warps=num_warps, **pdl_args(out.device), PAIR_BLOCK=pair_block,
    )
