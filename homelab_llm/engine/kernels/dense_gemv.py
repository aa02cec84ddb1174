"""bf16/fp16 decode GEMV (1-4 rows) over a dense [N, K] weight, with the small ops around a
decoder linear folded in, so a batch-1 step launches fewer kernels.

out[m, n] = sum_k W[n, k] * x'[m, k] (+ bias[n]), where x' is, by constexpr switches:
  x                                    plain GEMV (o_proj, down_proj)
  s = (x + residual) rounded to x's dtype, written once to `new_residual` by the programs of
  column block 0 (the unfused add_rms_norm's `summed`, bit for bit)
  RMSNorm(s) * norm_weight             the norm as a prologue: s * norm_weight feeds the dot and
  the per-row 1 / rms(s) scales the dot's result, so no pass over x precedes the weight stream
  (without split-K the sum of squares is gathered in the main loop; split programs first walk
  all of K for it: the vector is a few KB read from L2).
GATED pairs gate rows [n] with up rows [HALF + n] of a merged [gate | up] weight and stores
silu(gate) * up, so the activation kernel disappears too.

Numerics vs the unfused path: the normalized input and the gate/up products are not rounded to
the activation dtype between ops (one fewer rounding each; differences ~2^-8 relative).
Skinny outputs split K; the last program of a column block reduces the fp32 partials in split
order (w4a16_gemv.store_or_reduce: deterministic, no second launch, replays in graphs).
Reference: dense_gemv_ref.norm_linear_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.tuning import dense_gemv_tiles
from homelab_llm.engine.kernels.w4a16_gemv import pick_split, store_or_reduce, ticket_buffer


@triton.jit
def _row_input(x_ptr, res_ptr, row, kk, k_mask, stride_xm, stride_rm, RESIDUAL: tl.constexpr):
    """Row `row`'s K step [KV, VEC] in x's dtype: x, or x + residual rounded to x's dtype (the
    unfused add's `summed`)."""
    r64 = row.to(tl.int64)
    xs = tl.load(x_ptr + r64 * stride_xm + kk, mask=k_mask, other=0.0)
    if RESIDUAL:
        r = tl.load(res_ptr + r64 * stride_rm + kk, mask=k_mask, other=0.0)
        xs = (xs.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return xs


@triton.jit
def _row_sumsq(x_ptr, res_ptr, row, K, offs_k, stride_xm, stride_rm, BLOCK_K: tl.constexpr,
               RESIDUAL: tl.constexpr):
    """Squares of a whole input row summed per vector lane ([KV]): split programs need all of K."""
    sq = tl.sum(tl.zeros(offs_k.shape, tl.float32), axis=1)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        s = _row_input(x_ptr, res_ptr, row, kk, kk < K, stride_xm, stride_rm, RESIDUAL)
        s = s.to(tl.float32)
        sq += tl.sum(s * s, axis=1)
    return sq


@triton.jit
def _row_step(acc, up, sq, w, wu, nw, x_ptr, res_ptr, new_res_ptr, row, kk, k_mask, res_mask,
              stride_xm, stride_rm, stride_nm, RESIDUAL: tl.constexpr, NORM: tl.constexpr,
              GATHER_SQ: tl.constexpr, GATED: tl.constexpr):
    """One row's K step: acc [BLOCK_N, KV] += W . x' within each thread's 16-byte vectors (the
    product keeps the weight tile's layout: no shuffles or shared memory per step), up the same
    for the gated half; sq gathers the row's squares; column block 0 stores the new residual."""
    xs = _row_input(x_ptr, res_ptr, row, kk, k_mask, stride_xm, stride_rm, RESIDUAL)
    if RESIDUAL:
        tl.store(new_res_ptr + row.to(tl.int64) * stride_nm + kk, xs, mask=res_mask)
    xs = xs.to(tl.float32)
    if GATHER_SQ:
        sq += tl.sum(xs * xs, axis=1)
    if NORM:
        xs = xs * nw
    acc += tl.sum(w * xs[None, :, :], axis=2)
    if GATED:
        up += tl.sum(wu * xs[None, :, :], axis=2)
    return acc, up, sq


@triton.jit
def _row_out(acc, up, sq, bias, bias_up, K, eps, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
             GATED: tl.constexpr):
    """One row's [BLOCK_N] result: the K lanes summed, scaled by 1 / rms, biased, gated."""
    part = tl.sum(acc, axis=1)
    if GATED:
        gate_up = tl.sum(up, axis=1)
    if NORM:
        rstd = tl.math.rsqrt(tl.sum(sq, axis=0) / K + eps)
        part = part * rstd
        if GATED:
            gate_up = gate_up * rstd
    if HAS_BIAS:
        part += bias
        if GATED:
            gate_up += bias_up
    if GATED:
        part = part / (1.0 + tl.exp(-part)) * gate_up
    return part


@triton.jit
def _dense_gemv_kernel(
    x_ptr, res_ptr, new_res_ptr, nw_ptr, w_ptr, bias_ptr, out_ptr, ws_ptr, ticket_ptr,
    M, N, K, HALF, k_per_split, eps,
    stride_xm, stride_rm, stride_nm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    NORM: tl.constexpr, RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    # A K step is [BLOCK_K / VEC, VEC]: each thread loads VEC contiguous values (16 bytes) and
    # sums them in registers. Rows (at most 4) are unrolled, each with its own [BLOCK_N, KV]
    # accumulator in the weight tile's layout: a [rows, N, K] broadcast made the compiler move
    # the weight tile through shared memory every step. Rows past M re-read row M - 1 (no masks;
    # the store drops them).
    VEC: tl.constexpr = 8
    KV: tl.constexpr = BLOCK_K // VEC
    GATHER_SQ: tl.constexpr = NORM and SPLIT == 1
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, KV)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    n_mask = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    row0 = tl.minimum(0, M - 1)
    row1 = tl.minimum(1, M - 1)
    row2 = tl.minimum(2, M - 1)
    row3 = tl.minimum(3, M - 1)
    zero = tl.zeros([BLOCK_N, KV], tl.float32)
    acc0, up0, acc1, up1, acc2, up2, acc3, up3 = zero, zero, zero, zero, zero, zero, zero, zero
    sq_zero = tl.sum(tl.zeros([KV, VEC], tl.float32), axis=1)
    sq0, sq1, sq2, sq3 = sq_zero, sq_zero, sq_zero, sq_zero
    if NORM and SPLIT > 1:  # this program sees only part of K: gather the whole rows' squares
        sq0 = _row_sumsq(x_ptr, res_ptr, row0, K, offs_k, stride_xm, stride_rm, BLOCK_K, RESIDUAL)
        if BLOCK_M > 1:
            sq1 = _row_sumsq(x_ptr, res_ptr, row1, K, offs_k, stride_xm, stride_rm, BLOCK_K,
                             RESIDUAL)
        if BLOCK_M > 2:
            sq2 = _row_sumsq(x_ptr, res_ptr, row2, K, offs_k, stride_xm, stride_rm, BLOCK_K,
                             RESIDUAL)
            sq3 = _row_sumsq(x_ptr, res_ptr, row3, K, offs_k, stride_xm, stride_rm, BLOCK_K,
                             RESIDUAL)
    w_rows = w_ptr + offs_n[:, None, None].to(tl.int64) * stride_wn + offs_k[None, :, :]
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + offs_k
        if EVEN_K:
            k_mask = offs_k < BLOCK_K
        else:
            k_mask = kk < k_end
        res_mask = kk < tl.where(pid_n == 0, k_end, 0)  # column block 0 writes the residual
        nw = zero
        if NORM:
            nw = tl.load(nw_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
        w_mask = n_mask[:, None, None] & k_mask[None, :, :]
        # The weight streams through once: let it leave the L2 first so x stays resident
        w = tl.load(w_rows + k0, mask=w_mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        wu = w
        if GATED:
            wu = tl.load(w_rows + HALF * stride_wn + k0, mask=w_mask, other=0.0,
                         eviction_policy="evict_first").to(tl.float32)
        acc0, up0, sq0 = _row_step(acc0, up0, sq0, w, wu, nw, x_ptr, res_ptr, new_res_ptr, row0,
                                   kk, k_mask, res_mask, stride_xm, stride_rm, stride_nm,
                                   RESIDUAL, NORM, GATHER_SQ, GATED)
        if BLOCK_M > 1:
            acc1, up1, sq1 = _row_step(acc1, up1, sq1, w, wu, nw, x_ptr, res_ptr, new_res_ptr,
                                       row1, kk, k_mask, res_mask, stride_xm, stride_rm,
                                       stride_nm, RESIDUAL, NORM, GATHER_SQ, GATED)
        if BLOCK_M > 2:
            acc2, up2, sq2 = _row_step(acc2, up2, sq2, w, wu, nw, x_ptr, res_ptr, new_res_ptr,
                                       row2, kk, k_mask, res_mask, stride_xm, stride_rm,
                                       stride_nm, RESIDUAL, NORM, GATHER_SQ, GATED)
            acc3, up3, sq3 = _row_step(acc3, up3, sq3, w, wu, nw, x_ptr, res_ptr, new_res_ptr,
                                       row3, kk, k_mask, res_mask, stride_xm, stride_rm,
                                       stride_nm, RESIDUAL, NORM, GATHER_SQ, GATED)
    bias = tl.zeros([BLOCK_N], tl.float32)
    bias_up = bias
    if HAS_BIAS:  # split 0 alone adds it, so the reduction counts it once
        first = offs_n < tl.where(pid_k == 0, N, 0)  # a vector compare: n_mask on split 0 only
        bias = tl.load(bias_ptr + offs_n, mask=first, other=0.0).to(tl.float32)
        if GATED:
            bias_up = tl.load(bias_ptr + HALF + offs_n, mask=first, other=0.0).to(tl.float32)
    out0 = _row_out(acc0, up0, sq0, bias, bias_up, K, eps, NORM, HAS_BIAS, GATED)
    part = tl.where(offs_m[:, None] == 0, out0[None, :], 0.0)
    if BLOCK_M > 1:
        out1 = _row_out(acc1, up1, sq1, bias, bias_up, K, eps, NORM, HAS_BIAS, GATED)
        part = tl.where(offs_m[:, None] == 1, out1[None, :], part)
    if BLOCK_M > 2:
        out2 = _row_out(acc2, up2, sq2, bias, bias_up, K, eps, NORM, HAS_BIAS, GATED)
        part = tl.where(offs_m[:, None] == 2, out2[None, :], part)
        out3 = _row_out(acc3, up3, sq3, bias, bias_up, K, eps, NORM, HAS_BIAS, GATED)
        part = tl.where(offs_m[:, None] == 3, out3[None, :], part)
    store_or_reduce(part, out_ptr, ws_ptr, ticket_ptr + pid_n, pid_k, offs_m, offs_n, M, N,
                    stride_om, SPLIT=SPLIT)


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               norm_weight: torch.Tensor | None = None, eps: float = 0.0,
               residual: torch.Tensor | None = None, gated: bool = False,
               block_n: int | None = None, block_k: int | None = None, split: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, new_residual) for x [M, K] (M <= 4 rows), weight [N, K] in x's dtype.

    norm_weight: RMSNorm the input first (eps its epsilon); residual: add it before the norm and
    return x + residual as new_residual (else None). gated: weight is [gate | up] (N even) and
    out is silu(gate) * up, [M, N / 2]. Tiles and split-K default to tuning.dense_gemv_tiles."""
    m, k = x.shape
    if weight.shape[1] != k or weight.dtype != x.dtype or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"dense_gemv: x {tuple(x.shape)} {x.dtype} vs weight "
                         f"{tuple(weight.shape)} {weight.dtype} (row-contiguous, same dtype)")
    if residual is not None and norm_weight is None:
        raise ValueError("dense_gemv: a residual is added only in front of the norm")
    if not 0 < m <= 4:
        raise ValueError(f"dense_gemv: {m} rows; it serves 1 to 4")
    t = dense_gemv_tiles(x.device)
    block_n = block_n or t.block_n
    block_k = block_k or (t.block_k if m == 1 else t.rows_block_k)
    if block_k % 8:
        raise ValueError(f"dense_gemv: block_k {block_k} is not a multiple of 8 (16-byte vectors)")
    n_total = weight.shape[0]
    n = n_total // 2 if gated else n_total
    n_blocks = triton.cdiv(n, block_n)
    # gated: silu needs the whole dot, so no split (its outputs are wide anyway)
    split = 1 if gated else (split or pick_split(n_blocks, k, block_k, x.device, t.waves))
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    new_res = torch.empty_like(x) if residual is not None else None
    res = residual if residual is not None else x
    _dense_gemv_kernel[(n_blocks, split)](
        x, res, new_res if new_res is not None else x,
        norm_weight if norm_weight is not None else x, weight,
        bias if bias is not None else x, out, ws, ticket_buffer(x.device, n_blocks),
        m, n, k, n, k_per_split, float(eps),
        x.stride(0), res.stride(0), new_res.stride(0) if new_res is not None else 0,
        weight.stride(0), out.stride(0),
        BLOCK_M=1 << max(0, (m - 1).bit_length()), BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split,
        NORM=norm_weight is not None, RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        GATED=gated, EVEN_K=k % block_k == 0,
        num_warps=num_warps or t.num_warps, num_stages=num_stages or t.num_stages,
    )
    return out, new_res
