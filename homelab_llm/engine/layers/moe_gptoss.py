"""gpt-oss's mixture-of-experts MLP: a biased top-k router (softmax over the k picked logits) and
experts with biases and a clamped SwiGLU (kernels/moe_gptoss_ref.py).

Checkpoint layout (transformers 5, bf16): experts.gate_up_proj [E, H, 2I] with gate and up
*interleaved* along the last axis (gate = [..., ::2], up = [..., 1::2]), gate_up_proj_bias
[E, 2I] likewise, down_proj [E, I, H], down_proj_bias [E, H]. Loading de-interleaves and
transposes into FusedExperts' layout (w13 [E, 2I_local, H] gate rows then up rows, w2
[E, H, I_local]), so tensor parallelism splits each expert's intermediate dimension as for the
other MoE families.

MXFP4 experts (the published checkpoints, config.experts_mxfp4) stay packed:
`gate_up_proj_blocks` [E, 2I, H/32, 16] (gate and up rows interleaved) and `_scales` [E, 2I, H/32]
load into w13 blocks [E, 2I_local, H/2] / scales [E, 2I_local, H/32] with gate rows then up rows;
`down_proj_blocks` [E, H, I/32, 16] into [E, H, I_local/2] (a rank's K slice, whole 32-groups).
The fused MoE kernels decode them in registers (kernels/fused_moe.py).
"""

from __future__ import annotations

import torch
from torch import nn

from homelab_llm.engine.kernels import dispatch
from homelab_llm.engine.kernels.moe_ref import MoeMx4, Mx4Weight
from homelab_llm.engine.layers.linear import ReplicatedLinear
from homelab_llm.engine.layers.moe import ExpertPart, FusedExperts, Router
from homelab_llm.engine.model.config import ModelLoadError
from homelab_llm.engine.parallel import state as parallel


class GptOssRouter(Router):
    """The router with its bias (one per expert)."""

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if param is self.bias:
            if tuple(loaded.shape) != (self.out_features,):
                raise ValueError(f"router bias is {tuple(loaded.shape)}, expected ({self.out_features},)")
            return ReplicatedLinear.weight_loader(self, param, loaded, shard_id)
        return super().weight_loader(param, loaded, shard_id)


MX4_GROUP = 32  # weights per e8m0 scale


class GptOssExperts(FusedExperts):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 alpha: float, limit: float, mxfp4: bool = False):
        super().__init__(num_experts, hidden_size, intermediate_size, dense=not mxfp4)
        self.alpha, self.limit = alpha, limit
        inter = self.intermediate_local
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * inter), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.gate_up_proj_bias.weight_loader = self.load_bias  # type: ignore[attr-defined]
        self.down_proj_bias.weight_loader = self.load_bias  # type: ignore[attr-defined]
        self.mxfp4 = mxfp4
        if mxfp4:
            if inter % MX4_GROUP or hidden_size % MX4_GROUP:
                raise ModelLoadError(f"MXFP4 experts: this rank's width {inter} and hidden size "
                                     f"{hidden_size} must be multiples of {MX4_GROUP}; use a "
                                     "tensor-parallel size that splits the experts in whole groups")
            shapes = {"gate_up_proj": (2 * inter, hidden_size), "down_proj": (hidden_size, inter)}
            for proj, (rows, k) in shapes.items():
                for kind, cols in (("blocks", k // 2), ("scales", k // MX4_GROUP)):
                    param = nn.Parameter(torch.empty(num_experts, rows, cols, dtype=torch.uint8),
                                         requires_grad=False)
                    param.weight_loader = self.load_mx4  # type: ignore[attr-defined]
                    self.register_parameter(f"{proj}_{kind}", param)

    def part_ids(self, param_name: str) -> list:
        if param_name.endswith(("_bias", "_blocks", "_scales")):
            return [None]
        return super().part_ids(param_name)

    def load_mx4(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """One published MXFP4 tensor ([E, out, G, 16] blocks or [E, out, G] scales) -> this
        rank's slice in our layout (see the module docstring)."""
        blocks = loaded.dim() == 4
        full = self.intermediate_local * self.tp_size
        gate_up = param is self.gate_up_proj_blocks or param is self.gate_up_proj_scales
        rows, k = (2 * full, self.hidden_size) if gate_up else (self.hidden_size, full)
        want = (self.num_experts, rows, k // MX4_GROUP) + ((16,) if blocks else ())
        if tuple(loaded.shape) != want or loaded.dtype != torch.uint8:
            raise ValueError(f"MXFP4 tensor is {tuple(loaded.shape)} {loaded.dtype}, expected "
                             f"{want} uint8")
        flat = loaded.reshape(self.num_experts, rows, -1)  # [E, out, K / 2] or [E, out, K / 32]
        inter, start = self.intermediate_local, self.inter_start
        if gate_up:
            param.data[:, :inter].copy_(flat[:, 0::2][:, start:start + inter])
            param.data[:, inter:].copy_(flat[:, 1::2][:, start:start + inter])
            return
        # This rank's K columns [start, start + inter) are whole 32-groups (checked at init):
        # bytes or scales scale with K by the same factor.
        lo = start * flat.shape[2] // full
        hi = (start + inter) * flat.shape[2] // full
        param.data.copy_(flat[:, :, lo:hi])

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
        if self.mxfp4:
            w13, w2 = MoeMx4(Mx4Weight(self.gate_up_proj_blocks, self.gate_up_proj_scales),
                             Mx4Weight(self.down_proj_blocks, self.down_proj_scales)), None
        else:
            w13, w2 = self.w13, self.w2
        return dispatch.fused_moe(x, w13, w2, topk_weights, topk_ids, b13=self.gate_up_proj_bias,
                                  b2=b2, clamp=(self.alpha, self.limit))


class GptOssMoe(nn.Module):
    """router (biased) -> top-k softmax over the picked logits -> experts -> all-reduce."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 alpha: float, limit: float, mxfp4: bool = False):
        super().__init__()
        self.top_k = top_k
        self.router = GptOssRouter(hidden_size, num_experts, bias=True)
        self.experts = GptOssExperts(num_experts, hidden_size, intermediate_size, alpha, limit,
                                     mxfp4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # softmax over the top-k logits == the full softmax's top-k renormalised
        weights, ids = dispatch.route_topk(self.router(x), self.top_k, True)
        out = self.experts(x, weights, ids)
        return parallel.all_reduce(out) if self.experts.tp_size > 1 else out
