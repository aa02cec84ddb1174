"""The fused MoE's short last blocks (MoeGemmTiles.tail_m: an expert's last align block with at
most tail_m rows runs in a second launch of each GEMM on tail_m-row programs) against the
reference, on fresh random inputs: dense and 4-bit experts, both operand loops.

Per-expert row counts are set so that every case of the cut occurs: no rows, fewer than the
cut, exactly the cut, one more, a full block, a full block plus a short one. A block left to
neither launch leaves its rows unwritten (O(1) error); bounds as in test_fused_moe.py: fp32 in
the interpreter 1e-4 (1e-2 for the scaled form's bf16 weights), bf16 on a GPU 2e-2.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from homelab_llm.engine.kernels.moe_ref import MoeW4, moe_experts_ref
from tests.engine.kernels.moe_inputs import random_moe_w4, rel_err

COUNTS = (5, 40, 20, 0, 64, 17, 16, 33)  # rows per expert at block_m 32, tail_m 16


def _routing(gen, device):
    """topk_ids [T, 1] with COUNTS[e] tokens on expert e, shuffled; weights 1."""
    ids = torch.cat([torch.full((c,), e, dtype=torch.int32) for e, c in enumerate(COUNTS)])
    ids = ids[torch.randperm(ids.numel(), generator=gen)].view(-1, 1)
    return torch.ones(ids.shape, dtype=torch.float32).to(device), ids.to(device)


@pytest.mark.parametrize("experts", ["dense", "w4", "w4_left"])
def test_tail_blocks_match_reference(experts, device):
    from homelab_llm.engine.kernels.fused_moe import fused_moe
    from homelab_llm.engine.kernels.tuning import GemmTiles, MoeGemmTiles

    on_gpu = torch.device(device).type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    gen = torch.Generator().manual_seed(44)
    e, h, i = len(COUNTS), 128, 64
    weights, ids = _routing(gen, device)
    x = (torch.randn(ids.shape[0], h, generator=gen) * 0.1).to(dtype).to(device)
    tiles = GemmTiles(32, 64, 64, num_warps=4, num_stages=2, w_left=experts == "w4_left",
                      scaled=experts == "w4_left")
    if experts == "dense":
        w13 = (torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5).to(dtype).to(device)
        w2 = (torch.randn(e, h, i, generator=gen) / i ** 0.5).to(dtype).to(device)
        want = moe_experts_ref(x, w13, w2, weights, ids)
    else:
        w13 = MoeW4(random_moe_w4(gen, e, h, 2 * i, 64, device), random_moe_w4(gen, e, i, h, 64, device))
        w2 = None
        want = moe_experts_ref(x.float(), w13, None, weights, ids)
    plain = fused_moe(x, w13, w2, weights, ids, tiles=MoeGemmTiles(tiles, tiles))
    got = fused_moe(x, w13, w2, weights, ids, tiles=MoeGemmTiles(tiles, tiles, tail_m=16))
    bound = 2e-2 if on_gpu else 1e-2 if experts == "w4_left" else 1e-4
    assert rel_err(got, want) < bound, rel_err(got, want)
    # the same products on the same rows, only split between launches
    assert rel_err(got, plain) < (2e-2 if on_gpu else 1e-6), rel_err(got, plain)


def test_tail_m_must_be_a_power_of_two_below_block_m():
    from homelab_llm.engine.kernels.tuning import GemmTiles, MoeGemmTiles

    tiles = GemmTiles(64, 64, 64, num_warps=4, num_stages=2)
    assert MoeGemmTiles(tiles, tiles, tail_m=32).tail_m == 32
    for bad in (8, 24, 64, 128):
        with pytest.raises(ValueError, match="tail_m"):
            MoeGemmTiles(tiles, tiles, tail_m=bad)
    assert dataclasses.replace(MoeGemmTiles(tiles, tiles), tail_m=16).tail_m == 16
