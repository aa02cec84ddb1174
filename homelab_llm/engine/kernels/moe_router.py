"""The softmax top-k router in one kernel launch: per token, softmax over the E logits (fp32),
the top_k largest probabilities and their expert ids, renormalised to sum 1 when asked.
Reference: moe_ref.route_topk_ref (torch softmax + topk: four to five launches per layer).

One program per token holds its whole logit row in registers (E <= MAX_EXPERTS) and picks the
top_k by repeated max: ties go to the lowest expert id. Output: weights float32 [T, K], ids int32
[T, K], in descending weight order as torch.topk gives them. No host reads: graph-capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.tuning import tiles_for

MAX_EXPERTS = 1024


@triton.jit
def _route_topk_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride_l,
                       TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                       RENORMALIZE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    x = tl.load(logits_ptr + t * stride_l + offs, mask=mask, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(mask, p, 0.0)
    p = p / tl.sum(p, axis=0)
    remaining = tl.where(mask, p, -1.0)  # probabilities are >= 0: -1 marks taken or padding
    k_offs = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=0)
        idx = tl.min(tl.where(remaining == best, offs, BLOCK_E), axis=0)
        weights = tl.where(k_offs == k, best, weights)
        ids = tl.where(k_offs == k, idx, ids)
        remaining = tl.where(offs == idx, -1.0, remaining)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    k_mask = k_offs < TOP_K
    tl.store(weights_ptr + t * TOP_K + k_offs, weights, mask=k_mask)
    tl.store(ids_ptr + t * TOP_K + k_offs, ids, mask=k_mask)


def route_topk(router_logits: torch.Tensor, top_k: int,
               renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights float32 [T, K], ids int32 [T, K]); see the module doc."""
    t, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts or num_experts > MAX_EXPERTS:
        raise ValueError(f"router: top_k {top_k} of {num_experts} experts (at most "
                         f"{MAX_EXPERTS}) is not a valid pick")
    weights = torch.empty((t, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=router_logits.device)
    if t == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    _route_topk_kernel[(t,)](
        logits, weights, ids, num_experts, logits.stride(0),
        TOP_K=top_k, BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_K=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
        num_warps=tiles_for(logits.device).elementwise_warps)
    return weights, ids
