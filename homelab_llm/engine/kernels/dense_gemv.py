"""bf16/fp16 decode GEMV (1-8 rows) over a dense [N, K] weight, with the small ops around a
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
silu(gate) * up (or GELU-tanh, Gemma's), so the activation kernel disappears too.

Numerics vs the unfused path: the normalized input and the gate/up products are not rounded to
the activation dtype between ops (one fewer rounding each; differences ~2^-8 relative).
Past 4 rows, a third grid axis takes the rows 4 at a time (each group reads the weight again,
from L2 for a skinny one; dispatch no longer routes 5-8 rows here, as cuBLAS's two launches
won at batch 8 on the H100, docs/BENCHMARKS.md 43: the groups serve direct calls and a table
that raises dispatch.SKINNY_GEMV_ROWS). Skinny outputs split K; the last program of a column
block reduces the fp32 partials in split order (w4a16_gemv.store_or_reduce: deterministic, no
second launch, replays in graphs).
Reference: dense_gemv_ref.norm_linear_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.elementwise import GATED_ACTS, gate_act
from homelab_llm.engine.kernels.pdl import pdl_args, pdl_enter, pdl_late
from homelab_llm.engine.kernels.tuning import dense_gemv_tiles
from homelab_llm.engine.kernels.w4a16_gemv import pick_split, store_or_reduce, ticket_buffer

GROUP_ROWS = 4  # rows one program takes (each its own accumulators, unrolled)
MAX_ROWS = 2 * GROUP_ROWS  # rows one launch serves (dispatch.SKINNY_GEMV_ROWS)


@triton.jit
def _unpack(words, IS_BF16: tl.constexpr):
    """A word's two 16-bit values (low half first: elements 2i, 2i + 1) as fp32; bf16 by bit
    shifts alone (its fp32 is the same bits, 16 lower)."""
    if IS_BF16:
        return (words << 16).to(tl.float32, bitcast=True), \
            (words & -65536).to(tl.float32, bitcast=True)
    lo = (words & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = ((words >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _pack(lo, hi, IS_BF16: tl.constexpr):
    """Two fp32 values rounded to the 16-bit dtype and packed into a word (low half first)."""
    fdt: tl.constexpr = tl.bfloat16 if IS_BF16 else tl.float16
    lo16 = lo.to(fdt).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi16 = hi.to(fdt).to(tl.int16, bitcast=True).to(tl.int32)
    return lo16 | (hi16 << 16)


@triton.jit
def _row_input(x_ptr, res_ptr, row, kw, k_mask, stride_xm, stride_rm, RESIDUAL: tl.constexpr,
               IS_BF16: tl.constexpr):
    """Row `row`'s K step as words [KV, VW] of x (int32 pairs; strides in words) and the pair
    as fp32: x, or x + residual rounded to x's dtype (the unfused add's `summed`, re-packed)."""
    r64 = row.to(tl.int64)
    words = tl.load(x_ptr + r64 * stride_xm + kw, mask=k_mask, other=0)
    lo, hi = _unpack(words, IS_BF16)
    if RESIDUAL:
        r_lo, r_hi = _unpack(tl.load(res_ptr + r64 * stride_rm + kw, mask=k_mask, other=0), IS_BF16)
        words = _pack(lo + r_lo, hi + r_hi, IS_BF16)
        lo, hi = _unpack(words, IS_BF16)
    return words, lo, hi


@triton.jit
def _row_sumsq(x_ptr, res_ptr, row, KW, offs_w, stride_xm, stride_rm, BLOCK_W: tl.constexpr,
               RESIDUAL: tl.constexpr, IS_BF16: tl.constexpr):
    """Squares of a whole input row summed per vector lane ([KV]): split programs need all of K."""
    sq = tl.sum(tl.zeros(offs_w.shape, tl.float32), axis=1)
    for w0 in range(0, KW, BLOCK_W):
        kw = w0 + offs_w
        _, lo, hi = _row_input(x_ptr, res_ptr, row, kw, kw < KW, stride_xm, stride_rm, RESIDUAL,
                               IS_BF16)
        sq += tl.sum(lo * lo + hi * hi, axis=1)
    return sq


@triton.jit
def _row_step(acc, up, sq, w_lo, w_hi, wu_lo, wu_hi, nw_lo, nw_hi, x_ptr, res_ptr, new_res_ptr,
              row, kw, k_mask, res_mask, stride_xm, stride_rm, stride_nm, RESIDUAL: tl.constexpr,
              NORM: tl.constexpr, GATHER_SQ: tl.constexpr, GATED: tl.constexpr,
              IS_BF16: tl.constexpr):
    """One row's K step: acc [BLOCK_N, KV] += W . x' within each thread's 16-byte vectors (the
    product keeps the weight tile's layout: no shuffles or shared memory per step), up the same
    for the gated half; sq gathers the row's squares; column block 0 stores the new residual."""
    words, lo, hi = _row_input(x_ptr, res_ptr, row, kw, k_mask, stride_xm, stride_rm, RESIDUAL,
                               IS_BF16)
    if RESIDUAL:
        tl.store(new_res_ptr + row.to(tl.int64) * stride_nm + kw, words, mask=res_mask)
    if GATHER_SQ:
        sq += tl.sum(lo * lo + hi * hi, axis=1)
    if NORM:
        lo = lo * nw_lo
        hi = hi * nw_hi
    acc += tl.sum(w_lo * lo[None, :, :] + w_hi * hi[None, :, :], axis=2)
    if GATED:
        up += tl.sum(wu_lo * lo[None, :, :] + wu_hi * hi[None, :, :], axis=2)
    return acc, up, sq


