"""Plain-torch mixture-of-experts references: the router, the expert MLPs and the combine.

These are what the CPU engine runs and what the Triton kernels (fused_moe.py, moe_align.py) are
tested against. Shapes, for T tokens, hidden H, E experts of intermediate I, top-k K:
  router logits [T, E] -> topk_weights float32 [T, K], topk_ids int32 [T, K]
  w13 [E, 2I, H]: rows [0, I) are the gate projection, rows [I, 2I) the up projection (HF layout)
  w2  [E, H, I]:  the down projection
Expert outputs are weighted by the router in float32 and summed over the K picks of a token.
W4A16 experts (`MoeW4`) hold one W4Weight layout per expert stacked on a leading E dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from homelab_llm.engine.kernels.w4a16_pack import W4Weight


def route_topk_ref(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (float32) over experts, the top_k largest; renormalised to sum 1 if asked."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


@dataclass
class MoeW4:
    """4-bit experts: gate_up and down, each a W4Weight whose tensors carry a leading E dim
    (qweight [E, K // 8, N], scales/biases [E, K // G, N]); no act-order permutation."""

    w13: W4Weight  # K = H, N = 2I
    w2: W4Weight  # K = I, N = H

    def expert(self, which: str, e: int) -> W4Weight:
        w = getattr(self, which)
        return W4Weight(w.qweight[e], w.scales[e], w.biases[e], w.group_size)


@dataclass
class Mx4Weight:
    """MXFP4 weights of E experts as gpt-oss publishes them: blocks uint8 [E, N, K // 2] (two e2m1
    codes a byte, low nibble first) and scales uint8 [E, N, K // 32] (e8m0: 2 ** (s - 127))."""

    blocks: torch.Tensor
    scales: torch.Tensor

    def dense(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e as [N, K] in dtype (the reference's view)."""
        from homelab_llm.engine.kernels.moe_gptoss_ref import dequantize_mxfp4_ref

        n, half = self.blocks.shape[1:]
        return dequantize_mxfp4_ref(self.blocks[e].reshape(n, half // 16, 16), self.scales[e], dtype)


@dataclass
class MoeMx4:
    """MXFP4 experts: gate_up (N = 2I, gate rows then up rows; K = H) and down (N = H, K = I)."""

    w13: Mx4Weight
    w2: Mx4Weight


def expert_shape(w13: torch.Tensor | MoeW4 | MoeMx4) -> tuple[int, int]:
    """(experts, intermediate width) of the gate_up weights in any of the three layouts."""
    if isinstance(w13, MoeW4):
        return w13.w13.qweight.shape[0], w13.w13.qweight.shape[2] // 2
    if isinstance(w13, MoeMx4):
        return w13.w13.blocks.shape[0], w13.w13.blocks.shape[1] // 2
    return w13.shape[0], w13.shape[1] // 2


def _expert_linear(x: torch.Tensor, weight: torch.Tensor | MoeW4, which: str, e: int) -> torch.Tensor:
    """x [n, in] through expert e's `which` ("w13" or "w2") projection, in x's dtype."""
    if isinstance(weight, MoeW4):
        from homelab_llm.engine.kernels.ref import w4a16_matmul_ref

        return w4a16_matmul_ref(x, weight.expert(which, e))
    return F.linear(x, weight[e])


def moe_experts_ref(x: torch.Tensor, w13: torch.Tensor | MoeW4, w2: torch.Tensor | None,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, k].

    Loops over the experts that were picked (one matmul each), as a grouped GEMM would.
    Pass w13 as MoeW4 (and w2=None) for 4-bit experts."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1).long()
    top_k = topk_ids.shape[-1]
    for e in torch.unique(flat_ids).tolist():
        slots = (flat_ids == e).nonzero().squeeze(1)
        tokens = slots // top_k
        gate_up = _expert_linear(x[tokens], w13, "w13", e)
        inter = gate_up.shape[-1] // 2
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        down = _expert_linear(act, w13 if w2 is None else w2, "w2", e)
        weight = topk_weights.reshape(-1)[slots].float()
        out.index_add_(0, tokens, down.float() * weight[:, None])
    return out.to(x.dtype)


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int,
                  block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the T*K (token, pick) slots by expert, each expert's run padded to block_m.

    Returns sorted_slots int32 [P] (slot = t * K + k; padding holds T*K), block_expert int32
    [P // block_m] (-1 for unused blocks) and num_padded int32 [1]. P = max_padded_slots(...):
    fixed by the shapes alone, so the kernels launch without reading a count back."""
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    total = max_padded_slots(n, num_experts, block_m)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    sorted_slots = torch.full((total,), n, dtype=torch.int32, device=flat.device)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n, device=flat.device) - first_of_expert[expert_of]
    sorted_slots[starts[expert_of] + rank] = order.to(torch.int32)
    block_expert = torch.full((total // block_m,), -1, dtype=torch.int32, device=flat.device)
    blocks = padded // block_m
    block_expert[: int(blocks.sum())] = torch.repeat_interleave(
        torch.arange(num_experts, device=flat.device), blocks).to(torch.int32)
    return sorted_slots, block_expert, padded.sum().reshape(1).to(torch.int32)


def max_padded_slots(num_slots: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the padded slot count: every used expert wastes < block_m slots, and at
    most min(E, slots) experts are used. A multiple of block_m."""
    blocks = -(-num_slots // block_m) + min(num_experts, num_slots)
    return blocks * block_m


def moe_combine_ref(expert_out: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """expert_out [T*K, H] (slot order) -> [T, H]: the router-weighted sum over each token's K."""
    t, k = topk_weights.shape
    y = expert_out.float().view(t, k, -1) * topk_weights.float()[:, :, None]
    return y.sum(dim=1).to(expert_out.dtype)


def add_shared_ref(out: torch.Tensor, shared_out: torch.Tensor,
                   shared_weight: torch.Tensor) -> torch.Tensor:
    """out + shared_weight[t] * shared_out[t] (a gated shared expert), summed in float32: what the
    decode kernels fold into their combine (fused_moe_decode's `shared`)."""
    return (out.float() + shared_weight.float()[:, None] * shared_out.float()).to(out.dtype)
