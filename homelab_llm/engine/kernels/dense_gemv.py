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
def _load_input(x_ptr, res_ptr, kk, offs_m, m_mask, k_mask, stride_xm, stride_rm,
                RESIDUAL: tl.constexpr):
    """x[:, kk] ([BLOCK_M, *kk.shape]), or x + residual rounded to x's dtype (the unfused
    add's `summed`), in x's dtype."""
    mask = m_mask[:, None, None] & k_mask[None, :, :]
    rows = offs_m[:, None, None].to(tl.int64)
    xs = tl.load(x_ptr + rows * stride_xm + kk[None, :, :], mask=mask, other=0.0)
    if RESIDUAL:
        r = tl.load(res_ptr + rows * stride_rm + kk[None, :, :], mask=mask, other=0.0)
        xs = (xs.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return xs


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
    # sums them in registers first, so the accumulator is [BLOCK_M, BLOCK_N, BLOCK_K / VEC] and
    # not a full fp32 copy of the tile (that took 255 registers at 4 rows).
    VEC: tl.constexpr = 8
    KV: tl.constexpr = BLOCK_K // VEC
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, KV)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    sumsq = tl.zeros([BLOCK_M, KV], tl.float32)
    if NORM and SPLIT > 1:  # this program sees only part of K: gather the whole row's squares
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            s = _load_input(x_ptr, res_ptr, kk, offs_m, m_mask, kk < K, stride_xm, stride_rm,
                            RESIDUAL).to(tl.float32)
            sumsq += tl.sum(s * s, axis=2)
    acc = tl.zeros([BLOCK_M, BLOCK_N, KV], tl.float32)
    if GATED:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N, KV], tl.float32)
    w_rows = w_ptr + offs_n[:, None, None].to(tl.int64) * stride_wn + offs_k[None, :, :]
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + offs_k
        if EVEN_K:
            k_mask = offs_k < BLOCK_K
        else:
            k_mask = kk < k_end
        xs = _load_input(x_ptr, res_ptr, kk, offs_m, m_mask, k_mask, stride_xm, stride_rm, RESIDUAL)
        if RESIDUAL:  # column block 0 writes the new residual stream
            res_mask = (offs_m < tl.where(pid_n == 0, M, 0))[:, None, None] & k_mask[None, :, :]
            tl.store(new_res_ptr + offs_m[:, None, None].to(tl.int64) * stride_nm + kk[None, :, :],
                     xs, mask=res_mask)
        xs = xs.to(tl.float32)
        if NORM:
            if SPLIT == 1:
                sumsq += tl.sum(xs * xs, axis=2)
            xs = xs * tl.load(nw_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)[None, :, :]
        w_mask = n_mask[:, None, None] & k_mask[None, :, :]
        # The weight streams through once: let it leave the L2 first so x stays resident
        w = tl.load(w_rows + k0, mask=w_mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        acc += tl.sum(w[None, :, :, :] * xs[:, None, :, :], axis=3)
        if GATED:
            wu = tl.load(w_rows + HALF * stride_wn + k0, mask=w_mask, other=0.0,
                         eviction_policy="evict_first").to(tl.float32)
            acc_up += tl.sum(wu[None, :, :, :] * xs[:, None, :, :], axis=3)
    part = tl.sum(acc, axis=2)
    if GATED:
        up = tl.sum(acc_up, axis=2)
    if NORM:
        rstd = tl.math.rsqrt(tl.sum(sumsq, axis=1) / K + eps)
        part = part * rstd[:, None]
        if GATED:
            up = up * rstd[:, None]
    if HAS_BIAS:  # split 0 alone adds it, so the reduction counts it once
        first = offs_n < tl.where(pid_k == 0, N, 0)  # a vector compare: n_mask on split 0 only
        part += tl.load(bias_ptr + offs_n, mask=first, other=0.0).to(tl.float32)[None, :]
        if GATED:
            up += tl.load(bias_ptr + HALF + offs_n, mask=first, other=0.0).to(tl.float32)[None, :]
    if GATED:
        part = part / (1.0 + tl.exp(-part)) * up
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
