"""Plain-torch reference of dense_gemv.py: the unfused ops it replaces, in the engine's order
(residual add + RMSNorm, the linear, SiLU-and-mul), each rounding to the activation dtype as the
separate kernels do. The CPU path and every route off the GEMV run exactly this."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from homelab_llm.engine.kernels import ref


def norm_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                    norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                    residual: torch.Tensor | None = None, gated: bool = False,
                    act: str = "silu") -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, new_residual) with dense_gemv's contract: new_residual = x + residual when a
    residual is given (else None); out = linear(norm(...)) and, gated, act(gate) * up."""
    new_residual = None
    if norm_weight is not None:
        if residual is not None:
            x, new_residual = ref.add_rms_norm_ref(x, residual, norm_weight, eps)
        else:
            x = ref.rms_norm_ref(x, norm_weight, eps)
    out = F.linear(x, weight, bias)
    return (ref.gated_act_ref(out, act) if gated else out), new_residual
