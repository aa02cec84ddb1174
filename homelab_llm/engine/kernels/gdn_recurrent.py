"""Fused decode step of the gated delta rule (reference: gdn_ref.gated_delta_rule_decode_ref).

One program per (sequence, value head, block of value columns): it reads the slot's state tile
[Dk, BLOCK_V] fp32 once, applies decay, delta update and readout in registers, and writes the tile
back in place. q/k are L2-normalized in the program (each program of a head group redoes the Dk
sums: cheaper than another launch), and given the raw a/b it gates them too (decay and beta, as
gdn_norm's gating kernel: another launch saved). Memory bound: the state is read and written once per token.

Verify steps (speculative decoding): rows come in groups of ROWS = K+1 consecutive tokens of one
sequence; the program carries the state tile through the group in registers and stores no state
after any row: each row's rank-1 update (d, k, u) goes to the layer's pending-row areas, and the
state it started from (the slot's base after its own pending rows, replayed as it loads) becomes
the new base (gdn_pending.py). Then a step reads and writes one state whatever K is, and the
host's rollback is setting how many rows stay pending: no spare slots, no copies.

CUDA/HIP-graph capturable: the grid depends only on the row count and the shapes, there are no
host reads, and a negative slot (padding group or row) writes zeros to its output and touches no
state.

With the layer's gated RMSNorm (NORM: rmsnorm(o) * weight * silu(z) per head, gdn_norm's
formula), the last of a head's value-block programs to finish (an atomic ticket per (group,
head), reset after) reads the head's whole output row back, rounded as stored, and overwrites
it normalized: the norm's launch goes away (gdn_ref.gated_rms_norm_ref on the stored output).
With pair_block as well, that store puts each head's values in the pair order of the W4A16
few-row kernel that reads them next (kernels/pair_order.py: the out projection's K steps, each
inside one head), so that launch reads them with no reorder of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.common import next_pow2
from homelab_llm.engine.kernels import gdn_pending
from homelab_llm.engine.kernels.gdn_common import (
    HALF_SHIFT, PEND_MASK, PEND_SHIFT, SLOT_MASK, check_rows, gate_values, l2_normalize_rows,
)
from homelab_llm.engine.kernels.pair_order import pair_check, pair_position, rows_in_pair_order
from homelab_llm.engine.kernels.pdl import pdl_args, pdl_enter
from homelab_llm.engine.kernels.tuning import gdn_step_tiles
from homelab_llm.engine.kernels.w4a16_gemv import MAX_BLOCKS, ticket_buffer
from homelab_llm.engine.kernels.w4a16_half2 import store_x_pairs

MMA_GROUP = tl.constexpr(128)  # the mma kernel's group (w4a16_mma.mma_fits)


@triton.jit
def _recurrent_step_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, o_ptr, state_ptr, slots_ptr, scale,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_gb, stride_bb,
    stride_ob, stride_oh, stride_ss, stride_sh, stride_sk,
    z_ptr, nw_ptr, ticket_ptr, eps, stride_zb, stride_zh,
    pd_ptr, pk_ptr, pu_ptr, stride_pds, stride_pdh, stride_pdr, stride_pks, stride_pkh, stride_pkr,
    stride_pkk, stride_pus, stride_pur, stride_puh,
    DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_V: tl.constexpr,
    ROWS: tl.constexpr, GATING: tl.constexpr, NORM: tl.constexpr = False, DV_PAD: tl.constexpr = 1,
    PDL: tl.constexpr = False, PAIR_BLOCK: tl.constexpr = 0, PEND_ROWS: tl.constexpr = 0,
    xh_ptr=None, xg_ptr=None, K_ALL=0, MMA: tl.constexpr = False,
):
    pdl_enter(PDL)
    first = tl.program_id(0).to(tl.int64) * ROWS  # the group's first row
    h = tl.program_id(1)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_mask = offs_v < DV
    word = tl.load(slots_ptr + first)
    if word < 0:
        for j in tl.static_range(ROWS):
            tl.store(o_ptr + (first + j) * stride_ob + h * stride_oh + offs_v,
                     tl.zeros([BLOCK_V], tl.float32).to(o_ptr.dtype.element_ty), mask=v_mask)
            if MMA:  # zero pairs (any order) and group sums for the padding row
                tl.store(xh_ptr + (first + j) * K_ALL + h * DV + offs_v, tl.zeros([BLOCK_V], tl.float16),
                         mask=v_mask)
                if tl.program_id(2) == 0:
                    _zero_head_groups(xg_ptr + (first + j) * 2 * (K_ALL // MMA_GROUP), h, K_ALL, DV)
        return
    offs_k = tl.arange(0, DK_PAD)
    k_mask = offs_k < DK
    kh = h // GROUP
    s_offs = h * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    s_mask = k_mask[:, None] & v_mask[None, :]
    if PEND_ROWS:  # the slot's base state, then its pending rows (gdn_pending.py)
        slot = (word & SLOT_MASK).to(tl.int64)
        count = (word >> PEND_SHIFT) & PEND_MASK
        half = (word >> HALF_SHIFT) & 1
        s = tl.load(state_ptr + slot * stride_ss + s_offs, mask=s_mask, other=0.0)
        for j in tl.static_range(PEND_ROWS):
            if j < count:
                d = tl.load(pd_ptr + slot * stride_pds + half * stride_pdh + j * stride_pdr + h)
                kj = tl.load(pk_ptr + slot * stride_pks + half * stride_pkh + j * stride_pkr + kh * stride_pkk
                             + offs_k, mask=k_mask, other=0.0)
                uj = tl.load(pu_ptr + slot * stride_pus + j * stride_pur + h * stride_puh + offs_v,
                             mask=v_mask, other=0.0)
                s = s * d + kj[:, None] * uj[None, :]
        if ROWS > 1:
            if count > 0:
                tl.store(state_ptr + slot * stride_ss + s_offs, s, mask=s_mask)  # the new base
            tl.debug_barrier()  # every lane has read the pending u rows before this step's replace them
    else:
        s = tl.load(state_ptr + word.to(tl.int64) * stride_ss + s_offs, mask=s_mask, other=0.0)
    for j in tl.static_range(ROWS):
        b = first + j
        q = tl.load(q_ptr + b * stride_qb + kh * stride_qh + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + b * stride_kb + kh * stride_kh + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        q = l2_normalize_rows(q, 0) * scale
        k = l2_normalize_rows(k, 0)
        v = tl.load(v_ptr + b * stride_vb + h * stride_vh + offs_v, mask=v_mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + b * stride_gb + h)
        beta = tl.load(beta_ptr + b * stride_bb + h)
        if GATING:  # g_ptr / beta_ptr hold the raw a / b: the gating kernel's work, done here
            g, beta = gate_values(g, beta, tl.load(a_log_ptr + h), tl.load(dt_bias_ptr + h))
            beta = beta.to(beta_ptr.dtype.element_ty)  # b's dtype, as the gating kernel stores it
        decay = tl.exp(g.to(tl.float32))
        beta = beta.to(tl.float32)
        s = s * decay
        u = beta * (v - tl.sum(s * k[:, None], axis=0))
        s = s + k[:, None] * u[None, :]
        o = tl.where(tl.load(slots_ptr + b) >= 0, tl.sum(s * q[:, None], axis=0), 0.0)
        tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_v, o.to(o_ptr.dtype.element_ty), mask=v_mask)
        if ROWS > 1:  # this row becomes pending: u in the program's columns, d and k in the other half
            # (the word read again after the output's store: no slot address kept live over the row)
            again = tl.load(slots_ptr + first)
            at = (again & SLOT_MASK).to(tl.int64)
            other = 1 - ((again >> HALF_SHIFT) & 1)
            tl.store(pu_ptr + at * stride_pus + j * stride_pur + h * stride_puh + offs_v, u, mask=v_mask)
            if tl.program_id(2) == 0:
                tl.store(pd_ptr + at * stride_pds + other * stride_pdh + j * stride_pdr + h, decay)
                if h % GROUP == 0:
                    tl.store(pk_ptr + at * stride_pks + other * stride_pkh + j * stride_pkr + kh * stride_pkk
                             + offs_k, k, mask=k_mask)
    if ROWS == 1:  # the state after the row (the word read again, as above)
        again = tl.load(slots_ptr + first)
        if PEND_ROWS:
            again = again & SLOT_MASK
        tl.store(state_ptr + again.to(tl.int64) * stride_ss + s_offs, s, mask=s_mask)
    if NORM:
        _gated_norm_head(o_ptr, z_ptr, nw_ptr, ticket_ptr + tl.program_id(0) * tl.num_programs(1) + h,
                         first, h, eps, stride_ob, stride_oh, stride_zb, stride_zh, DV, DV_PAD, ROWS,
                         PAIR_BLOCK, xh_ptr, xg_ptr, K_ALL, MMA)


@triton.jit
def _zero_head_groups(xg_row, h, K_ALL, DV: tl.constexpr):
    """A padding row's group sums and undo factors of head h's groups (both planes) as zeros."""
    n_groups = K_ALL // MMA_GROUP
    g = h * (DV // MMA_GROUP) + tl.arange(0, DV // MMA_GROUP)
    tl.store(xg_row + g, tl.zeros([DV // MMA_GROUP], tl.float32))
    tl.store(xg_row + n_groups + g, tl.zeros([DV // MMA_GROUP], tl.float32))


@triton.jit
def _gated_norm_head(o_ptr, z_ptr, nw_ptr, ticket_at, first, h, eps, stride_ob, stride_oh,
                     stride_zb, stride_zh, DV: tl.constexpr, DV_PAD: tl.constexpr,
                     ROWS: tl.constexpr, PAIR_BLOCK: tl.constexpr = 0, xh_ptr=None, xg_ptr=None,
                     K_ALL=0, MMA: tl.constexpr = False):
    """The head's last value-block program: rmsnorm(o) * w * silu(z) over the head's stored
    output rows of the group (gdn_norm._gated_rms_norm_kernel's formula), in place; with
    PAIR_BLOCK (a divisor of DV) stored in that pair order inside the head's values (the whole
    row is read, reduced and only then stored, so the permuted store overwrites nothing unread);
    with MMA (DV a power of two and a multiple of MMA_GROUP) stored instead as the mma kernel's
    pairs of the row (w4a16_half2.store_x_pairs: xh [rows, K_ALL] fp16, xg [rows, 2, K_ALL /
    MMA_GROUP]), the values rounded to o's dtype first, as the rows it would have stored."""
    SEGS: tl.constexpr = max(1, DV_PAD // MMA_GROUP)  # MMA: the head's groups
    tl.debug_barrier()  # every thread's outputs are written before the ticket is taken
    if tl.atomic_add(ticket_at, 1, sem="acq_rel") == tl.num_programs(2) - 1:
        offs = tl.arange(0, DV_PAD)
        mask = offs < DV
        w = tl.load(nw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(ROWS):
            head = o_ptr + (first + j) * stride_ob + h * stride_oh
            x = tl.load(head + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            z = tl.load(z_ptr + (first + j) * stride_zb + h * stride_zh + offs, mask=mask,
                        other=0.0).to(tl.float32)
            inv = tl.math.rsqrt(tl.sum(x * x, axis=0) / DV + eps)
            y = x * inv * w * (z / (1.0 + tl.exp(-z)))
            if MMA:
                y3 = tl.reshape(y.to(o_ptr.dtype.element_ty).to(tl.float32), [1, SEGS, MMA_GROUP])
                k3 = h * DV + tl.reshape(offs, [1, SEGS, MMA_GROUP])
                store_x_pairs(y3, k3, k3 < K_ALL, h * DV, xh_ptr + (first + j) * K_ALL,
                              xg_ptr + (first + j) * 2 * (K_ALL // MMA_GROUP), 1, K_ALL, K_ALL,
                              MMA_GROUP, 1, SEGS)
            else:
                tl.store(head + pair_position(offs, PAIR_BLOCK), y.to(o_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(ticket_at, 0)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, ssm_state: torch.Tensor, state_indices: torch.Tensor,
                               scale: float | None = None, rows_per_seq: int = 1,
                               gating: tuple[torch.Tensor, torch.Tensor] | None = None,
                               gated_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                               pair_block: int = 0,
                               pending: gdn_pending.PendingRows | None = None,
                               mma_pairs: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Rows in groups of rows_per_seq tokens of one sequence (gdn_ref.gated_delta_rule_decode_ref).
    gating = (A_log, dt_bias): g and beta are the raw a and b [N, Hv], gated in the kernel
    (gdn_ref.gdn_gating_ref; one launch fewer a layer). gated_norm = (z [N, Hv, Dv], weight
    [Dv], eps): the output is gated_rms_norm(o, z, weight, eps) (one launch fewer again).
    pair_block (with gated_norm): each row's Hv * Dv values in pair order at that K step
    (pair_order; stored so by the norm where the step divides Dv, else reordered after).
    pending: the layer's pending rows (gdn_pending.py; required for groups of 2+ rows).
    mma_pairs (with gated_norm; w4a16_mma.empty_pairs for the rows' Hv * Dv values): the normed
    rows written there as the mma kernel's pairs instead (by the norm where Dv allows, else by
    prep_pairs after), for the out projection (LinearBase.rows_take_mma_pairs); the returned
    rows are then the un-normed outputs, scratch."""
    check_rows(q, k, v, g, beta, ssm_state)
    gdn_pending.check_groups(rows_per_seq, pending)
    if pending is not None:
        pending.check(ssm_state)
    rows, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if pair_block and gated_norm is None:
        raise ValueError("pair order is written by the gated norm: pass gated_norm with pair_block")
    pair_check(hv * dv, pair_block)
    if mma_pairs is not None and (gated_norm is None or pair_block):
        raise ValueError("the mma pairs are written by the gated norm, in k order: pass gated_norm, no pair_block")
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)  # rows contiguous (v is often a view)
    if rows == 0:
        return out
    a_log, dt_bias = gating if gating is not None else (g, g)
    groups = rows // rows_per_seq
    block_v, warps = gdn_step_tiles(q.device, groups, rows_per_seq)
    block_v = min(block_v, next_pow2(dv))
    z, nw, eps = gated_norm if gated_norm is not None else (v, v, 0.0)
    if gated_norm is not None and (z.shape != v.shape or z.stride(2) != 1 or nw.shape != (dv,)):
        raise ValueError(f"gated norm: z {tuple(z.shape)} (head dim contiguous) and weight "
                         f"{tuple(nw.shape)} for outputs {tuple(v.shape)}")
    if pair_block and (dv % pair_block or groups * hv > MAX_BLOCKS):
        # a step across heads, or the norm as its own kernel: k order, then reordered
        o = recurrent_gated_delta_rule(q, k, v, g, beta, ssm_state, state_indices, scale,
                                       rows_per_seq, gating, gated_norm, pending=pending)
        return rows_in_pair_order(o, pair_block)
    mma = mma_pairs is not None
    if mma and (groups * hv > MAX_BLOCKS or dv % MMA_GROUP.value or dv != next_pow2(dv)):
        # the norm's store cannot write the pairs: the normed rows, then the pairs' launch
        from homelab_llm.engine.kernels.w4a16_mma import prep_pairs

        o = recurrent_gated_delta_rule(q, k, v, g, beta, ssm_state, state_indices, scale,
                                       rows_per_seq, gating, gated_norm, pending=pending)
        prep_pairs(o.view(rows, hv * dv), MMA_GROUP.value, out=mma_pairs)
        return o
    if gated_norm is not None and groups * hv > MAX_BLOCKS:  # more heads than ticket counters
        from homelab_llm.engine.kernels.gdn_norm import gated_rms_norm

        o = recurrent_gated_delta_rule(q, k, v, g, beta, ssm_state, state_indices, scale,
                                       rows_per_seq, gating, pending=pending)
        return gated_rms_norm(o.reshape(-1, dv), z.reshape(-1, dv), nw, eps).view(o.shape)
    tickets = ticket_buffer(q.device, groups * hv) if gated_norm is not None else state_indices
    pd, pk, pu = (pending.d, pending.k, pending.u) if pending is not None else (ssm_state,) * 3
    pend_strides = ((*pd.stride()[:3], *pk.stride()[:4], *pu.stride()[:3]) if pending is not None
                    else (0,) * 10)
    _recurrent_step_kernel[(groups, hv, triton.cdiv(dv, block_v))](
        q, k, v, g, beta, a_log, dt_bias, out, ssm_state, state_indices, dk ** -0.5 if scale is None else scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        out.stride(0), out.stride(1), ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        z, nw, tickets, float(eps), z.stride(0), z.stride(1), pd, pk, pu, *pend_strides,
        DK=dk, DV=dv, DK_PAD=next_pow2(dk), GROUP=hv // hk, BLOCK_V=block_v, ROWS=rows_per_seq,
        GATING=gating is not None, NORM=gated_norm is not None, DV_PAD=next_pow2(dv),
        PAIR_BLOCK=pair_block, PEND_ROWS=pending.rows if pending is not None else 0,
        xh_ptr=mma_pairs[0] if mma else out, xg_ptr=mma_pairs[1] if mma else out, K_ALL=hv * dv, MMA=mma,
        num_warps=warps, **pdl_args(q.device))
    return out
