"""W4A16 experts at decode sizes (T <= DECODE_MAX_TOKENS tokens): a GEMV per (expert block,
column block, K split) instead of the tl.dot tile path. Reference: moe_ref.moe_experts_ref.

At batch 1-8 the MoE layer is bound by reading the active experts' packed weights (0.5 byte a
weight). The GEMM path (fused_moe._moe_gemm_kernel) pads each expert's few rows to a 16-row dot
and expands every int32 word to eight K rows; this kernel keeps a [ROWS, BLOCK_N] tile of packed
words in registers and walks its eight nibbles with a static loop (w4a16_gemv.nibble_f32: one
AND-OR, a subtraction and an FMA per nibble), accumulating in fp32.

Work split, after fused_moe_decode.decode_blocks (block_m 1 at T = 1, else 2):
  program (b, n, s): block b (one expert, <= block_m slots), columns [n * BLOCK_N, +BLOCK_N)
  (gated: those gate columns and the matching up columns), K range s of SPLIT.
(At T = 1 fused_moe skips moe_align: slot k is block k, its expert topk_ids[0, k].)
A token picks an expert at most once, so at T = 1 every used block is a distinct expert and each
expert's weights are read exactly once; at T <= 8 a block holds two slots, so an expert picked by
more than two of the batch is read once per pair (rare under a spread routing, and L2-resident).
K splits keep the device full for the thin grids of decode: the last split program of a
(block, column block) to finish (a ticket, as in w4a16_gemv) sums the fp32 partials in split order
-- deterministic -- and applies SiLU-and-mul for gate_up. Tickets reset themselves and nothing is
read back to the host, so a CUDA/HIP graph replays it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.pdl import pdl_args, pdl_enter
from homelab_llm.engine.kernels.tuning import tiles_for
from homelab_llm.engine.kernels.w4a16_gemv import nibble_f32, pick_split, ticket_buffer, unscale_pow2
from homelab_llm.engine.kernels.w4a16_pack import W4Weight

DECODE_MAX_TOKENS = 8


@triton.jit
def _slot_dot(x_ptr, word_rows, packed, high, packed_up, high_up,
              GATED: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """One slot's row against a [ROWS, BLOCK_N] word tile (and its up tile): the nibble-weighted
    sums per word row, before the group's scale, and the x sums that carry the group's bias."""
    inner = tl.zeros([ROWS, BLOCK_N], tl.float32)
    inner_up = tl.zeros([ROWS, BLOCK_N], tl.float32)
    x_sum = tl.zeros([ROWS], tl.float32)
    for j in tl.static_range(8):
        xj = tl.load(x_ptr + word_rows * 8 + j).to(tl.float32)
        xs = unscale_pow2(xj, j)[:, None]
        x_sum += xj
        if j < 5:
            inner += nibble_f32(packed, j) * xs
            if GATED:
                inner_up += nibble_f32(packed_up, j) * xs
        else:
            inner += nibble_f32(high, j) * xs
            if GATED:
                inner_up += nibble_f32(high_up, j) * xs
    return inner, inner_up, x_sum


@triton.jit
def row_mask(offs_n, n_mask, valid):
    """The columns to write of a row that exists (valid, a scalar) -- as a vector compare."""
    return n_mask & (offs_n >= tl.where(valid, 0, 1 << 30))


@triton.jit
def _store_row(out_ptr, slot, valid, offs_n, n_mask, part, part_up, stride_om, GATED: tl.constexpr):
    """One slot's output row (GATED: silu(gate) * up) in out's dtype."""
    if GATED:
        part = part / (1.0 + tl.exp(-part)) * part_up
    tl.store(out_ptr + slot * stride_om + offs_n, part.to(out_ptr.dtype.element_ty),
             mask=row_mask(offs_n, n_mask, valid))


@triton.jit
def _reduce_row(ws_ptr, slot, valid, offs_n, n_mask, N, width, split_stride,
                GATED: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Sum a slot's fp32 partials over the K splits, in split order (deterministic)."""
    total = tl.zeros([BLOCK_N], tl.float32)
    total_up = tl.zeros([BLOCK_N], tl.float32)
    mask = row_mask(offs_n, n_mask, valid)
    for s_idx in range(SPLIT):
        at = ws_ptr + s_idx * split_stride + slot * width + offs_n
        total += tl.load(at, mask=mask, other=0.0, cache_modifier=".cg")
        if GATED:
            total_up += tl.load(at + N, mask=mask, other=0.0, cache_modifier=".cg")
    return total, total_up


