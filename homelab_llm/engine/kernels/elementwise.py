"""Row-wise kernels: RMSNorm (optionally fused with the residual add), the per-head q/k RMSNorm
of QK-norm attention in one launch (read straight out of the fused projection, gated or not),
SiLU-and-mul, the sigmoid output gate of gated attention, and RoPE.

All three are memory bound: each reads its inputs once and computes in fp32. The fused add writes
the summed residual (rounded to the activation dtype, as the next layer would see it) and normalizes
that rounded value, matching `add_rms_norm_ref` bit for bit up to the reduction order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.common import next_pow2
from homelab_llm.engine.kernels.pair_order import pair_check, pair_position
from homelab_llm.engine.kernels.pdl import pdl_args, pdl_enter
from homelab_llm.engine.kernels.tuning import tiles_for


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps,
    stride_x, stride_r, stride_o, stride_ro, N,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr = False,
    PAIR_BLOCK: tl.constexpr = 0, k_out_ptr=None, stride_ko=0, KEEP_K: tl.constexpr = False,
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (xf * tl.math.rsqrt(var + eps) * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + pair_position(offs, PAIR_BLOCK), y, mask=mask)
    if KEEP_K:  # the same rows in k order too (pair order above)
        tl.store(k_out_ptr + row * stride_ko + offs, y, mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, pair_block: int = 0) -> torch.Tensor:
    """norm(x); pair_block: each row in pair order for K steps of that many values
    (kernels/pair_order.py: a few-row W4A16 linear's input, written where it is made)."""
    return norm_rows(x, None, weight, eps, pair_block)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 pair_block: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual), both new tensors in x's dtype; pair_block: the norm's
    rows in pair order (rms_norm), the sum's as they are."""
    normed, summed, _ = norm_rows(x, residual, weight, eps, pair_block)
    return normed, summed


