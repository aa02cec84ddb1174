"""Plain-torch reference for gpt-oss's experts: biased projections and a clamped SwiGLU.

Shapes as moe_ref (w13 [E, 2I, H] with the gate rows first, then the up rows; w2 [E, H, I]),
plus biases b13 [E, 2I] and b2 [E, H] (b2 None on TP ranks > 0, so the all-reduce adds it once).
The activation, gpt-oss's: gate = min(gate, limit), up = clamp(up, -limit, limit),
out = (up + 1) * gate * sigmoid(alpha * gate). This is what the engine runs for gpt-oss on every
device today (no fused kernel yet; see the sliding helper's report).
"""

from __future__ import annotations

import torch


def clamped_swiglu_ref(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gptoss_experts_ref(x: torch.Tensor, w13: torch.Tensor, b13: torch.Tensor, w2: torch.Tensor,
                       b2: torch.Tensor | None, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       alpha: float, limit: float) -> torch.Tensor:
    """sum_k topk_weights[t, k] * (down_e(act(gate_up_e(x_t) + b13_e)) + b2_e), in x's dtype;
    one matmul per picked expert (as a grouped GEMM would)."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        rows, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        h = torch.nn.functional.linear(x[rows], w13[e], b13[e])
        act = clamped_swiglu_ref(h[:, :inter], h[:, inter:], alpha, limit)
        y = torch.nn.functional.linear(act, w2[e], b2[e] if b2 is not None else None)
        out.index_add_(0, rows, y.float() * topk_weights[rows, slot, None].float())
    return out.to(x.dtype)
