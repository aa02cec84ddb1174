"""RMSNorm with the residual add fused in (the pre-norm decoder adds the residual right before
each norm, so one kernel does both and saves a pass over the activations)."""

from __future__ import annotations

import torch
from torch import nn

from homelab_llm.engine.kernels import dispatch


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with a residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return dispatch.rms_norm(x, self.weight, self.eps)
        return dispatch.add_rms_norm(x, residual, self.weight, self.eps)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm, x_hat * (1 + w): the checkpoint's w is stored as 1 + w at load, so the
    forward is the plain kernel's. (In a bf16 model 1 + w is rounded to bf16 once; Gemma itself
    forms it in fp32 on every call.)"""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        self.weight.weight_loader = self.load_offset  # type: ignore[attr-defined]

    @staticmethod
    def load_offset(param: nn.Parameter, tensor: torch.Tensor, shard_id: object = None) -> None:
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"shape {tuple(tensor.shape)} != {tuple(param.shape)}")
        param.data.copy_(tensor.float() + 1.0)


def qk_norm(qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int, q_norm: RMSNorm,
            k_norm: RMSNorm, q_step: int | None = None) -> torch.Tensor:
    """QK-norm attention's per-head norms over a fused projection's q | k columns, in one launch:
    [T, q_heads + kv_heads, head_dim] (q heads first). q_step: columns per q head in the
    projection (2 * head_dim where each head's output gate follows its query)."""
    return dispatch.qk_norm(qkv, q_heads, kv_heads, head_dim, q_norm.weight, k_norm.weight,
                            q_norm.eps, q_step)
