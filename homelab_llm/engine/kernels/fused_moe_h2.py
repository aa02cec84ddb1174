"""The MoE layer at decode sizes with 4-bit experts on the packed-half GEMV (w4a16_h2 with Picks).

fused_moe_decode's kernels walk fp32 nibble math (about 3 instructions a weight) and split K
across programs, so each launch ends in a split-K tail. At decode sizes each (token, pick) is a
plain 1-row GEMV, the case w4a16_h2 is built for: about 1.1 instructions a weight, and whole-K
programs with no K split. Two launches, as before:

  gate_up  every pick's expert through its token's row, one program column a pick:
           gate_up [T * P, 2I] (x's dtype);
  down     each pick's gate_up row as SiLU(gate) * up (the GEMV's act_in prologue) through its
           expert, times its router weight; a token's P partial rows are summed in pick order by
           the split-K epilogue's slots (a fixed order: graph == eager, and a token's row the
           same in any batch), into out [T, H].

An expert two tokens pick is read twice (fused_moe_decode's blocks read it once for both).
Tiles: ArchTiles.moe_h2, the first entry whose K range fits each GEMV (tuning.moe_h2_tiles),
for up to ArchTiles.moe_h2_tokens tokens (HOMELAB_LLM_MOE_H2_TOKENS=N overrides it, 0 turns
the path off: A/B runs without a patched tree); past that, on an arch without entries, for a K
no entry fits or fp32 activations fused_moe_decode's kernels serve. A gated shared expert's
output (Qwen3.5-MoE, Qwen3-Next), computed beforehand, joins down's sum in pick 0's slot.
"""

from __future__ import annotations

import os

import torch

from homelab_llm.engine.kernels.moe_ref import MoeW4
from homelab_llm.engine.kernels.tuning import RowsTiles, moe_h2_tiles, tiles_for
from homelab_llm.engine.kernels.w4a16_h2 import Picks, w4a16_h2


TOKENS_ENV = "HOMELAB_LLM_MOE_H2_TOKENS"


def max_tokens(device: torch.device) -> int:
    """The most tokens a call may have to take moe_h2: TOKENS_ENV, else the arch table's."""
    env = os.environ.get(TOKENS_ENV, "")
    if not env:
        return tiles_for(device).moe_h2_tokens
    if not env.isdigit():
        raise ValueError(f"{TOKENS_ENV}={env!r}: a count of tokens (0 turns the path off)")
    return int(env)


def moe_h2_route(x: torch.Tensor, w: MoeW4) -> tuple[RowsTiles, RowsTiles] | None:
    """(gate_up's tiles, down's) where these tokens' 4-bit experts take moe_h2, else None."""
    if not 0 < x.shape[0] <= max_tokens(x.device) or x.dtype not in (torch.bfloat16, torch.float16):
        return None
    up = moe_h2_tiles(x.device, w.w13.qweight.shape[1] * 8, w.w13.group_size)
    down = moe_h2_tiles(x.device, w.w2.qweight.shape[1] * 8, w.w2.group_size)
    return (up, down) if up is not None and down is not None else None


def moe_h2(x: torch.Tensor, w: MoeW4, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
           tiles: tuple[RowsTiles, RowsTiles],
           shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [T, H] through its picked experts -> [T, H] in x's dtype (moe_ref.moe_experts_ref's
    result). topk_weights and topk_ids [T, P] (the router's fp32 and int32 take no copy); tiles
    moe_h2_route's. shared: (a gated shared expert's output [T, H], its gates [T]) added in
    down's sums (moe_ref.add_shared_ref), as fused_moe_decode's combine adds it."""
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"moe_h2: x {tuple(x.shape)}, picks {tuple(topk_ids.shape)} and weights "
                         f"{tuple(topk_weights.shape)}: [T, P] each for T tokens")
    ids = topk_ids.to(torch.int32).contiguous()
    inter = w.w2.qweight.shape[1] * 8
    gate_up = torch.empty((ids.numel(), 2 * inter), dtype=x.dtype, device=x.device)
    w4a16_h2(x.contiguous(), w.w13, gate_up, tiles[0], picks=Picks(ids, token_x=True, next_experts=w.w2))
    out = torch.empty_like(x)
    add = None
    if shared is not None:
        add = (shared[0].contiguous(), shared[1].reshape(-1).float().contiguous())
    return w4a16_h2(gate_up, w.w2, out, tiles[1], act_in="silu",
                    picks=Picks(ids, topk_weights.float().contiguous(), add=add))