@triton.jit
def _moe_w4_gemv_kernel(
    a_ptr, qw_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, ticket_ptr, sorted_ptr, block_expert_ptr,
    num_slots, N, K, top_k, k_per_split, n_blocks,
    stride_am, stride_we, stride_wk, stride_se, stride_sg, stride_om,
    GATED: tl.constexpr, A_BY_TOKEN: tl.constexpr, GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """out[slot, n] = a[row(slot)] @ W_e[:, n] (GATED: silu(gate) * up, up = column n + N).
    BLOCK_M is 1 or 2: each slot keeps its own 2D accumulators (a 3D [M, ROWS, N] tile costs
    three to four times the registers)."""
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    BLOCK_K: tl.constexpr = ROWS * 8
    e = tl.load(block_expert_ptr + pid_m)
    limit = tl.where(e >= 0, num_slots, 0)  # an unused block (e -1) has no rows
    slot0 = tl.load(sorted_ptr + pid_m * BLOCK_M)
    valid0 = slot0 < limit
    slot0 = tl.where(valid0, slot0, 0).to(tl.int64)
    x0 = a_ptr + ((slot0 // top_k) if A_BY_TOKEN else slot0) * stride_am
    if BLOCK_M == 2:
        slot1 = tl.load(sorted_ptr + pid_m * BLOCK_M + 1)
        valid1 = slot1 < limit
        slot1 = tl.where(valid1, slot1, 0).to(tl.int64)  # an empty second row reads row 0
        x1 = a_ptr + ((slot1 // top_k) if A_BY_TOKEN else slot1) * stride_am
    k_start = pid_k * k_per_split
    k_end = tl.where(e >= 0, tl.minimum(k_start + k_per_split, K), k_start)  # unused: no loads
    e = tl.maximum(e, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.arange(0, ROWS)
    tile = qw_ptr + e * stride_we + rows[:, None].to(tl.int64) * stride_wk + offs_n[None, :]
    sb = s_ptr + e * stride_se + offs_n
    bb = b_ptr + e * stride_se + offs_n
    acc0 = tl.zeros([ROWS, BLOCK_N], tl.float32)
    acc0_up = tl.zeros([ROWS, BLOCK_N], tl.float32)
    acc1 = tl.zeros([ROWS, BLOCK_N], tl.float32)
    acc1_up = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        word_rows = k0 // 8 + rows
        packed = tl.load(tile + (k0 // 8) * stride_wk, mask=n_mask[None, :], other=0)
        high = packed >> 20  # nibbles 5..7 where nibble_f32's AND-OR reaches them
        g = (k0 // GROUP_SIZE) * stride_sg
        s = tl.load(sb + g, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        b = tl.load(bb + g, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        packed_up = packed
        high_up = high
        s_up = s
        b_up = b
        if GATED:
            packed_up = tl.load(tile + (k0 // 8) * stride_wk + N, mask=n_mask[None, :], other=0)
            high_up = packed_up >> 20
            s_up = tl.load(sb + g + N, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            b_up = tl.load(bb + g + N, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        inner, inner_up, x_sum = _slot_dot(x0, word_rows, packed, high, packed_up, high_up,
                                           GATED, ROWS, BLOCK_N)
        acc0 += inner * s + x_sum[:, None] * b
        if GATED:
            acc0_up += inner_up * s_up + x_sum[:, None] * b_up
        if BLOCK_M == 2:
            inner, inner_up, x_sum = _slot_dot(x1, word_rows, packed, high, packed_up, high_up,
                                               GATED, ROWS, BLOCK_N)
            acc1 += inner * s + x_sum[:, None] * b
            if GATED:
                acc1_up += inner_up * s_up + x_sum[:, None] * b_up
    part0, part0_up = tl.sum(acc0, axis=0), tl.sum(acc0_up, axis=0)
    part1, part1_up = tl.sum(acc1, axis=0), tl.sum(acc1_up, axis=0)
    if SPLIT == 1:
        _store_row(out_ptr, slot0, valid0, offs_n, n_mask, part0, part0_up, stride_om, GATED)
        if BLOCK_M == 2:
            _store_row(out_ptr, slot1, valid1, offs_n, n_mask, part1, part1_up, stride_om, GATED)
    else:
        width = 2 * N if GATED else N
        split_stride = num_slots * width
        ws0 = ws_ptr + pid_k * split_stride + slot0 * width + offs_n
        tl.store(ws0, part0, mask=row_mask(offs_n, n_mask, valid0))
        if GATED:
            tl.store(ws0 + N, part0_up, mask=row_mask(offs_n, n_mask, valid0))
        if BLOCK_M == 2:
            ws1 = ws_ptr + pid_k * split_stride + slot1 * width + offs_n
            tl.store(ws1, part1, mask=row_mask(offs_n, n_mask, valid1))
            if GATED:
                tl.store(ws1 + N, part1_up, mask=row_mask(offs_n, n_mask, valid1))
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken
        ticket_at = ticket_ptr + pid_m * n_blocks + pid_n
        ticket = tl.atomic_add(ticket_at, 1, sem="acq_rel")
        if ticket == SPLIT - 1:
            t0, t0_up = _reduce_row(ws_ptr, slot0, valid0, offs_n, n_mask, N, width, split_stride,
                                    GATED, SPLIT, BLOCK_N)
            _store_row(out_ptr, slot0, valid0, offs_n, n_mask, t0, t0_up, stride_om, GATED)
            if BLOCK_M == 2:
                t1, t1_up = _reduce_row(ws_ptr, slot1, valid1, offs_n, n_mask, N, width,
                                        split_stride, GATED, SPLIT, BLOCK_N)
                _store_row(out_ptr, slot1, valid1, offs_n, n_mask, t1, t1_up, stride_om, GATED)
            tl.atomic_xchg(ticket_at, 0)


def moe_w4_gemv(a: torch.Tensor, weight: W4Weight, out: torch.Tensor, sorted_slots: torch.Tensor,
                block_expert: torch.Tensor, num_slots: int, n: int, top_k: int, gated: bool,
                by_token: bool, block_m: int, block_n: int | None = None, rows: int | None = None,
                split: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """One grouped W4A16 GEMV over moe_align's blocks (block_m slots each) into out [slots, n].

    weight: stacked W4Weight (qweight [E, K // 8, N'], N' = 2n when gated: gate then up columns).
    a: [T, K] rows by token (by_token) or [slots, K] rows by slot. Tile overrides are for sweeps."""
    if block_m not in (1, 2):
        raise ValueError(f"moe_w4_gemv: block_m is 1 or 2, got {block_m}")
    t = tiles_for(a.device).gemv_rows
    qw = weight.qweight
    k = qw.shape[1] * 8
    if a.shape[1] != k or a.stride(1) != 1:
        raise ValueError(f"moe_w4_gemv: activations {tuple(a.shape)} do not match K={k} (row-major)")
    block_n = block_n or t.block_n
    rows = min(rows or t.block_k // 8, weight.group_size // 8)
    block_k = rows * 8
    if k % block_k:
        raise ValueError(f"moe_w4_gemv: K={k} is not a multiple of the {block_k}-wide K step")
    n_blocks = triton.cdiv(n, block_n)
    num_blocks = block_expert.numel()
    active = min(num_blocks, num_slots) * n_blocks  # programs with work, at most
    split = split or pick_split(active, k, block_k, a.device)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    width = 2 * n if gated else n
    ws = out if split == 1 else torch.empty((split, num_slots, width), dtype=torch.float32,
                                            device=a.device)
    tickets = ticket_buffer(a.device, num_blocks * n_blocks)
    _moe_w4_gemv_kernel[(num_blocks, n_blocks, split)](
        a, qw, weight.scales, weight.biases, out, ws, tickets, sorted_slots, block_expert,
        num_slots, n, k, top_k, k_per_split, n_blocks,
        a.stride(0), qw.stride(0), qw.stride(1), weight.scales.stride(0),
        weight.scales.stride(1), out.stride(0),
        GATED=gated, A_BY_TOKEN=by_token, GROUP_SIZE=weight.group_size, BLOCK_M=block_m,
        BLOCK_N=block_n, ROWS=rows, SPLIT=split,
        num_warps=num_warps or t.num_warps, num_stages=t.num_stages, **pdl_args(a.device, "moe_w4"))
    return out
