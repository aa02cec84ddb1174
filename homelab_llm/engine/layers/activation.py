"""SiLU-and-mul: the gated MLP's activation over the merged [gate | up] projection."""

from __future__ import annotations

import torch
from torch import nn

from homelab_llm.engine.kernels import dispatch


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., 2 * d] -> silu(gate) * up, [..., d]."""
        return dispatch.silu_and_mul(gate_up)
