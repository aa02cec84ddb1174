"""The few-row W4A16 linears with their chained epilogues (kernels/w4a16_epilogue.py): the linear
before a norm forms the norm's input and its rows' 1 / rms for the linear after it, which
applies that scale; a gate | up linear after a norm stores act(gate) * up for the down
projection. x comes in pair order from its producer (every route here reads it so:
dispatch.w4a16_pairs_block > 0).
"""

from __future__ import annotations

import torch

from homelab_llm.engine.kernels.w4a16_dot import dot_grid, launch_tiles, w4a16_dot
from homelab_llm.engine.kernels.w4a16_epilogue import ACT_OUT, NORM_OUT, DotChain
from homelab_llm.engine.kernels.w4a16_pack import W4Weight


def norm_out_dot(x2: torch.Tensor, w: W4Weight, residual: torch.Tensor, norm_weight: torch.Tensor,
                 eps: float, pair_block: int, split: int | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, rstd, summed) of out = x2 W into the next RMSNorm: summed = out + residual (rounded as
    the norm's add rounds it), y = summed * norm_weight in pair order at pair_block (the next
    linear's K step), rstd [M] fp32 the rows' 1 / rms: the next linear's paired_dot inputs.
    split: K splits (w4a16_dot's choice by default)."""
    m, n = x2.shape[0], w.out_features
    grid_n = dot_grid(m, n, launch_tiles(m, w, x2.device)[1])[3]
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    summed = torch.empty_like(y)
    rstd = torch.empty(m, dtype=torch.float32, device=x2.device)
    chain = DotChain(NORM_OUT, out_pairs=pair_block, residual=residual, norm_weight=norm_weight, eps=eps,
                     summed=summed, y=y, rstd=rstd,
                     parts=torch.empty((grid_n, m), dtype=torch.float32, device=x2.device))
    w4a16_dot(x2, w, y, split=split, w_left=True, x_paired=True, chain=chain)
    return y, rstd, summed


def paired_dot(x2: torch.Tensor, w: W4Weight, rstd: torch.Tensor | None = None, act: str | None = None,
               act_pairs: int = 0, split: int | None = None) -> torch.Tensor:
    """x2 (pair order) @ W: out [M, N], each row scaled by rstd where given (x2 and rstd the
    linear before the norm's y and rstd, norm_out_dot: rms_norm's output @ W); or with act
    ("silu", "gelu_tanh") act(gate) * up of that gate | up product [M, N / 2], in pair order at
    act_pairs (the down projection's K step). split: as norm_out_dot's."""
    m, n = x2.shape[0], w.out_features
    out = torch.empty((m, n // 2 if act else n), dtype=x2.dtype, device=x2.device)
    chain = DotChain(ACT_OUT, act=act, out_pairs=act_pairs, y=out, rstd_in=rstd) if act else DotChain(rstd_in=rstd)
    return w4a16_dot(x2, w, out, split=split, w_left=True, x_paired=True, chain=chain)


def act_pairs_fit(m: int, w: W4Weight, device: torch.device) -> bool:
    """paired_dot(act=...) can serve m rows of the gate | up weight w: the left-operand loop, and
    its column blocks pair the gate and up features (whole half blocks of features)."""
    w_left, t = launch_tiles(m, w, device)
    return w_left and (w.out_features // 2) % (t.block_n // 2) == 0
