"""The fused MoE decode kernels (fused_moe_decode.py: gate_up + SiLU-and-mul, down + the router's
combine) vs moe_ref.moe_experts_ref on fresh random inputs, 4-bit and dense experts, T <= 8.

Error bounds: 1e-4 relative Frobenius error on fp32 activations in the interpreter (the same
weights on both sides, sums in another order; observed ~5e-7: a wrong expert, slot, column, split
or router weight is O(1)). On a GPU at full shapes, bf16 activations: 2e-2 (the reference rounds
gate_up and each expert's output to bf16, the kernels keep fp32 until the end). Repeated calls are
bitwise equal (graph == eager relies on it); in the interpreter a token's row is also bitwise the
same alone and inside a batch.
"""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels.moe_ref import MoeW4, add_shared_ref, moe_experts_ref, route_topk_ref
from homelab_llm.engine.kernels.tuning import MoeDecodeTiles
from tests.engine.kernels.moe_inputs import random_moe_w4, rel_err


def _experts(gen, w4, full_shapes, device):
    e, h, i, top_k, g = (128, 2048, 768, 8, 128) if full_shapes else (8, 64, 96, 4, 32)
    dtype = torch.bfloat16 if full_shapes else torch.float32
    if w4:
        return MoeW4(random_moe_w4(gen, e, h, 2 * i, g, device),
                     random_moe_w4(gen, e, i, h, g, device)), None, e, h, top_k, dtype
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * h ** -0.5).to(dtype).to(device)
    w2 = (torch.randn(e, h, i, generator=gen) * i ** -0.5).to(dtype).to(device)
    return w13, w2, e, h, top_k, dtype


def _batch(gen, tokens, e, h, top_k, dtype, device):
    x = (torch.randn(tokens, h, generator=gen) * 0.1).to(dtype).to(device)
    weights, ids = route_topk_ref(torch.randn(tokens, e, generator=gen).to(device), top_k, True)
    return x, weights, ids


@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("w4", [True, False])
def test_decode_matches_reference(tokens, w4, device, full_shapes):
    """Through fused_moe's default decode route, which is these kernels at T <= 8."""
    from homelab_llm.engine.kernels.fused_moe import fused_moe

    gen = torch.Generator().manual_seed(600 + tokens + 10 * w4)
    w13, w2, e, h, top_k, dtype = _experts(gen, w4, full_shapes, device)
    x, weights, ids = _batch(gen, tokens, e, h, top_k, dtype, device)
    got = fused_moe(x, w13, w2, weights, ids)
    want = moe_experts_ref(x, w13, w2, weights, ids)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert rel_err(got, want) < (2e-2 if full_shapes else 1e-4), rel_err(got, want)


@pytest.mark.parametrize("w4", [True, False])
@pytest.mark.parametrize("steps,block_n", [(2, 32), (8, 64)])
def test_tile_variants_match_reference(w4, steps, block_n, device, full_shapes):
    """Other splits of K (steps 2: down's K of 96 splits 64 + 32; steps 8: one split, so no
    gate_up ticket) and column widths (64: a partial last column block of the width 96)."""
    from homelab_llm.engine.kernels.fused_moe_decode import moe_decode

    gen = torch.Generator().manual_seed(700 + steps + w4)
    w13, w2, e, h, top_k, dtype = _experts(gen, w4, full_shapes, device)
    x, weights, ids = _batch(gen, 3, e, h, top_k, dtype, device)
    tiles = MoeDecodeTiles(block_n=block_n, block_k=32, steps=steps, num_warps=4 if full_shapes else 1)
    got = moe_decode(x, w13, w2, weights, ids, tiles=tiles)
    want = moe_experts_ref(x, w13, w2, weights, ids)
    assert rel_err(got, want) < (2e-2 if full_shapes else 1e-4), rel_err(got, want)


@pytest.mark.parametrize("w4", [True, False])
def test_decode_is_deterministic(w4, device, full_shapes):
    """Repeated calls are bitwise equal; in the interpreter a token's output alone equals its
    row inside a batch (the split count depends on K alone)."""
    from homelab_llm.engine.kernels.fused_moe_decode import moe_decode

    gen = torch.Generator().manual_seed(800 + w4)
    w13, w2, e, h, top_k, dtype = _experts(gen, w4, full_shapes, device)
    x, weights, ids = _batch(gen, 8 if full_shapes else 4, e, h, top_k, dtype, device)
    batch = moe_decode(x, w13, w2, weights, ids)
    assert torch.equal(batch, moe_decode(x, w13, w2, weights, ids))
    alone = moe_decode(x[3:4], w13, w2, weights[3:4], ids[3:4])
    if full_shapes:
        assert rel_err(alone, batch[3:4]) < 1e-2
    else:
        assert torch.equal(alone, batch[3:4])


@pytest.mark.parametrize("tokens,decode", [(1, "fused"), (3, "fused"), (3, "gemm")])
def test_shared_expert_in_the_combine(tokens, decode, device, full_shapes):
    """A gated shared expert's output added in the down launch's final sum (the fused path) or
    after it (the others) vs add_shared_ref(moe_experts_ref(...))."""
    from homelab_llm.engine.kernels.fused_moe import fused_moe

    gen = torch.Generator().manual_seed(900 + tokens)
    w13, w2, e, h, top_k, dtype = _experts(gen, True, full_shapes, device)
    x, weights, ids = _batch(gen, tokens, e, h, top_k, dtype, device)
    shared_out = (torch.randn(tokens, h, generator=gen) * 0.5).to(dtype).to(device)
    shared_w = torch.rand(tokens, generator=gen).to(device)
    got = fused_moe(x, w13, w2, weights, ids, decode=decode, shared=(shared_out, shared_w))
    want = add_shared_ref(moe_experts_ref(x, w13, w2, weights, ids), shared_out, shared_w)
    assert rel_err(got, want) < (2e-2 if full_shapes else 1e-4), rel_err(got, want)


def test_every_slot_a_distinct_expert(device):
    """The worst case for the grid: T * K slots on T * K distinct experts use T * K blocks of one
    slot each -- exactly the rows the grids launch (min(blocks, T * K))."""
    from homelab_llm.engine.kernels.fused_moe_decode import moe_decode

    gen = torch.Generator().manual_seed(31)
    e, h, i, tokens, top_k = 32, 32, 32, 8, 4
    w13 = torch.randn(e, 2 * i, h, generator=gen).to(device) * h ** -0.5
    w2 = torch.randn(e, h, i, generator=gen).to(device) * i ** -0.5
    x = torch.randn(tokens, h, generator=gen).to(device)
    ids = torch.randperm(e, generator=gen)[: tokens * top_k].reshape(tokens, top_k)
    ids = ids.to(torch.int32).to(device)
    weights = torch.rand(tokens, top_k, generator=gen).to(device)
    got = moe_decode(x, w13, w2, weights, ids)
    assert rel_err(got, moe_experts_ref(x, w13, w2, weights, ids)) < 1e-4


def test_decode_rejects_bad_shapes(device):
    from homelab_llm.engine.kernels.fused_moe_decode import moe_decode

    gen = torch.Generator().manual_seed(9)
    w13, w2, e, h, top_k, dtype = _experts(gen, False, False, device)
    x, weights, ids = _batch(gen, 9, e, h, top_k, dtype, device)
    with pytest.raises(ValueError, match="9 tokens"):
        moe_decode(x, w13, w2, weights, ids)
