"""Plain-torch reference for gpt-oss's experts: biased projections and a clamped SwiGLU.

Shapes as moe_ref (w13 [E, 2I, H] with the gate rows first, then the up rows; w2 [E, H, I]),
plus biases b13 [E, 2I] and b2 [E, H] (b2 None on TP ranks > 0, so the all-reduce adds it once).
The activation, gpt-oss's: gate = min(gate, limit), up = clamp(up, -limit, limit),
out = (up + 1) * gate * sigmoid(alpha * gate). This is what the engine runs for gpt-oss on every
device today (no fused kernel yet). Three formulations of one sum: `gptoss_experts_ref` loops over
the picked experts (a host sync: eager only); the two `_static` ones have no data-dependent shapes,
so CUDA graphs can capture them: `gathered` copies each pick's weights (few tokens), `dense` runs
every expert on every token with zero weight where not picked (many tokens).
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


def _act(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    inter = h.shape[-1] // 2
    return clamped_swiglu_ref(h[..., :inter], h[..., inter:], alpha, limit)


def gptoss_experts_gathered(x, w13, b13, w2, b2, topk_weights, topk_ids, alpha, limit) -> torch.Tensor:
    """Per (token, pick): its expert's weights gathered, one batched matmul each projection."""
    t, k = topk_ids.shape
    ids = topk_ids.reshape(-1).long()
    xs = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # [T*K, H, 1]
    h = torch.bmm(w13[ids], xs).squeeze(-1) + b13[ids]
    y = torch.bmm(w2[ids], _act(h, alpha, limit).unsqueeze(-1)).squeeze(-1)
    if b2 is not None:
        y = y + b2[ids]
    y = y.float().view(t, k, -1) * topk_weights.float().unsqueeze(-1)
    return y.sum(dim=1).to(x.dtype)


def gptoss_experts_dense(x, w13, b13, w2, b2, topk_weights, topk_ids, alpha, limit) -> torch.Tensor:
    """Every expert on every token, weighted by the (mostly zero) routing weight."""
    num_experts = w13.shape[0]
    gates = torch.zeros(x.shape[0], num_experts, dtype=torch.float32, device=x.device)
    gates.scatter_(1, topk_ids.long(), topk_weights.float())
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(num_experts):
        h = torch.nn.functional.linear(x, w13[e], b13[e])
        y = torch.nn.functional.linear(_act(h, alpha, limit), w2[e], b2[e] if b2 is not None else None)
        out += y.float() * gates[:, e:e + 1]
    return out.to(x.dtype)
