"""Chunked gated delta rule for prefill: varlen batch, per-sequence initial and final state in a
slot pool (reference: gdn_ref.gated_delta_rule_prefill_ref / chunked_rule, whose docstring has
the algebra). Two launches:

1. prep, a program per (chunk, value head), all in parallel: the in-chunk cumulative log-decay c
   (stored, fp32); the strictly lower L_ij = beta_i (k_i . k_j) e^(c_i - c_j) and its
   unit-triangular inverse T = (I + L)^-1 in registers (blocked, see _unit_lower_inverse); then
   w = T (beta e^c k) and u = T (beta v), and the in-chunk attention P = causal(e^(c_i - c_j) q_i . k_j),
   all stored in the activation dtype. With the chunk's start state S0 the token deltas are u - w S0.
2. fwd, a program per (sequence, value head, block of value columns), walking the sequence's
   chunks in order with the state tile [Dk, BLOCK_V] fp32 in registers: per chunk
   v' = u - w S0, o = (e^c q) S0 + P v', S <- e^(c_n) S0 + (e^(c_n - c) k)^T v'.
   The output is computed there too, so no per-chunk states are written out. With the table's
   `split` the walk carries only the state and the outputs follow in parallel
   (gdn_chunk_split.py; the prep kernel then also stores kd = e^(c_n - c) k / |k|, STORE_KD).

q and k enter the dots as loaded; their L2 norms (and q's scale) multiply the dot results per
row, which keeps fp32 copies of [BT, Dk] tiles out of registers (they spilled on sm90).
Dot operands take the activation dtype (bf16/fp16; fp32 under TRITON_INTERPRET, whose numpy
backend has no bf16 matmul), accumulation and the state are fp32. A negative slot is a padding
row: zeros out, no state read or written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.common import dot_in_fp32, next_pow2
from homelab_llm.engine.kernels.gdn_common import (block_grid, block_rows, check_rows, dot_mm, dot_operand,
                                                   inv_norm_rows, load_start_state, locate_block)
from homelab_llm.engine.kernels.gdn_chunk_split import chunk_fwd_split
from homelab_llm.engine.kernels.tuning import device_sms, gdn_tiles


@triton.jit
def _unit_lower_inverse(kk, beta, c, BT: tl.constexpr, SUB: tl.constexpr):
    """T = (I + L)^-1 for L_ij = beta_i kk_ij e^(c_i - c_j), i > j, all [BT, BT] fp32 in registers.

    Blocks of SUB rows (GdnTiles.solve_rows): the block-diagonal part D = I + L_diag is inverted by
    forward substitution on all blocks at once (row i of every block per step: SUB - 1 steps, not
    BT - 1), then the strictly block-lower rest B folds in as T = sum_n (-D^-1 B)^n D^-1
    (nilpotent: BT / SUB - 1 terms), Horner-style: block forward substitution written as fp32 dots
    (tf32 on NVIDIA, like every fp32 tl.dot here; ieee fp32 dots spilled 2.9 KB of registers on
    sm90). SUB = BT is plain forward substitution with no dots: RDNA3 has no fp32 WMMA, and the
    FMA form of those dots spilled ~600 VGPRs a lane (BENCHMARKS 60). Exact algebra, so strongly
    correlated keys (large inverse entries) stay accurate (test_chunk_64_correlated_keys)."""
    offs = tl.arange(0, BT)
    r = offs[:, None]
    col = offs[None, :]
    same = (r // SUB) == (col // SUB)
    lower = col < r
    upper = col > r
    # lt[j, i] = L_ij within a block: column i of it (row i of L, indexed by j) comes out of a
    # reduction along the row axis already in the layout the update broadcasts over.
    lt = tl.where(upper & same, beta[None, :] * kk * tl.exp(tl.where(upper, c[None, :] - c[:, None], 0.0)), 0.0)
    t_inv = tl.where(r == col, 1.0, 0.0)
    for i in range(1, SUB):
        # L rows i, SUB + i, ...: for a row j of block b, its coefficient in row b * SUB + i
        l_i = tl.sum(tl.where(col % SUB == i, lt, 0.0), axis=1)
        # t_inv is block diagonal, so column m only collects rows j of m's own block
        upd = tl.sum(l_i[:, None] * t_inv, axis=0)
        t_inv = tl.where((r % SUB == i) & same, t_inv - upd[None, :], t_inv)
    if BT > SUB:
        decay = tl.exp(tl.where(lower, c[:, None] - c[None, :], 0.0))
        rest = tl.where(lower & (r // SUB != col // SUB), beta[:, None] * kk * decay, 0.0)
        n = tl.dot(t_inv, rest)
        x = t_inv
        for _ in tl.static_range(BT // SUB - 1):
            x = t_inv - tl.dot(n, x)
        t_inv = x
    return t_inv


@triton.jit
def _chunk_prep_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, c_ptr, p_ptr, kd_ptr, cu_ptr, batch, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
    stride_wt, stride_wh, stride_ut, stride_uh, stride_ct, stride_pt, stride_ph, stride_kdt, stride_kdh,
    DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    GROUP: tl.constexpr, BT: tl.constexpr, SUB: tl.constexpr, B_PAD: tl.constexpr, DOT_F32: tl.constexpr,
    STORE_KD: tl.constexpr,
):
    seq, blk = locate_block(cu_ptr, batch, BT, B_PAD)
    if seq >= batch:
        return
    h = tl.program_id(1)
    t0, eos, t_mask, rows = block_rows(cu_ptr, seq, blk, BT)
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, DK_PAD)
    km = t_mask[:, None] & (offs_k < DK)[None, :]
    # q and k stay as loaded (dot operands); their L2 norms scale the dot results per row instead:
    # normalized fp32 copies of [BT, Dk] tiles would spill registers.
    k = dot_operand(tl.load(k_ptr + rows[:, None] * stride_kt + (h // GROUP) * stride_kh + offs_k[None, :],
                         mask=km, other=0.0), w_ptr, DOT_F32)
    rk = inv_norm_rows(k)
    c = tl.cumsum(tl.load(g_ptr + rows * stride_gt + h, mask=t_mask, other=0.0).to(tl.float32), axis=0)
    tl.store(c_ptr + rows * stride_ct + h, c, mask=t_mask)
    beta = tl.load(beta_ptr + rows * stride_bt + h, mask=t_mask, other=0.0).to(tl.float32)

    r = offs_t[:, None]
    col = offs_t[None, :]
    # the in-chunk attention P = causal(e^(c_i - c_j) q_i . k_j), for the fwd kernel's output
    q = dot_operand(tl.load(q_ptr + rows[:, None] * stride_qt + (h // GROUP) * stride_qh + offs_k[None, :],
                         mask=km, other=0.0), w_ptr, DOT_F32)
    p = tl.dot(q, tl.trans(k)) * ((inv_norm_rows(q) * scale)[:, None] * rk[None, :])
    p = tl.where(r >= col, p * tl.exp(tl.where(r >= col, c[:, None] - c[None, :], 0.0)), 0.0)
    tl.store(p_ptr + rows[:, None] * stride_pt + h * stride_ph + col, p.to(p_ptr.dtype.element_ty),
             mask=t_mask[:, None])
    if STORE_KD:  # the split path's state update takes the decayed normalized keys ready-made
        c_last = tl.sum(tl.where(offs_t == tl.minimum(eos - t0, BT) - 1, c, 0.0), axis=0)
        kd = k.to(tl.float32) * (rk * tl.exp(c_last - c))[:, None]
        tl.store(kd_ptr + rows[:, None] * stride_kdt + h * stride_kdh + offs_k[None, :],
                 kd.to(kd_ptr.dtype.element_ty), mask=km)
    t_inv = _unit_lower_inverse(tl.dot(k, tl.trans(k)) * (rk[:, None] * rk[None, :]), beta, c, BT, SUB)

    w = dot_mm(t_inv, k.to(tl.float32) * (rk * beta * tl.exp(c))[:, None], w_ptr, DOT_F32)
    tl.store(w_ptr + rows[:, None] * stride_wt + h * stride_wh + offs_k[None, :],
             w.to(w_ptr.dtype.element_ty), mask=km)
    offs_v = tl.arange(0, DV_PAD)
    vm = t_mask[:, None] & (offs_v < DV)[None, :]
    v = tl.load(v_ptr + rows[:, None] * stride_vt + h * stride_vh + offs_v[None, :], mask=vm, other=0.0)
    u = dot_mm(t_inv, v.to(tl.float32) * beta[:, None], w_ptr, DOT_F32)
    tl.store(u_ptr + rows[:, None] * stride_ut + h * stride_uh + offs_v[None, :],
             u.to(u_ptr.dtype.element_ty), mask=vm)


@triton.jit
def _chunk_fwd_kernel(
    q_ptr, k_ptr, w_ptr, u_ptr, c_ptr, p_ptr, o_ptr, state_ptr, cu_ptr, slots_ptr, init_ptr, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_wt, stride_wh, stride_ut, stride_uh, stride_ct,
    stride_pt, stride_ph,
    stride_ot, stride_oh, stride_ss, stride_sh, stride_sk,
    DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr, GROUP: tl.constexpr,
    BT: tl.constexpr, BLOCK_V: tl.constexpr, DOT_F32: tl.constexpr,
):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // GROUP
    bos = tl.load(cu_ptr + seq)
    eos = tl.load(cu_ptr + seq + 1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, DK_PAD)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask = offs_k < DK
    v_mask = offs_v < DV
    if slot < 0:
        for t0 in range(bos, eos, BT):
            rows = (t0 + offs_t).to(tl.int64)
            tl.store(o_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_v[None, :],
                     tl.zeros([BT, BLOCK_V], tl.float32).to(o_ptr.dtype.element_ty),
                     mask=(rows < eos)[:, None] & v_mask[None, :])
        return
    s_ptrs, s_mask, s = load_start_state(state_ptr, init_ptr, seq, slot, h, offs_k, offs_v, DK, DV,
                                         stride_ss, stride_sh, stride_sk)
    for t0 in range(bos, eos, BT):
        t_mask = t0 + offs_t < eos
        rows = (t0 + offs_t).to(tl.int64)
        km = t_mask[:, None] & k_mask[None, :]
        vm = t_mask[:, None] & v_mask[None, :]
        # q and k as loaded, their L2 norms and decays applied per row (see the prep kernel)
        q = dot_operand(tl.load(q_ptr + rows[:, None] * stride_qt + kh * stride_qh + offs_k[None, :], mask=km,
                             other=0.0), w_ptr, DOT_F32)
        k = dot_operand(tl.load(k_ptr + rows[:, None] * stride_kt + kh * stride_kh + offs_k[None, :], mask=km,
                             other=0.0), w_ptr, DOT_F32)
        rq = inv_norm_rows(q) * scale
        rk = inv_norm_rows(k)
        w = dot_operand(tl.load(w_ptr + rows[:, None] * stride_wt + h * stride_wh + offs_k[None, :], mask=km,
                             other=0.0), w_ptr, DOT_F32)
        u = tl.load(u_ptr + rows[:, None] * stride_ut + h * stride_uh + offs_v[None, :], mask=vm, other=0.0)
        c = tl.load(c_ptr + rows * stride_ct + h, mask=t_mask, other=0.0)
        c_last = tl.load(c_ptr + (tl.minimum(t0 + BT, eos) - 1).to(tl.int64) * stride_ct + h)

        s_op = dot_operand(s, w_ptr, DOT_F32)
        v_new = u.to(tl.float32) - tl.dot(w, s_op)
        p = dot_operand(tl.load(p_ptr + rows[:, None] * stride_pt + h * stride_ph + offs_t[None, :],
                             mask=t_mask[:, None], other=0.0), w_ptr, DOT_F32)
        o = tl.dot(q, s_op) * (rq * tl.exp(c))[:, None] + dot_mm(p, v_new, w_ptr, DOT_F32)
        tl.store(o_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_v[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=vm)
        k_tail = k.to(tl.float32) * (rk * tl.exp(c_last - c))[:, None]
        s = s * tl.exp(c_last) + dot_mm(tl.trans(k_tail), v_new, w_ptr, DOT_F32)
    tl.store(s_ptrs, s, mask=s_mask)


def _block_v(batch: int, hv: int, dv: int, cap: int, sms: int) -> int:
    """Value columns per fwd program: the table's width, halved while the grid would leave SMs idle
    (a single long prompt has only Hv * Dv / BLOCK_V sequential programs)."""
    block = min(cap, next_pow2(dv))
    while block > 16 and batch * hv * triton.cdiv(dv, block) < sms:
        block //= 2
    return block


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, cu_seqlens: torch.Tensor, ssm_state: torch.Tensor,
                           state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                           scale: float | None = None, chunk: int | None = None,
                           split: bool | None = None, solve_rows: int | None = None) -> torch.Tensor:
    """o [T, Hv, Dv]; see gdn.gated_delta_rule_prefill. `chunk`, `split` (outputs in a parallel
    kernel, gdn_chunk_split.py) and `solve_rows` (the triangular solve's diagonal blocks, a power
    of two) override the table (tests, benchmarks)."""
    check_rows(q, k, v, g, beta, ssm_state)
    num_tokens, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    batch = state_indices.shape[0]
    out = torch.empty_like(v)
    if batch == 0:
        return out
    tiles = gdn_tiles(q.device)
    bt = chunk or tiles.chunk
    sub = min(solve_rows or tiles.solve_rows, bt)
    if sub & (sub - 1):
        raise ValueError(f"chunk_gated_delta_rule: solve_rows {sub} is not a power of two")
    scale = dk ** -0.5 if scale is None else scale
    dot_f32 = dot_in_fp32()
    split = tiles.split if split is None else split
    kd = q
    if num_tokens:
        w = torch.empty((num_tokens, hv, dk), dtype=q.dtype, device=q.device)
        u = torch.empty((num_tokens, hv, dv), dtype=q.dtype, device=q.device)
        c = torch.empty((num_tokens, hv), dtype=torch.float32, device=q.device)
        p = torch.empty((num_tokens, hv, bt), dtype=q.dtype, device=q.device)
        if split:
            kd = torch.empty((num_tokens, hv, dk), dtype=q.dtype, device=q.device)
        _chunk_prep_kernel[(block_grid(num_tokens, batch, bt), hv)](
            q, k, v, g, beta, w, u, c, p, kd, cu_seqlens, batch, scale,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
            w.stride(0), w.stride(1), u.stride(0), u.stride(1), c.stride(0), p.stride(0), p.stride(1),
            kd.stride(0), kd.stride(1),
            DK=dk, DV=dv, DK_PAD=next_pow2(dk), DV_PAD=next_pow2(dv), GROUP=hv // hk, BT=bt, SUB=sub,
            B_PAD=next_pow2(batch), DOT_F32=dot_f32, STORE_KD=split, num_warps=tiles.chunk_warps)
    else:  # nothing to read: the fwd kernel still sets each live slot's state
        w = u = p = q
        c = g
    block_v = _block_v(batch, hv, dv, tiles.block_v, device_sms(q.device))
    if split:
        chunk_fwd_split(q, kd, w, u, c, p, out, ssm_state, cu_seqlens, state_indices, has_initial_state, scale, bt,
                        block_v, min(tiles.out_block_v, next_pow2(dv)), tiles.state_warps, tiles.chunk_stages,
                        dot_f32)
        return out
    _chunk_fwd_kernel[(batch, hv, triton.cdiv(dv, block_v))](
        q, k, w, u, c, p, out, ssm_state, cu_seqlens, state_indices, has_initial_state, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), w.stride(0), w.stride(1), u.stride(0), u.stride(1),
        c.stride(0), p.stride(0), p.stride(1), out.stride(0), out.stride(1),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        DK=dk, DV=dv, DK_PAD=next_pow2(dk), GROUP=hv // hk, BT=bt, BLOCK_V=block_v, DOT_F32=dot_f32,
        num_warps=tiles.chunk_warps, num_stages=tiles.chunk_stages)
    return out
