"""The element-wise kernels around the gated delta rule (references in gdn_ref):
- gated RMSNorm: rmsnorm(x) * weight * silu(z) per row of D (one head's values), fp32 math;
- gating: g = -exp(A_log) * softplus(a + dt_bias) (fp32) and beta = sigmoid(b) (b's dtype).
softplus follows torch's threshold: x itself above 20 (where log1p(exp(x)) == x in fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.common import next_pow2
from homelab_llm.engine.kernels.gdn_common import check_rows, gate_values
from homelab_llm.engine.kernels.pdl import pdl_args, pdl_enter
from homelab_llm.engine.kernels.tuning import tiles_for

_GATING_BLOCK = 1024


@triton.jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, eps, stride_x, stride_z, stride_o, N, ROWS,
                           BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = (rows < ROWS)[:, None] & (offs < N)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + rows[:, None] * stride_z + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    y = x * inv[:, None] * w[None, :] * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + rows[:, None] * stride_o + offs[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gating_kernel(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, stride_a, stride_b, HV, TOTAL,
                   BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < TOTAL
    t = (offs // HV).to(tl.int64)
    h = offs % HV
    a = tl.load(a_ptr + t * stride_a + h, mask=mask, other=0.0)
    b = tl.load(b_ptr + t * stride_b + h, mask=mask, other=0.0)
    a_log = tl.load(a_log_ptr + h, mask=mask, other=0.0)
    g, beta = gate_values(a, b, a_log, tl.load(dt_bias_ptr + h, mask=mask, other=0.0))
    tl.store(g_ptr + offs, g, mask=mask)
    tl.store(beta_ptr + offs, beta.to(beta_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2, z2 = x.reshape(-1, x.shape[-1]), z.reshape(-1, z.shape[-1])
    check_rows(x2, z2)
    rows, n = x2.shape
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if rows:
        block = next_pow2(n)
        block_r = max(1, min(16, 4096 // block))  # D is small (128): several rows per program
        _gated_rms_norm_kernel[(triton.cdiv(rows, block_r),)](
            x2, z2, weight, out, eps, x2.stride(0), z2.stride(0), out.stride(0), n, rows,
            BLOCK_R=block_r, BLOCK=block, num_warps=tiles_for(x.device).elementwise_warps,
            **pdl_args(x.device))
    return out.view(x.shape)


def gdn_gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    check_rows(a, b)
    tokens, hv = a.shape
    g = torch.empty((tokens, hv), dtype=torch.float32, device=a.device)
    beta = torch.empty((tokens, hv), dtype=b.dtype, device=b.device)
    if tokens:
        _gating_kernel[(triton.cdiv(tokens * hv, _GATING_BLOCK),)](
            a, b, A_log, dt_bias, g, beta, a.stride(0), b.stride(0), hv, tokens * hv,
            BLOCK=_GATING_BLOCK, num_warps=tiles_for(a.device).elementwise_warps,
            **pdl_args(a.device))
    return g, beta
