"""Plain-torch reference for gpt-oss's experts: biased projections and a clamped SwiGLU.

Shapes as moe_ref (w13 [E, 2I, H] with the gate rows first, then the up rows; w2 [E, H, I]),
plus biases b13 [E, 2I] and b2 [E, H] (b2 None on TP ranks > 0, so the all-reduce adds it once).
The activation, gpt-oss's: gate = min(gate, limit), up = clamp(up, -limit, limit),
out = (up + 1) * gate * sigmoid(alpha * gate). This is what the engine runs for gpt-oss on every
device without Triton; on GPUs the fused MoE kernels (kernels/fused_moe.py: biases and the clamp
in the GEMM epilogues, MXFP4 decoded in registers) run it, checked against this.
"""

from __future__ import annotations

import torch


# The 16 values of an fp4 (e2m1) code, low nibble first in each byte.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4_ref(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 (OCP microscaling): blocks uint8 [..., G, 16] (32 fp4 codes per group, two per
    byte, low nibble first), scales uint8 [..., G] (e8m0: 2 ** (s - 127)) -> [..., G * 32]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} "
                         "do not match ([..., G, 16] and [..., G])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.int64)
    codes = torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)  # [..., G, 32]
    values = torch.ldexp(lut[codes], scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2).to(dtype)


def clamped_swiglu_ref(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gptoss_experts_ref(x: torch.Tensor, w13: torch.Tensor, b13: torch.Tensor, w2: torch.Tensor,
                       b2: torch.Tensor | None, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       alpha: float, limit: float) -> torch.Tensor:
    """sum_k topk_weights[t, k] * (down_e(act(gate_up_e(x_t) + b13_e)) + b2_e), in x's dtype;
    one matmul per picked expert (as a grouped GEMM would). w13 may be a moe_ref.MoeMx4 (then
    w2 is None)."""
    if w2 is None:  # MXFP4 experts (moe_ref.MoeMx4): each picked expert decoded on the fly
        mx4 = w13
        up_w, down_w = (lambda e: mx4.w13.dense(e, x.dtype)), (lambda e: mx4.w2.dense(e, x.dtype))
    else:
        up_w, down_w = (lambda e: w13[e]), (lambda e: w2[e])
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        rows, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        h = torch.nn.functional.linear(x[rows], up_w(e), b13[e])
        inter = h.shape[1] // 2
        act = clamped_swiglu_ref(h[:, :inter], h[:, inter:], alpha, limit)
        y = torch.nn.functional.linear(act, down_w(e), b2[e] if b2 is not None else None)
        out.index_add_(0, rows, y.float() * topk_weights[rows, slot, None].float())
    return out.to(x.dtype)