def norm_rows(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
              pair_block: int, keep_k_order: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(norm(x + residual) in pair order for pair_block (k order for 0), x + residual or None
    without a residual, the norm's rows in k order as well with keep_k_order (for a second
    reader of the same rows: the Gated DeltaNet's in_proj_ba beside in_proj_qkvz), else None)."""
    x2 = _rows(x)
    r2 = x2 if residual is None else _rows(residual)
    out = torch.empty_like(x2)
    summed = None if residual is None else torch.empty_like(x2)
    k_out = torch.empty_like(x2) if keep_k_order else None
    n = x2.shape[1]
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, out if summed is None else summed, eps, x2.stride(0), r2.stride(0),
            out.stride(0), 0 if summed is None else summed.stride(0), n,
            BLOCK=next_pow2(n), HAS_RESIDUAL=residual is not None,
            num_warps=tiles_for(x.device).elementwise_warps, PAIR_BLOCK=pair_check(n, pair_block),
            k_out_ptr=k_out, stride_ko=0 if k_out is None else k_out.stride(0), KEEP_K=keep_k_order,
            **pdl_args(x.device))
    return (out.view(x.shape), None if summed is None else summed.view(x.shape),
            None if k_out is None else k_out.view(x.shape))


@triton.jit
def _qk_norm_kernel(x_ptr, qw_ptr, kw_ptr, out_ptr, eps, stride_x, stride_o, Q_HEADS, Q_STEP, D,
                    BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (t, h): head h of token t, read from the fused projection's q | k columns (q head
    h starts at h * Q_STEP, k head j at Q_HEADS * Q_STEP + j * D), normalized with the q or the
    k weight."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    start = tl.where(h < Q_HEADS, h * Q_STEP, Q_HEADS * Q_STEP + (h - Q_HEADS) * D)
    x = tl.load(x_ptr + t * stride_x + start + offs, mask=mask, other=0.0).to(tl.float32)
    q_end = tl.where(h < Q_HEADS, D, 0)  # as a vector compare: q weight below it, k weight above
    w = tl.load(qw_ptr + offs, mask=offs < q_end, other=0.0).to(tl.float32)
    w += tl.load(kw_ptr + offs, mask=mask & (offs >= q_end), other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / D
    y = x * tl.math.rsqrt(var + eps) * w
    tl.store(out_ptr + t * stride_o + h * D + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def qk_norm(qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int, q_weight: torch.Tensor,
            k_weight: torch.Tensor, eps: float, q_step: int | None = None) -> torch.Tensor:
    """[T, >= q_heads * q_step + kv_heads * head_dim] (q | k | ...) -> [T, q_heads + kv_heads,
    head_dim]: every q head normalized with q_weight and every k head with k_weight (one launch
    instead of two norms and a concatenation). q_step: the projection's columns per q head
    (head_dim; 2 * head_dim for gated attention, whose heads carry their gate after the query)."""
    if qkv.stride(-1) != 1:
        raise ValueError("qk_norm: the projection's last dimension must be contiguous")
    tokens, heads = qkv.shape[0], q_heads + kv_heads
    out = torch.empty((tokens, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tokens:
        _qk_norm_kernel[(tokens, heads)](
            qkv, q_weight, k_weight, out, eps, qkv.stride(0), heads * head_dim, q_heads,
            q_step or head_dim, head_dim,
            BLOCK=next_pow2(head_dim), num_warps=tiles_for(qkv.device).elementwise_warps,
            **pdl_args(qkv.device))
    return out


GATED_ACTS = ("silu", "gelu_tanh")  # a gated MLP's activations the fused kernels apply


@triton.jit
def gate_act(gate, GELU: tl.constexpr):
    """A gated MLP's activation of fp32 `gate`: silu(g) = g * sigmoid(g), or GELU-tanh (Gemma)
    0.5 g (1 + tanh(z)) = g * sigmoid(2 z), z = sqrt(2 / pi) (g + 0.044715 g^3), as torch's
    F.gelu(approximate="tanh") (no tanh needed: portable to every backend)."""
    if GELU:
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        return gate / (1.0 + tl.exp(-2.0 * z))
    return gate / (1.0 + tl.exp(-gate))


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, D, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False, PAIR_BLOCK: tl.constexpr = 0):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + D + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + pair_position(offs, PAIR_BLOCK), y.to(out_ptr.dtype.element_ty),
             mask=mask)


def silu_and_mul(gate_up: torch.Tensor, pair_block: int = 0) -> torch.Tensor:
    """[..., 2*D] (gate | up) -> [..., D]; pair_block: each row in pair order (rms_norm)."""
    x2 = _rows(gate_up)
    d = x2.shape[1] // 2
    out = torch.empty((x2.shape[0], d), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, next_pow2(d))
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, x2.stride(0), out.stride(0), d, BLOCK=block,
            num_warps=tiles_for(gate_up.device).elementwise_warps, PAIR_BLOCK=pair_check(d, pair_block),
            **pdl_args(gate_up.device))
    return out.view(*gate_up.shape[:-1], d)


@triton.jit
def _sigmoid_mul_kernel(x_ptr, g_ptr, out_ptr, stride_xt, stride_gt, stride_gh, stride_ot, D,
                        BLOCK: tl.constexpr, PDL: tl.constexpr = False, PAIR_BLOCK: tl.constexpr = 0):
    """Program (t, h): x's head h of token t times sigmoid of the gate's head h (stored in pair
    order at PAIR_BLOCK)."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + t * stride_xt + h * D + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + t * stride_gt + h * stride_gh + offs, mask=mask, other=0.0).to(tl.float32)
    y = x / (1.0 + tl.exp(-g))
    tl.store(out_ptr + t * stride_ot + pair_position(h * D + offs, PAIR_BLOCK), y.to(out_ptr.dtype.element_ty),
             mask=mask)


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor, pair_block: int = 0) -> torch.Tensor:
    """x [T, H * D] * sigmoid(gate [T, H, D]) -> [T, H * D] in x's dtype; gate may be a strided
    view (gated attention's gate columns, still in the q projection's output: no copy first).
    pair_block: each output row in that pair order (kernels/pair_order.py)."""
    tokens, heads, d = gate.shape
    if x.shape != (tokens, heads * d) or x.stride(-1) != 1 or gate.stride(-1) != 1:
        raise ValueError(f"sigmoid_mul: x {tuple(x.shape)} vs gate {tuple(gate.shape)} "
                         "(last axes contiguous)")
    out = torch.empty((tokens, heads * d), dtype=x.dtype, device=x.device)
    block = min(1024, next_pow2(d))
    if tokens:
        _sigmoid_mul_kernel[(tokens, heads, triton.cdiv(d, block))](
            x, gate, out, x.stride(0), gate.stride(0), gate.stride(1), out.stride(0), d,
            BLOCK=block, num_warps=tiles_for(x.device).elementwise_warps, **pdl_args(x.device),
            PAIR_BLOCK=pair_check(heads * d, pair_block))
    return out


@triton.jit
def rotate_half(base, mask, cos, sin, HALF: tl.constexpr):
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    tl.store(base, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
    tl.store(base + HALF, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, pos_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HALF
    cos = tl.load(cache_ptr + pos * stride_c + offs_d, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(cache_ptr + pos * stride_c + HALF + offs_d, mask=d_mask, other=0.0)[None, :]
    q_base = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    k_base = k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    rotate_half(q_base, (offs_h[:, None] < NUM_Q_HEADS) & d_mask[None, :], cos, sin, HALF)
    rotate_half(k_base, (offs_h[:, None] < NUM_K_HEADS) & d_mask[None, :], cos, sin, HALF)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """In place on q [T, Hq, D] and k [T, Hkv, D]; cos_sin_cache from `ref.rope_cos_sin_cache`
    (float32, on q's device). Positions past the cache would read garbage, so the caller sizes the
    cache to max_model_len."""
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("q/k head_dim axis must be contiguous")
    if q.shape[0] == 0:
        return
    half = cos_sin_cache.shape[1] // 2
    _rope_kernel[(q.shape[0],)](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        NUM_Q_HEADS=q.shape[1], NUM_K_HEADS=k.shape[1], HEADS_PAD=next_pow2(max(q.shape[1], k.shape[1])),
        HALF=half, HALF_PAD=next_pow2(half), num_warps=tiles_for(q.device).elementwise_warps,
        **pdl_args(q.device),
    )
