"""W4A16 experts at decode sizes (T <= DECODE_MAX_TOKENS tokens): a GEMV per (expert block,
column block, K split) instead of the tl.dot tile path. Reference: moe_ref.moe_experts_ref.

At batch 1-8 the MoE layer is bound by reading the active experts' packed weights (0.5 byte a
weight). The GEMM path (fused_moe._moe_gemm_kernel) pads each expert's few rows to a 16-row dot
and expands every int32 word to eight K rows; this kernel keeps a [ROWS, BLOCK_N] tile of packed
words in registers and walks its eight nibbles with a static loop (w4a16_gemv.nibble_f32: one
AND-OR, a subtraction and an FMA per nibble), accumulating in fp32.

Work split, after moe_align with block_m = decode_block_m(T):
  program (b, n, s): block b (one expert, <= block_m slots), columns [n * BLOCK_N, +BLOCK_N)
  (gated: those gate columns and the matching up columns), K range s of SPLIT.
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

from homelab_llm.engine.kernels.tuning import tiles_for
from homelab_llm.engine.kernels.w4a16_gemv import nibble_f32, pick_split, ticket_buffer, unscale_pow2
from homelab_llm.engine.kernels.w4a16_pack import W4Weight

DECODE_MAX_TOKENS = 8


def decode_block_m(tokens: int) -> int:
    """Slots per block: one at T = 1 (no masked rows), two above (few experts repeat)."""
    return 1 if tokens == 1 else 2


@triton.jit
def _moe_w4_gemv_kernel(
    a_ptr, qw_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, ticket_ptr, sorted_ptr, block_expert_ptr,
    num_slots, N, K, top_k, k_per_split, n_blocks,
    stride_am, stride_we, stride_wk, stride_se, stride_sg, stride_om,
    GATED: tl.constexpr, A_BY_TOKEN: tl.constexpr, GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr,
):
    """out[slot, n] = a[row(slot)] @ W_e[:, n] (GATED: silu(gate) * up, up = column n + N)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    BLOCK_K: tl.constexpr = ROWS * 8
    e = tl.load(block_expert_ptr + pid_m)
    slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < tl.where(e >= 0, num_slots, 0)  # an unused block (e -1) has no rows
    a_rows = (slots // top_k) if A_BY_TOKEN else slots
    a_rows = tl.where(valid, a_rows, 0).to(tl.int64)
    slots = tl.where(valid, slots, 0).to(tl.int64)
    k_start = pid_k * k_per_split
    k_end = tl.where(e >= 0, tl.minimum(k_start + k_per_split, K), k_start)  # unused: no loads
    e = tl.maximum(e, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.arange(0, ROWS)
    x_base = a_ptr + a_rows[:, None] * stride_am
    tile = qw_ptr + e * stride_we + rows[:, None].to(tl.int64) * stride_wk + offs_n[None, :]
    sb = s_ptr + e * stride_se + offs_n
    bb = b_ptr + e * stride_se + offs_n
    acc = tl.zeros([BLOCK_M, ROWS, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, ROWS, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        word_rows = k0 // 8 + rows
        packed = tl.load(tile + (k0 // 8) * stride_wk, mask=n_mask[None, :], other=0)
        high = packed >> 20  # nibbles 5..7 where nibble_f32's AND-OR reaches them
        g = (k0 // GROUP_SIZE) * stride_sg
        s = tl.load(sb + g, mask=n_mask, other=0.0).to(tl.float32)
        b = tl.load(bb + g, mask=n_mask, other=0.0).to(tl.float32)
        inner = tl.zeros([BLOCK_M, ROWS, BLOCK_N], tl.float32)
        x_sum = tl.zeros([BLOCK_M, ROWS], tl.float32)
        if GATED:
            packed_up = tl.load(tile + (k0 // 8) * stride_wk + N, mask=n_mask[None, :], other=0)
            high_up = packed_up >> 20
            s_up = tl.load(sb + g + N, mask=n_mask, other=0.0).to(tl.float32)
            b_up = tl.load(bb + g + N, mask=n_mask, other=0.0).to(tl.float32)
            inner_up = tl.zeros([BLOCK_M, ROWS, BLOCK_N], tl.float32)
        for j in tl.static_range(8):
            xj = tl.load(x_base + (word_rows * 8 + j)[None, :], mask=valid[:, None], other=0.0)
            xj = xj.to(tl.float32)
            xs = unscale_pow2(xj, j)[:, :, None]
            x_sum += xj
            if j < 5:
                inner += nibble_f32(packed, j)[None, :, :] * xs
                if GATED:
                    inner_up += nibble_f32(packed_up, j)[None, :, :] * xs
            else:
                inner += nibble_f32(high, j)[None, :, :] * xs
                if GATED:
                    inner_up += nibble_f32(high_up, j)[None, :, :] * xs
        acc += inner * s[None, None, :] + x_sum[:, :, None] * b[None, None, :]
        if GATED:
            acc_up += inner_up * s_up[None, None, :] + x_sum[:, :, None] * b_up[None, None, :]
    part = tl.sum(acc, axis=1)  # [BLOCK_M, BLOCK_N]
    part_up = tl.sum(acc_up, axis=1)
    out_offs = slots[:, None] * stride_om + offs_n[None, :]
    out_mask = valid[:, None] & n_mask[None, :]
    if SPLIT == 1:
        if GATED:
            part = part / (1.0 + tl.exp(-part)) * part_up
        tl.store(out_ptr + out_offs, part.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        width = 2 * N if GATED else N
        ws_offs = slots[:, None] * width + offs_n[None, :]
        split_stride = num_slots * width
        tl.store(ws_ptr + pid_k * split_stride + ws_offs, part, mask=out_mask)
        if GATED:
            tl.store(ws_ptr + pid_k * split_stride + ws_offs + N, part_up, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken
        ticket_at = ticket_ptr + pid_m * n_blocks + pid_n
        ticket = tl.atomic_add(ticket_at, 1, sem="acq_rel")
        if ticket == SPLIT - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            total_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s_idx in range(SPLIT):
                at = ws_ptr + s_idx * split_stride + ws_offs
                total += tl.load(at, mask=out_mask, other=0.0, cache_modifier=".cg")
                if GATED:
                    total_up += tl.load(at + N, mask=out_mask, other=0.0, cache_modifier=".cg")
            if GATED:
                total = total / (1.0 + tl.exp(-total)) * total_up
            tl.store(out_ptr + out_offs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(ticket_at, 0)


def moe_w4_gemv(a: torch.Tensor, weight: W4Weight, out: torch.Tensor, sorted_slots: torch.Tensor,
                block_expert: torch.Tensor, num_slots: int, n: int, top_k: int, gated: bool,
                by_token: bool, block_m: int, block_n: int | None = None, rows: int | None = None,
                split: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """One grouped W4A16 GEMV over moe_align's blocks (block_m slots each) into out [slots, n].

    weight: stacked W4Weight (qweight [E, K // 8, N'], N' = 2n when gated: gate then up columns).
    a: [T, K] rows by token (by_token) or [slots, K] rows by slot. Tile overrides are for sweeps."""
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
        num_warps=num_warps or t.num_warps, num_stages=t.num_stages)
    return out
