"""A pre-norm decoder's RMSNorm (with its residual add) and the column-parallel linear after it
as one decode-GEMV launch, and a gated MLP (SiLU, or Gemma's GELU-tanh) with its act-and-mul
inside a GEMV, for the layers that opt in.

bf16/fp16 weights take kernels/dense_gemv.py: the norm as its prologue, act-and-mul as the
gate | up GEMV's epilogue. W4A16 weights take the packed-half GEMV (kernels/w4a16_h2.py): the
norm as its prologue, act-and-mul as the down projection's prologue (its K split cannot pair
gate and up columns in one epilogue).

Exactly equivalent where it is used: the norm is the same formula with the same weight (Gemma's
1 + w is folded into the stored weight at load), a column-parallel linear needs no all-reduce,
and the gated form is act-and-mul over a merged [gate | up] weight. Act-order 4-bit weights,
many rows and the CPU keep the separate ops (`fuses` says which).
"""

from __future__ import annotations

import torch

from homelab_llm.engine.kernels import dispatch
from homelab_llm.engine.layers.linear import LinearBase, RowParallelLinear
from homelab_llm.engine.layers.norm import RMSNorm
from homelab_llm.engine.layers.norm_chain import act_epilogue_mlp


def fuses(x: torch.Tensor, linear: LinearBase) -> bool:
    """norm_then_linear runs as one launch for these rows and this layer's weight, or (W4A16 on
    the few-row kernels) as a norm writing the linear's input in the form it reads: the
    left-operand kernel's pair order, the mma kernel's scaled pairs."""
    if linear.w4 is not None:
        return (dispatch.w4a16_prologue_route(x, linear.w4) or dispatch.w4a16_mma_route(x, linear.w4)
                or dispatch.w4a16_pairs_block(x, linear.w4) > 0)
    return linear.weight is not None and dispatch.dense_gemv_route(x, linear.weight)


def norm_then_linear(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                     linear: LinearBase, gated: bool = False,
                     act: str = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(x + residual)), x + residual), or with no residual yet (the first layer)
    (linear(norm(x)), x): what `norm(x, residual)` then `linear(...)` return. gated: linear is
    the merged gate | up projection and the result act(gate) * up (bf16/fp16 weights only)."""
    if linear.w4 is not None:
        if gated:
            raise ValueError("a W4A16 gate | up projection takes its activation in the down "
                             "projection's prologue (gated_mlp)")
        out, summed = dispatch.w4a16_norm_matmul(x, residual, norm.weight, norm.eps, linear.w4)
        if linear.bias is not None:
            out = out + linear.bias
    else:
        out, summed = dispatch.norm_linear(x, residual, norm.weight, norm.eps, linear.weight,
                                           linear.bias, gated, act)
    return out, (x if summed is None else summed)


def norm_then_linear_keep(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                          linear: LinearBase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """norm_then_linear for a W4A16 linear (linear.w4 set; `fuses` says when it is one launch),
    plus the normalized rows, which its GEMV's prologue stores for the other linears that read
    the same norm: (linear(norm(x + residual)), x + residual, norm(x + residual))."""
    out, summed, normed = dispatch.w4a16_norm_matmul_keep(x, residual, norm.weight, norm.eps,
                                                          linear.w4)
    if linear.bias is not None:
        out = out + linear.bias
    return out, (x if summed is None else summed), normed


def gated_mlp(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, gate_up: LinearBase,
              down: RowParallelLinear, act: str = "silu") -> tuple[torch.Tensor, torch.Tensor] | None:
    """(down(act(gate) * up of gate_up(norm(x + residual))), x + residual) with the norm and the
    act-and-mul inside the GEMVs, or None where these rows or weights keep the separate ops."""
    if not fuses(x, gate_up):
        return None
    if gate_up.w4 is None:
        h, residual = norm_then_linear(x, residual, norm, gate_up, gated=True, act=act)
        return down(h), residual
    chained = act_epilogue_mlp(x, residual, norm, gate_up, down, act)  # the few-row kernel's rows
    if chained is not None:
        return chained
    if down.w4 is None or not (dispatch.w4a16_prologue_route(x, down.w4) or dispatch.w4a16_mma_route(x, down.w4)
                               or (act == "silu" and dispatch.w4a16_pairs_block(x, down.w4))):
        return None
    h, residual = norm_then_linear(x, residual, norm, gate_up)
    return down(h, act_in=act), residual
