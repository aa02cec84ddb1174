"""MXFP4 experts at decode sizes (T <= DECODE_MAX_TOKENS tokens): a GEMV per (slot, column block)
that reads each picked expert's packed codes once and decodes them in registers. Reference:
moe_gptoss_ref.gptoss_experts_ref on the dequantized experts (dequantize_mxfp4_ref).

The tl.dot path (fused_moe._moe_gemm_kernel, WFMT 2) pads one token to a 16-row dot and decodes
every weight with an exp2 per element; at batch 1 that is all ALU and no bandwidth. Here a program
holds a [BLOCK_N, GROUPS, 16] tile of code bytes (rows n, GROUPS groups of 32 weights along K, 16
bytes a group, contiguous in memory), builds each code's fp32 from bits (no table, no exp2):

  e2m1 code c = s e e m: |v| = m * 0.5 when e = 0, else (1 + m / 2) * 2^(e - 1), i.e. the fp32 bits
  ((e + 126) << 23) | (m << 22); 0.5 is 126 << 23; the sign is bit 3 moved to bit 31,

multiplies low and high nibbles by the even and odd activations, reduces each group to one sum and
applies the group's e8m0 scale (2^(s - 127)) once per group rather than once per weight.

Work split: program (slot, n): one picked (token, expert) pair and BLOCK_N output columns over the
whole K (gate_up: those gate rows and the matching up rows, then gpt-oss's clamped SwiGLU). At
T = 1 every slot is a distinct expert, so each active expert is read exactly once; at T <= 8 an
expert picked by several tokens is read once per pick (from L2 after the first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.moe_ref import Mx4Weight
from homelab_llm.engine.kernels.pdl import pdl_args, pdl_enter
from homelab_llm.engine.kernels.tuning import tiles_for

MX4_BLOCK_N = 16
MX4_GROUPS = 8  # groups of 32 weights per K step: 256 weights, 128 bytes a row (H200 sweep)


@triton.jit
def fp4_f32(code):
    """e2m1 codes (int32, 0..15) -> fp32 values, from bits (see the module docstring)."""
    ex = (code >> 1) & 3
    m = code & 1
    bits = tl.where(ex > 0, ((ex + 126) << 23) | (m << 22), m * (126 << 23))
    bits = bits | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _row_block_dot(w_row, s_row, x_even, x_odd, gs, g_mask, n_mask, offs_b, stride_wn, stride_sn,
                   offs_n):
    """sum over one K step of rows offs_n: [BLOCK_N] fp32, scales applied per group."""
    mask = n_mask[:, None, None] & g_mask[None, :, None]
    codes = tl.load(w_row + offs_n[:, None, None] * stride_wn + gs[None, :, None] * 16
                    + offs_b[None, None, :], mask=mask, other=0).to(tl.int32)
    part = tl.sum(fp4_f32(codes & 0xF) * x_even[None, :, :]
                  + fp4_f32(codes >> 4) * x_odd[None, :, :], axis=2)
    scale = tl.load(s_row + offs_n[:, None] * stride_sn + gs[None, :],
                    mask=n_mask[:, None] & g_mask[None, :], other=127).to(tl.float32)
    return tl.sum(part * tl.exp2(scale - 127.0), axis=1)


@triton.jit
def _mx4_gemv_kernel(
    a_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, ids_ptr,
    N, K, top_k, alpha, limit,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_om,
    GATED: tl.constexpr, A_BY_TOKEN: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, PDL: tl.constexpr = False,
):
    """out[slot, n] = a[row(slot)] @ W_e[n, :] (+ bias), GATED: gpt-oss's clamped SwiGLU of the
    gate column n and the up column n + N."""
    pdl_enter(PDL)
    slot = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    e = tl.load(ids_ptr + slot).to(tl.int64)
    row = (slot // top_k) if A_BY_TOKEN else slot
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_g = tl.arange(0, GROUPS)
    offs_b = tl.arange(0, 16)
    w_row = w_ptr + e * stride_we
    s_row = s_ptr + e * stride_se
    x_row = a_ptr + row * stride_am
    num_groups = K // 32
    acc = tl.zeros([BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_N], tl.float32)
    for g0 in range(0, num_groups, GROUPS):
        gs = g0 + offs_g
        g_mask = gs < num_groups
        kk = gs[:, None] * 32 + offs_b[None, :] * 2
        x_even = tl.load(x_row + kk, mask=g_mask[:, None], other=0.0).to(tl.float32)
        x_odd = tl.load(x_row + kk + 1, mask=g_mask[:, None], other=0.0).to(tl.float32)
        acc += _row_block_dot(w_row, s_row, x_even, x_odd, gs, g_mask, n_mask, offs_b, stride_wn,
                              stride_sn, offs_n)
        if GATED:
            acc_up += _row_block_dot(w_row, s_row, x_even, x_odd, gs, g_mask, n_mask, offs_b,
                                     stride_wn, stride_sn, offs_n + N)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * stride_be + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if GATED:
            acc_up += tl.load(bias_ptr + e * stride_be + N + offs_n, mask=n_mask,
                              other=0.0).to(tl.float32)
    if GATED:
        gate = tl.minimum(acc, limit)
        up = tl.minimum(tl.maximum(acc_up, -limit), limit)
        acc = (up + 1.0) * gate / (1.0 + tl.exp(-alpha * gate))
    tl.store(out_ptr + slot * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


def mx4_gemv(a: torch.Tensor, weight: Mx4Weight, out: torch.Tensor, ids: torch.Tensor, n: int,
             top_k: int, gated: bool, by_token: bool, bias: torch.Tensor | None,
             clamp: tuple[float, float], block_n: int = MX4_BLOCK_N, groups: int = MX4_GROUPS,
             num_warps: int | None = None) -> torch.Tensor:
    """One MXFP4 GEMV launch over every slot (ids: the slot's expert, int32 [slots]) into
    out [slots, n]; a is [T, K] by token (by_token) or [slots, K] by slot. The tile arguments
    are for sweeps (benchmarks/sliding_gpu.py)."""
    k = weight.blocks.shape[2] * 2
    if a.shape[1] != k or a.stride(1) != 1 or k % 32:
        raise ValueError(f"mx4_gemv: activations {tuple(a.shape)} do not match K={k} "
                         "(row-major, a multiple of 32)")
    w, s = weight.blocks, weight.scales
    _mx4_gemv_kernel[(ids.numel(), triton.cdiv(n, block_n))](
        a, w, s, out if bias is None else bias, out, ids, n, k, top_k, *clamp,
        a.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1),
        0 if bias is None else bias.stride(0), out.stride(0),
        GATED=gated, A_BY_TOKEN=by_token, HAS_BIAS=bias is not None, BLOCK_N=block_n,
        GROUPS=groups, num_warps=num_warps or tiles_for(a.device).gemv_rows.num_warps,
        **pdl_args(a.device, "moe"))
    return out
