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
