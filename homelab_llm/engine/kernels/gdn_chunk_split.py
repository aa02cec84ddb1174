"""The split second half of the chunked prefill rule (gdn_chunk.py runs the prep kernel first):
the sequential walk over a sequence's chunks does only the state recurrence, and the outputs of
all chunks are computed afterwards in parallel. Long prompts gain: the serial critical path per
chunk shrinks to two dots (w S0 and kd^T v') instead of four plus the q/k norms, and the output
work (q S0 and P v') runs at full occupancy instead of on 48 programs per sequence.

1. state, a program per (sequence, value head, block of value columns): per chunk, writes the
   chunk's start state S0 (activation dtype, [Dk, BLOCK_V] slice) to h[chunk], then
   v' = u - w S0 (written over u, which only this program reads) and
   S <- e^(c_n) S0 + kd^T v', kd = e^(c_n - c) k / |k| from the prep kernel (STORE_KD).
2. out, a program per (chunk, value head, block of value columns), all in parallel:
   o = (e^c q / |q| scale) h[chunk] + P v'.

Chunks are numbered as block_grid numbers them (sequence-major, blocks_before), so h has
block_grid(T, B, BT) entries without a host sync. Operands are rounded exactly where the fused
kernel rounds them (S0 and v' to the activation dtype before their dots), so both paths agree to
the last bit up to summation order. A negative slot is a padding row: no state read or written,
zeros out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.common import next_pow2
from homelab_llm.engine.kernels.gdn_common import (block_grid, block_rows, blocks_before, dot_mm, dot_operand,
                                                   inv_norm_rows, load_start_state, locate_block)


@triton.jit
def _chunk_state_kernel(
    kd_ptr, w_ptr, u_ptr, c_ptr, h_ptr, state_ptr, cu_ptr, slots_ptr, init_ptr, batch,
    stride_kdt, stride_kdh, stride_wt, stride_wh, stride_ut, stride_uh, stride_ct,
    stride_hn, stride_hh, stride_hk, stride_ss, stride_sh, stride_sk,
    DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr, BT: tl.constexpr, BLOCK_V: tl.constexpr,
    B_PAD: tl.constexpr, DOT_F32: tl.constexpr,
):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    if slot < 0:
        return
    bos = tl.load(cu_ptr + seq)
    eos = tl.load(cu_ptr + seq + 1)
    first = blocks_before(cu_ptr, seq, batch, BT, B_PAD)
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, DK_PAD)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask = offs_k < DK
    v_mask = offs_v < DV
    s_ptrs, s_mask, s = load_start_state(state_ptr, init_ptr, seq, slot, h, offs_k, offs_v, DK, DV,
                                         stride_ss, stride_sh, stride_sk)
    h_ptrs = h_ptr + h * stride_hh + offs_k[:, None] * stride_hk + offs_v[None, :]
    for t0 in range(bos, eos, BT):
        t_mask = t0 + offs_t < eos
        rows = (t0 + offs_t).to(tl.int64)
        km = t_mask[:, None] & k_mask[None, :]
        vm = t_mask[:, None] & v_mask[None, :]
        s_op = dot_operand(s, w_ptr, DOT_F32)
        chunk = (first + (t0 - bos) // BT).to(tl.int64)
        tl.store(h_ptrs + chunk * stride_hn, s_op.to(h_ptr.dtype.element_ty), mask=s_mask)
        w = dot_operand(tl.load(w_ptr + rows[:, None] * stride_wt + h * stride_wh + offs_k[None, :], mask=km,
                                other=0.0), w_ptr, DOT_F32)
        u_ptrs = u_ptr + rows[:, None] * stride_ut + h * stride_uh + offs_v[None, :]
        v_new = tl.load(u_ptrs, mask=vm, other=0.0).to(tl.float32) - tl.dot(w, s_op)
        v_op = dot_operand(v_new, w_ptr, DOT_F32)
        tl.store(u_ptrs, v_op.to(u_ptr.dtype.element_ty), mask=vm)
        kd = dot_operand(tl.load(kd_ptr + rows[:, None] * stride_kdt + h * stride_kdh + offs_k[None, :], mask=km,
                                 other=0.0), w_ptr, DOT_F32)
        c_last = tl.load(c_ptr + (tl.minimum(t0 + BT, eos) - 1).to(tl.int64) * stride_ct + h)
        s = s * tl.exp(c_last) + tl.dot(tl.trans(kd), v_op)
    tl.store(s_ptrs, s, mask=s_mask)


@triton.jit
def _chunk_out_kernel(
    q_ptr, vn_ptr, c_ptr, p_ptr, h_ptr, o_ptr, cu_ptr, slots_ptr, batch, scale,
    stride_qt, stride_qh, stride_vt, stride_vh, stride_ct, stride_pt, stride_ph,
    stride_hn, stride_hh, stride_hk, stride_ot, stride_oh,
    DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr, GROUP: tl.constexpr, BT: tl.constexpr,
    BLOCK_V: tl.constexpr, B_PAD: tl.constexpr, DOT_F32: tl.constexpr,
):
    seq, blk = locate_block(cu_ptr, batch, BT, B_PAD)
    if seq >= batch:
        return
    h = tl.program_id(1)
    _, _, t_mask, rows = block_rows(cu_ptr, seq, blk, BT)
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, DK_PAD)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask = offs_k < DK
    vm = t_mask[:, None] & (offs_v < DV)[None, :]
    o_ptrs = o_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_v[None, :]
    if tl.load(slots_ptr + seq) < 0:
        tl.store(o_ptrs, tl.zeros([BT, BLOCK_V], tl.float32).to(o_ptr.dtype.element_ty), mask=vm)
        return
    q = dot_operand(tl.load(q_ptr + rows[:, None] * stride_qt + (h // GROUP) * stride_qh + offs_k[None, :],
                            mask=t_mask[:, None] & k_mask[None, :], other=0.0), h_ptr, DOT_F32)
    c = tl.load(c_ptr + rows * stride_ct + h, mask=t_mask, other=0.0)
    s0 = dot_operand(tl.load(h_ptr + tl.program_id(0).to(tl.int64) * stride_hn + h * stride_hh
                             + offs_k[:, None] * stride_hk + offs_v[None, :],
                             mask=k_mask[:, None] & (offs_v < DV)[None, :], other=0.0), h_ptr, DOT_F32)
    p = tl.load(p_ptr + rows[:, None] * stride_pt + h * stride_ph + offs_t[None, :], mask=t_mask[:, None], other=0.0)
    vn = tl.load(vn_ptr + rows[:, None] * stride_vt + h * stride_vh + offs_v[None, :], mask=vm, other=0.0)
    o = tl.dot(q, s0) * (inv_norm_rows(q) * scale * tl.exp(c))[:, None] + dot_mm(p, vn, h_ptr, DOT_F32)
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=vm)


def chunk_fwd_split(q: torch.Tensor, kd: torch.Tensor, w: torch.Tensor, u: torch.Tensor, c: torch.Tensor,
                    p: torch.Tensor, out: torch.Tensor, ssm_state: torch.Tensor, cu_seqlens: torch.Tensor,
                    state_indices: torch.Tensor, has_initial_state: torch.Tensor, scale: float, bt: int,
                    state_block_v: int, out_block_v: int, warps: int, stages: int, dot_f32: bool) -> None:
    """Second half of gdn_chunk.chunk_gated_delta_rule on the split path; u is overwritten (v')."""
    num_tokens, hk, dk = q.shape
    hv, dv = out.shape[1], out.shape[2]
    batch = state_indices.shape[0]
    chunks = block_grid(num_tokens, batch, bt) if num_tokens else 0
    h = torch.empty((chunks, hv, dk, dv), dtype=q.dtype, device=q.device) if chunks else q
    hs = (h.stride(0), h.stride(1), h.stride(2)) if chunks else (0, 0, 0)
    _chunk_state_kernel[(batch, hv, triton.cdiv(dv, state_block_v))](
        kd, w, u, c, h, ssm_state, cu_seqlens, state_indices, has_initial_state, batch,
        kd.stride(0), kd.stride(1), w.stride(0), w.stride(1), u.stride(0), u.stride(1), c.stride(0), *hs,
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        DK=dk, DV=dv, DK_PAD=next_pow2(dk), BT=bt, BLOCK_V=state_block_v, B_PAD=next_pow2(batch),
        DOT_F32=dot_f32, num_warps=warps, num_stages=stages)
    if not chunks:
        return
    _chunk_out_kernel[(chunks, hv, triton.cdiv(dv, out_block_v))](
        q, u, c, p, h, out, cu_seqlens, state_indices, batch, scale,
        q.stride(0), q.stride(1), u.stride(0), u.stride(1), c.stride(0), p.stride(0), p.stride(1), *hs,
        out.stride(0), out.stride(1),
        DK=dk, DV=dv, DK_PAD=next_pow2(dk), GROUP=hv // hk, BT=bt, BLOCK_V=out_block_v, B_PAD=next_pow2(batch),
        DOT_F32=dot_f32, num_warps=warps)
