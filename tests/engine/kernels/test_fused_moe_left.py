"""The fused MoE's 4-bit grouped GEMMs with the weights as the dots' left operand
(GemmTiles.w_left: w4a16_dot.wleft_steps over activations in pair order) against the reference,
on fresh random inputs: each weight form, both GEMMs or one, the activation handed from gate_up
to down in pair order by gate_up's store or by a separate reorder.

Bounds (relative Frobenius): fp32 activations in the interpreter, offset and integer-zero forms
1e-4 (measured ~5e-6: the offset form's magic-number sum cancels ~7 bits of fp32); the scaled
form rounds every weight to bf16, 1e-2 (measured 4e-3); bf16 activations on a GPU 2e-2 (both
sides round the intermediate activation to bf16 at different points). A wrong nibble, column,
row or expert is O(1).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from homelab_llm.engine.kernels.moe_ref import MoeW4, moe_experts_ref, route_topk_ref
from homelab_llm.engine.kernels.w4a16_pack import W4Weight
from tests.engine.kernels.moe_inputs import random_moe_w4, rel_err


def test_pair_order_puts_each_pair_slice_together():
    """pair_order's position j (block_k / 4) + 2 r + h holds k = 8 r + 4 h + j in every step."""
    from homelab_llm.engine.kernels.pair_order import pair_order

    block_k, steps = 64, 3
    x = torch.arange(2 * steps * block_k, dtype=torch.float32).view(2, -1)
    got = pair_order(x, block_k)
    for step in range(steps):
        for j in range(4):
            for r in range(block_k // 8):
                for h in range(2):
                    assert got[1, step * block_k + j * block_k // 4 + 2 * r + h] == \
                        x[1, step * block_k + 8 * r + 4 * h + j]


def _int_zero_w4(gen, e, k, n, group, device) -> W4Weight:
    """Random words with biases exactly -8 * scale (W4Weight.int_zeros)."""
    w = random_moe_w4(gen, e, k, n, group, device)
    return W4Weight(w.qweight, w.scales, -8 * w.scales, group, int_zeros=True)


@pytest.mark.parametrize("form,layout", [
    ("offset", "fused"), ("scaled", "reordered"), ("int_zeros", "fused"), ("offset", "up"),
    ("scaled", "down"), ("pair_accs", "fused"), ("joined", "reordered")])
def test_left_operand_gemms_match_reference(form, layout, device):
    """layout: both GEMMs left with gate_up storing its output in pair order ("fused": its
    halved block_n a whole K step of down's) or reordered apart ("reordered"); only gate_up
    ("up") or only down ("down") left, the other on the right-operand loop. pair_accs / joined:
    the scaled form with one accumulator a nibble pair or one joined dot a step (its bound), on
    integer-zero weights, which they take over the integer-zero form."""
    from homelab_llm.engine.kernels.fused_moe import fused_moe, left_block_k
    from homelab_llm.engine.kernels.tuning import GemmTiles, MoeGemmTiles

    on_gpu = torch.device(device).type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    gen = torch.Generator().manual_seed(31)
    e, h, i, top_k, g, tokens = 4, 128, 64, 2, 64, 40
    in_flight = form in ("pair_accs", "joined")
    make = _int_zero_w4 if form == "int_zeros" or in_flight else random_moe_w4
    w4 = MoeW4(make(gen, e, h, 2 * i, g, device), make(gen, e, i, h, g, device))
    x = (torch.randn(tokens, h, generator=gen) * 0.1).to(dtype).to(device)
    weights, ids = route_topk_ref(torch.randn(tokens, e, generator=gen).to(device), top_k, True)
    right = GemmTiles(32, 64, 64, num_warps=4, num_stages=2)
    left = dataclasses.replace(right, block_n=128 if layout == "fused" else 64, w_left=True,
                               scaled=form == "scaled", int_zeros=form == "int_zeros" or in_flight,
                               pair_accs=form == "pair_accs", joined=form == "joined")
    tiles = MoeGemmTiles(right if layout == "down" else left, right if layout == "up" else left)
    assert bool(left_block_k(w4.w13, tiles.up, h)) == (layout != "down")
    assert bool(left_block_k(w4.w2, tiles.down, i)) == (layout != "up")
    got = fused_moe(x, w4, None, weights, ids, tiles=tiles)
    want = moe_experts_ref(x.float(), w4, None, weights, ids)
    bound = 2e-2 if on_gpu else 1e-2 if form == "scaled" or in_flight else 1e-4
    assert rel_err(got, want) < bound, rel_err(got, want)


def test_left_operand_needs_whole_steps_in_a_group():
    """K steps under 64 values, or a K that is not whole steps, keep the right-operand loop."""
    from homelab_llm.engine.kernels.fused_moe import left_block_k
    from homelab_llm.engine.kernels.tuning import GemmTiles

    gen = torch.Generator().manual_seed(2)
    tiles = GemmTiles(32, 64, 128, num_warps=4, num_stages=2, w_left=True)
    assert left_block_k(random_moe_w4(gen, 2, 256, 64, 128, "cpu"), tiles, 256) == 128
    assert left_block_k(random_moe_w4(gen, 2, 256, 64, 64, "cpu"), tiles, 256) == 64  # the group
    assert left_block_k(random_moe_w4(gen, 2, 256, 64, 32, "cpu"), tiles, 256) == 0
    assert left_block_k(random_moe_w4(gen, 2, 192, 64, 64, "cpu"), tiles, 192) == 64
    assert left_block_k(random_moe_w4(gen, 2, 256, 64, 128, "cpu"), tiles, 192) == 0
    assert left_block_k(random_moe_w4(gen, 2, 256, 64, 128, "cpu"),
                        dataclasses.replace(tiles, w_left=False), 256) == 0
