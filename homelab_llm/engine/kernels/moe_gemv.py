"""A bf16/fp16 mixture-of-experts layer at batch 1 in three launches, the norm in front of it
included: the router (moe_router.route_gate_topk with its RMSNorm prologue), then two decode
GEMVs over the stacked expert weights (dense_gemv.expert_gemv / expert_sum_gemv):

  1. router: logits of RMSNorm(x + residual), softmax, top-k -> (weights, ids)
  2. gate_up: program row j is pick j: RMSNorm(x + residual) through expert ids[j]'s [gate | up]
     rows, silu(gate) * up stored as act row j (the first pick's column block 0 also stores
     x + residual, the layer's new residual)
  3. down: one GEMV over the picks' act rows side by side, segment j through expert ids[j]'s
     down rows and scaled by weights[j]: the router-weighted sum, in fp32, in one program per
     output block

Against kernels/fused_moe_decode.py (norm launch, router, gate_up split over K with a ticket
reduction, down split with a ticket-ordered combine): one launch fewer, no split-K workspaces or
tickets, and the weights stream through dense_gemv's pipelined word loads. Reference:
moe_ref.moe_experts_ref after add_rms_norm_ref and route_topk_ref; the normalized input is not
rounded to x's dtype (as in dense_gemv's prologue), nor is each pick's down product before the
weighted sum (as in fused_moe_decode).
"""

from __future__ import annotations

import torch

from homelab_llm.engine.kernels.dense_gemv import expert_gemv, expert_sum_gemv
from homelab_llm.engine.kernels.moe_router import route_gate_topk


def moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
             residual: torch.Tensor | None = None, up_tiles: dict | None = None,
             down_tiles: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out [T, H], new_residual) for x [T, H] through the picked experts (w13 [E, 2I, H], w2
    [E, H, I] in x's dtype; topk_ids int32 [T, K], topk_weights [T, K]), x normalized first
    when norm_weight is given. up_tiles / down_tiles override the GEMVs' tiles (sweeps)."""
    t = x.shape[0]
    act, new_residual = expert_gemv(x, w13, topk_ids, norm_weight=norm_weight, eps=eps,
                                    residual=residual, gated=True, **(up_tiles or {}))
    out = expert_sum_gemv(act.view(t, -1), w2, topk_ids, topk_weights, **(down_tiles or {}))
    return out, new_residual


def moe_layer_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                   eps: float, gate_weight: torch.Tensor, top_k: int, renormalize: bool,
                   w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the experts' weighted sum, x + residual) for a pre-norm decoder's MoE MLP: what
    `add_rms_norm`, the router and fused_moe give, in three launches (see the module doc).
    Without a residual (a first layer) the second result is x itself."""
    weights, ids, _ = route_gate_topk(x, gate_weight, top_k, renormalize, norm_weight=norm_weight,
                                      eps=eps, residual=residual)
    out, summed = moe_gemv(x, w13, w2, weights, ids, norm_weight=norm_weight, eps=eps,
                           residual=residual)
    return out, (x if summed is None else summed)
