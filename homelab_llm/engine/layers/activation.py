"""The gated MLP's activations over the merged [gate | up] projection: SiLU (Llama, Qwen) and
GELU-tanh (Gemma)."""

from __future__ import annotations

import torch
from torch import nn

from homelab_llm.engine.kernels import dispatch


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., 2 * d] -> silu(gate) * up, [..., d]."""
        return dispatch.silu_and_mul(gate_up)


class GeluTanhAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., 2 * d] -> gelu_tanh(gate) * up, [..., d] (torch ops: two elementwise kernels)."""
        return dispatch.gated_act(gate_up, "gelu_tanh")
