"""A pre-norm decoder's RMSNorm (with its residual add) and the column-parallel linear after it
as one decode-GEMV launch (kernels/dense_gemv.py), for the layers that opt in.

Exactly equivalent where it is used: the norm is the same formula with the same weight (Gemma's
1 + w is folded into the stored weight at load), a column-parallel linear needs no all-reduce, and
the gated form is SiLU-and-mul over a merged [gate | up] weight. 4-bit weights, many rows and the
CPU keep the separate ops (`fuses` says which).
"""

from __future__ import annotations

import torch

from homelab_llm.engine.kernels import dispatch
from homelab_llm.engine.layers.linear import LinearBase
from homelab_llm.engine.layers.norm import RMSNorm


def fuses(x: torch.Tensor, linear: LinearBase) -> bool:
    """norm_then_linear runs as one launch for these rows and this layer's weight."""
    return linear.w4 is None and linear.weight is not None and dispatch.dense_gemv_route(
        x, linear.weight)


def norm_then_linear(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                     linear: LinearBase, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(x + residual)), x + residual), or with no residual yet (the first layer)
    (linear(norm(x)), x): what `norm(x, residual)` then `linear(...)` return. gated: linear is
    the merged gate | up projection and the result silu(gate) * up."""
    out, summed = dispatch.norm_linear(x, residual, norm.weight, norm.eps, linear.weight,
                                       linear.bias, gated)
    return out, (x if summed is None else summed)