@triton.jit
def _row_out(acc, up, sq, bias, bias_up, K, eps, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
             GATED: tl.constexpr, GELU: tl.constexpr):
    """One row's [BLOCK_N] result: the K lanes summed, scaled by 1 / rms, biased, gated (SiLU,
    or GELU-tanh: elementwise.gate_act)."""
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
        part = gate_act(part, GELU) * gate_up
    return part


@triton.jit
def _dense_gemv_kernel(
    x_ptr, res_ptr, new_res_ptr, nw_ptr, w_ptr, bias_ptr, out_ptr, ws_ptr, ticket_ptr,
    M, N, K, HALF, k_per_split, eps,
    stride_xm, stride_rm, stride_nm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    NORM: tl.constexpr, RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
    EVEN_K: tl.constexpr, IS_BF16: tl.constexpr, LOOP_STAGES: tl.constexpr, GELU: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # Every 16-bit tensor is read as int32 words (two values; strides and K offsets in words):
    # the compiler streams 32-bit loads of a loop through shared memory in LOOP_STAGES stages
    # (cp.async), where 16-bit loads stay plain register loads, one K step at a time. A K step
    # is [BLOCK_K / 8, 4] words: each thread loads 16 contiguous bytes and sums them in
    # registers. Rows (at most 4) are unrolled, each with its own [BLOCK_N, KV] accumulator in
    # the weight tile's layout: a [rows, N, K] broadcast made the compiler move the weight tile
    # through shared memory every step. Rows past M re-read row M - 1 (no masks; the store
    # drops them). Row group pid_m (program axis 2) owns rows [BLOCK_M pid_m, + BLOCK_M): every
    # row pointer starts there, and its split-K slots and tickets are its own.
    VW: tl.constexpr = 4  # words a 16-byte vector
    KV: tl.constexpr = BLOCK_K // (2 * VW)
    BLOCK_W: tl.constexpr = BLOCK_K // 2
    GATHER_SQ: tl.constexpr = NORM and SPLIT == 1
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    first_row = pid_m * BLOCK_M
    x_ptr += first_row * stride_xm
    res_ptr += first_row * stride_rm
    new_res_ptr += first_row * stride_nm
    out_ptr += first_row * stride_om
    ws_ptr += pid_m * SPLIT * BLOCK_M * N
    ticket_ptr += pid_m * tl.num_programs(0)
    M = tl.minimum(M - first_row, BLOCK_M)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, KV)[:, None] * VW + tl.arange(0, VW)[None, :]
    n_mask = offs_n < N
    KW = K // 2
    w_start = pid_k * (k_per_split // 2)
    w_end = tl.minimum(w_start + k_per_split // 2, KW)
    row0 = tl.minimum(0, M - 1)
    row1 = tl.minimum(1, M - 1)
    row2 = tl.minimum(2, M - 1)
    row3 = tl.minimum(3, M - 1)
    zero = tl.zeros([BLOCK_N, KV], tl.float32)
    acc0, up0, acc1, up1, acc2, up2, acc3, up3 = zero, zero, zero, zero, zero, zero, zero, zero
    sq_zero = tl.sum(tl.zeros([KV, VW], tl.float32), axis=1)
    sq0, sq1, sq2, sq3 = sq_zero, sq_zero, sq_zero, sq_zero
    if NORM and SPLIT > 1:  # this program sees only part of K: gather the whole rows' squares
        sq0 = _row_sumsq(x_ptr, res_ptr, row0, KW, offs_w, stride_xm, stride_rm, BLOCK_W, RESIDUAL,
                         IS_BF16)
        if BLOCK_M > 1:
            sq1 = _row_sumsq(x_ptr, res_ptr, row1, KW, offs_w, stride_xm, stride_rm, BLOCK_W,
                             RESIDUAL, IS_BF16)
        if BLOCK_M > 2:
            sq2 = _row_sumsq(x_ptr, res_ptr, row2, KW, offs_w, stride_xm, stride_rm, BLOCK_W,
                             RESIDUAL, IS_BF16)
            sq3 = _row_sumsq(x_ptr, res_ptr, row3, KW, offs_w, stride_xm, stride_rm, BLOCK_W,
                             RESIDUAL, IS_BF16)
    w_rows = w_ptr + offs_n[:, None, None].to(tl.int64) * stride_wn + offs_w[None, :, :]
    for w0 in tl.range(w_start, w_end, BLOCK_W, num_stages=LOOP_STAGES):
        kw = w0 + offs_w
        if EVEN_K:
            k_mask = offs_w < BLOCK_W
        else:
            k_mask = kw < w_end
        res_mask = kw < tl.where(pid_n == 0, w_end, 0)  # column block 0 writes the residual
        nw_lo = zero
        nw_hi = zero
        if NORM:
            nw_lo, nw_hi = _unpack(tl.load(nw_ptr + kw, mask=k_mask, other=0), IS_BF16)
        w_mask = n_mask[:, None, None] & k_mask[None, :, :]
        # The weight streams through once: let it leave the L2 first so x stays resident
        w_lo, w_hi = _unpack(tl.load(w_rows + w0, mask=w_mask, other=0,
                                     eviction_policy="evict_first"), IS_BF16)
        wu_lo = w_lo
        wu_hi = w_hi
        if GATED:
            wu_lo, wu_hi = _unpack(tl.load(w_rows + HALF * stride_wn + w0, mask=w_mask, other=0,
                                           eviction_policy="evict_first"), IS_BF16)
        acc0, up0, sq0 = _row_step(acc0, up0, sq0, w_lo, w_hi, wu_lo, wu_hi, nw_lo, nw_hi, x_ptr,
                                   res_ptr, new_res_ptr, row0, kw, k_mask, res_mask, stride_xm,
                                   stride_rm, stride_nm, RESIDUAL, NORM, GATHER_SQ, GATED, IS_BF16)
        if BLOCK_M > 1:
            acc1, up1, sq1 = _row_step(acc1, up1, sq1, w_lo, w_hi, wu_lo, wu_hi, nw_lo, nw_hi,
                                       x_ptr, res_ptr, new_res_ptr, row1, kw, k_mask, res_mask,
                                       stride_xm, stride_rm, stride_nm, RESIDUAL, NORM, GATHER_SQ,
                                       GATED, IS_BF16)
        if BLOCK_M > 2:
            acc2, up2, sq2 = _row_step(acc2, up2, sq2, w_lo, w_hi, wu_lo, wu_hi, nw_lo, nw_hi,
                                       x_ptr, res_ptr, new_res_ptr, row2, kw, k_mask, res_mask,
                                       stride_xm, stride_rm, stride_nm, RESIDUAL, NORM, GATHER_SQ,
                                       GATED, IS_BF16)
            acc3, up3, sq3 = _row_step(acc3, up3, sq3, w_lo, w_hi, wu_lo, wu_hi, nw_lo, nw_hi,
                                       x_ptr, res_ptr, new_res_ptr, row3, kw, k_mask, res_mask,
                                       stride_xm, stride_rm, stride_nm, RESIDUAL, NORM, GATHER_SQ,
                                       GATED, IS_BF16)
    bias = tl.zeros([BLOCK_N], tl.float32)
    bias_up = bias
    if HAS_BIAS:  # split 0 alone adds it, so the reduction counts it once
        first = offs_n < tl.where(pid_k == 0, N, 0)  # a vector compare: n_mask on split 0 only
        bias = tl.load(bias_ptr + offs_n, mask=first, other=0.0).to(tl.float32)
        if GATED:
            bias_up = tl.load(bias_ptr + HALF + offs_n, mask=first, other=0.0).to(tl.float32)
    out0 = _row_out(acc0, up0, sq0, bias, bias_up, K, eps, NORM, HAS_BIAS, GATED, GELU)
    part = tl.where(offs_m[:, None] == 0, out0[None, :], 0.0)
    if BLOCK_M > 1:
        out1 = _row_out(acc1, up1, sq1, bias, bias_up, K, eps, NORM, HAS_BIAS, GATED, GELU)
        part = tl.where(offs_m[:, None] == 1, out1[None, :], part)
    if BLOCK_M > 2:
        out2 = _row_out(acc2, up2, sq2, bias, bias_up, K, eps, NORM, HAS_BIAS, GATED, GELU)
        part = tl.where(offs_m[:, None] == 2, out2[None, :], part)
        out3 = _row_out(acc3, up3, sq3, bias, bias_up, K, eps, NORM, HAS_BIAS, GATED, GELU)
        part = tl.where(offs_m[:, None] == 3, out3[None, :], part)
    pdl_late(PDL)
    store_or_reduce(part, out_ptr, ws_ptr, ticket_ptr + pid_n, pid_k, offs_m, offs_n, M, N,
                    stride_om, SPLIT=SPLIT)


def words_fit(*tensors: torch.Tensor | None) -> bool:
    """Whether each 16-bit tensor (None: skipped) can be read as int32 words: rows contiguous
    and of even length, even row strides, a 4-byte aligned start."""
    return all(t is None or (t.shape[-1] % 2 == 0 and t.stride(-1) == 1 and t.data_ptr() % 4 == 0
                             and all(st % 2 == 0 for st in t.stride()[:-1]))
               for t in tensors)


def as_words(t: torch.Tensor) -> torch.Tensor:
    """A 16-bit tensor's int32 view (pairs of values, low half first)."""
    return t.view(torch.int32)


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               norm_weight: torch.Tensor | None = None, eps: float = 0.0,
               residual: torch.Tensor | None = None, gated: bool = False, act: str = "silu",
               block_n: int | None = None, block_k: int | None = None, split: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, new_residual) for x [M, K] (M <= MAX_ROWS rows), weight [N, K] in x's dtype.

    norm_weight: RMSNorm the input first (eps its epsilon); residual: add it before the norm and
    return x + residual as new_residual (else None). gated: weight is [gate | up] (N even) and
    out is act(gate) * up, [M, N / 2], act "silu" or "gelu_tanh" (elementwise.GATED_ACTS).
    Tiles and split-K default to tuning.dense_gemv_tiles."""
    m, k = x.shape
    if weight.dim() != 2 or weight.shape[1] != k or weight.dtype != x.dtype or x.stride(1) != 1 \
            or weight.stride(1) != 1:
        raise ValueError(f"dense_gemv: x {tuple(x.shape)} {x.dtype} vs weight "
                         f"{tuple(weight.shape)} {weight.dtype} (row-contiguous, same dtype)")
    if residual is not None and norm_weight is None:
        raise ValueError("dense_gemv: a residual is added only in front of the norm")
    if act not in GATED_ACTS:
        raise ValueError(f"dense_gemv: activation {act!r}, expected one of {GATED_ACTS}")
    if not 0 < m <= MAX_ROWS:
        raise ValueError(f"dense_gemv: {m} rows; it serves 1 to {MAX_ROWS}")
    if not words_fit(x, weight, residual, norm_weight):
        raise ValueError("dense_gemv: K must be even and every 16-bit operand 4-byte aligned "
                         "(it reads pairs as words)")
    kind = "gated" if gated else "norm" if norm_weight is not None else "plain"
    t = dense_gemv_tiles(x.device, kind)
    block_n = block_n or t.block_n
    block_k = block_k or (t.block_k if m == 1 else t.rows_block_k)
    if block_k % 8:
        raise ValueError(f"dense_gemv: block_k {block_k} is not a multiple of 8 (16-byte vectors)")
    n_total = weight.shape[0]
    n = n_total // 2 if gated else n_total
    n_blocks = triton.cdiv(n, block_n)
    block_m = min(GROUP_ROWS, 1 << max(0, (m - 1).bit_length()))
    groups = triton.cdiv(m, block_m)
    # gated: silu needs the whole dot, so no split (its outputs are wide anyway)
    split = 1 if gated else (split or pick_split(n_blocks * groups, k, block_k, x.device, t.waves))
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    # split-K slots: [groups, split, block_m, n] (a group's [split, its rows, n] at its start)
    ws = out if split == 1 else torch.empty((groups, split, block_m, n), dtype=torch.float32, device=x.device)
    new_res = torch.empty_like(x) if residual is not None else None
    res = residual if residual is not None else x
    xw, res_w, w_w = as_words(x), as_words(res), as_words(weight)
    new_res_w = as_words(new_res) if new_res is not None else xw
    stages = num_stages or t.num_stages
    _dense_gemv_kernel[(n_blocks, split, groups)](
        xw, res_w, new_res_w, as_words(norm_weight) if norm_weight is not None else xw, w_w,
        bias if bias is not None else x, out, ws, ticket_buffer(x.device, n_blocks * groups),
        m, n, k, n, k_per_split, float(eps),
        xw.stride(0), res_w.stride(0), new_res_w.stride(0), w_w.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split,
        NORM=norm_weight is not None, RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        GATED=gated, EVEN_K=k % block_k == 0, IS_BF16=x.dtype == torch.bfloat16,
        LOOP_STAGES=stages, GELU=act == "gelu_tanh", num_warps=num_warps or t.num_warps,
        num_stages=stages, **pdl_args(x.device, "dense"),
    )
    return out, new_res
