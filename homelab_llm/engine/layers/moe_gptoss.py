"""gpt-oss's mixture-of-experts MLP: a biased top-k router (softmax over the k picked logits) and
experts with biases and a clamped SwiGLU (kernels/moe_gptoss_ref.py).

Checkpoint layout (transformers 5, bf16): experts.gate_up_proj [E, H, 2I] with gate and up
*interleaved* along the last axis (gate = [..., ::2], up = [..., 1::2]), gate_up_proj_bias
[E, 2I] likewise, down_proj [E, I, H], down_proj_bias [E, H]. Loading de-interleaves and
transposes into FusedExperts' layout (w13 [E, 2I_local, H] gate rows then up rows, w2
[E, H, I_local]), so tensor parallelism splits each expert's intermediate dimension as for the
other MoE families. The published MXFP4 checkpoints (`*_blocks`, `*_scales`) arrive here already
dequantized (model/gpt_oss.py combine_checkpoint).
"""

from __future__ import annotations

import torch
from torch import nn

from homelab_llm.engine.kernels.moe_gptoss_ref import (gptoss_experts_dense, gptoss_experts_gathered,
                                                      gptoss_experts_ref)
from homelab_llm.engine.kernels import dispatch
from homelab_llm.engine.layers.linear import ReplicatedLinear
from homelab_llm.engine.layers.moe import ExpertPart, FusedExperts, Router
from homelab_llm.engine.parallel import state as parallel


class GptOssRouter(Router):
    """The router with its bias (one per expert)."""

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if param is self.bias:
            if tuple(loaded.shape) != (self.out_features,):
                raise ValueError(f"router bias is {tuple(loaded.shape)}, expected ({self.out_features},)")
            return ReplicatedLinear.weight_loader(self, param, loaded, shard_id)
        return super().weight_loader(param, loaded, shard_id)


class GptOssExperts(FusedExperts):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 alpha: float, limit: float):
        super().__init__(num_experts, hidden_size, intermediate_size)
        self.alpha, self.limit = alpha, limit
        inter = self.intermediate_local
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * inter), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.gate_up_proj_bias.weight_loader = self.load_bias  # type: ignore[attr-defined]
        self.down_proj_bias.weight_loader = self.load_bias  # type: ignore[attr-defined]

    def part_ids(self, param_name: str) -> list:
        return [None] if param_name.endswith("_bias") else super().part_ids(param_name)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, part: ExpertPart) -> None:
        """gpt-oss's fused, transposed, interleaved tensors -> the per-expert parts."""
        if part.expert is not None:
            return super().weight_loader(param, loaded, part)
        if loaded.dim() != 3 or loaded.shape[0] != self.num_experts:
            raise ValueError(f"expert tensor is {tuple(loaded.shape)}, expected {self.num_experts} "
                             "experts on its first dimension")
        for e in range(self.num_experts):
            if part.proj == "gate_up":  # [H, 2I] interleaved
                super().weight_loader(param, loaded[e, :, 0::2].t(), ExpertPart("gate", e))
                super().weight_loader(param, loaded[e, :, 1::2].t(), ExpertPart("up", e))
            else:  # [I, H]
                super().weight_loader(param, loaded[e].t(), ExpertPart("down", e))

    def load_bias(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if tuple(loaded.shape[:1]) != (self.num_experts,) or loaded.dim() != 2:
            raise ValueError(f"expert bias is {tuple(loaded.shape)}, expected [{self.num_experts}, N]")
        if param is self.down_proj_bias:
            param.data.copy_(loaded)
            return
        inter, start = self.intermediate_local, self.inter_start
        gate, up = loaded[:, 0::2], loaded[:, 1::2]
        param.data[:, :inter].copy_(gate[:, start:start + inter])
        param.data[:, inter:].copy_(up[:, start:start + inter])

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        # The down bias is added once: on rank 0, before the all-reduce.
        b2 = self.down_proj_bias if self.tp_rank == 0 else None
        fn = gptoss_experts_ref
        if x.is_cuda and torch.cuda.is_current_stream_capturing():  # no host sync in a graph
            few = x.shape[0] * topk_ids.shape[1] < self.num_experts
            fn = gptoss_experts_gathered if few else gptoss_experts_dense
        return fn(x, self.w13, self.gate_up_proj_bias, self.w2, b2, topk_weights, topk_ids,
                  self.alpha, self.limit)


class GptOssMoe(nn.Module):
    """router (biased) -> top-k softmax over the picked logits -> experts -> all-reduce."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 alpha: float, limit: float):
        super().__init__()
        self.top_k = top_k
        self.router = GptOssRouter(hidden_size, num_experts, bias=True)
        self.experts = GptOssExperts(num_experts, hidden_size, intermediate_size, alpha, limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # softmax over the top-k logits == the full softmax's top-k renormalised
        weights, ids = dispatch.route_topk(self.router(x), self.top_k, True)
        out = self.experts(x, weights, ids)
        return parallel.all_reduce(out) if self.experts.tp_size > 1 else out
