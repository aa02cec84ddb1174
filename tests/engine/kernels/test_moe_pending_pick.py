"""One token's top-k left to the expert kernels (moe_router.route_gate_pending, pick_slot,
fused_moe_decode's PICK launch) against the router's own pick (route_topk / route_gate_topk, the
chain of repeated max) and moe_ref.route_topk_ref, on fresh random inputs.

Bounds: expert ids exact, ties to the lowest id as route_topk breaks them; weights within 1e-6
absolute (exp(l - max) over a sum in fp32, summed in another order than the router's); the
experts' output with a pending pick within 1e-5 relative of the same kernels fed the router's
picks (fp32 activations: only the weights' last bits differ; a wrong expert or weight is O(1)).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.moe_ref import MoeW4, moe_experts_ref, route_topk_ref
from homelab_llm.engine.kernels.moe_router import (PendingPick, pick_slot, route_gate_pending,
                                                   route_gate_topk, route_topk)
from tests.engine.kernels.moe_inputs import random_moe_w4, rel_err


@triton.jit
def _pick_kernel(logits_ptr, weights_ptr, ids_ptr, E, TOP_K: tl.constexpr,
                 E_POW2: tl.constexpr, CHUNK: tl.constexpr, RENORMALIZE: tl.constexpr):
    slot = tl.program_id(0)
    e, w = pick_slot(logits_ptr, E, slot, TOP_K, E_POW2, CHUNK, RENORMALIZE)
    tl.store(ids_ptr + slot, e)
    tl.store(weights_ptr + slot, w)


def _pick(logits: torch.Tensor, top_k: int, renormalize: bool, chunk: int = 32):
    """pick_slot for every slot of one fp32 row [E]: (weights [K], ids [K])."""
    e = logits.shape[0]
    e_pow2 = triton.next_power_of_2(e)
    weights = torch.empty(top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(top_k, dtype=torch.int32, device=logits.device)
    _pick_kernel[(top_k,)](logits.float().contiguous(), weights, ids, e, TOP_K=top_k,
                           E_POW2=e_pow2, CHUNK=min(chunk, e_pow2), RENORMALIZE=renormalize)
    return weights, ids


@pytest.mark.parametrize("experts,top_k,chunk", [(128, 8, 32), (60, 4, 16), (8, 8, 32),
                                                 (512, 10, 32), (33, 2, 64)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_pick_slot_matches_the_router(experts, top_k, chunk, renormalize, device):
    gen = torch.Generator().manual_seed(experts + top_k + renormalize)
    logits = (torch.randn(experts, generator=gen) * 3).to(device)
    weights, ids = _pick(logits, top_k, renormalize, chunk)
    want_w, want_ids = route_topk_ref(logits[None], top_k, renormalize)
    assert torch.equal(ids.cpu(), want_ids[0].cpu())
    torch.testing.assert_close(weights.cpu(), want_w[0].cpu(), atol=1e-6, rtol=0)


def test_pick_slot_breaks_ties_as_the_router(device):
    """bf16 logits repeat: equal logits go to the lowest id, in route_topk's order."""
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randint(-3, 4, (64,), generator=gen).float() / 2).to(device)
    for renormalize in (True, False):
        weights, ids = _pick(logits, 8, renormalize)
        want_w, want_ids = route_topk(logits[None], 8, renormalize)
        assert torch.equal(ids.cpu(), want_ids[0].cpu())
        torch.testing.assert_close(weights.cpu(), want_w[0].cpu(), atol=1e-6, rtol=0)


def test_nan_logits_still_pick_real_experts(device):
    logits = torch.full((60,), float("nan"), device=device)
    _, ids = _pick(logits, 4, True)
    assert int(ids.min()) >= 0 and int(ids.max()) < 60
    logits = torch.randn(60, device=device)
    logits[[5, 9]] = float("nan")
    _, ids = _pick(logits, 4, True)
    assert int(ids.min()) >= 0 and int(ids.max()) < 60


def _experts(gen, w4: bool, device):
    e, h, i, g = 8, 64, 96, 32
    if w4:
        return MoeW4(random_moe_w4(gen, e, h, 2 * i, g, device),
                     random_moe_w4(gen, e, i, h, g, device)), None
    return ((torch.randn(e, 2 * i, h, generator=gen) * h ** -0.5).to(device),
            (torch.randn(e, h, i, generator=gen) * i ** -0.5).to(device))


@pytest.mark.parametrize("w4", [True, False])
@pytest.mark.parametrize("shared", [False, True])
def test_experts_take_the_pick(w4, shared, device):
    """route_gate_pending + moe_decode(pick=) against route_gate_topk + moe_decode: the buffers
    the up launch fills hold the router's picks, the output is the same (and the reference's)."""
    from homelab_llm.engine.kernels.fused_moe_decode import moe_decode

    gen = torch.Generator().manual_seed(70 + 2 * w4 + shared)
    w13, w2 = _experts(gen, w4, device)
    x = torch.randn(1, 64, generator=gen).to(device)
    gate = (torch.randn(8, 64, generator=gen)).to(device)
    shared_gate = (torch.randn(1, 64, generator=gen) * 0.2).to(device) if shared else None
    shared_out = torch.randn(1, 64, generator=gen).to(device)
    want_w, want_ids, want_sw = route_gate_topk(x, gate, 3, True, shared_gate)
    pick, shared_w, normed, summed = route_gate_pending(x, None, None, 0.0, gate, 3, True,
                                                        shared_gate)
    assert normed is x and summed is x
    if shared:
        torch.testing.assert_close(shared_w.cpu(), want_sw.cpu(), atol=0, rtol=0)
    want = moe_decode(x, w13, w2, want_w, want_ids,
                      shared=(shared_out, want_sw) if shared else None)
    got = moe_decode(x, w13, w2, pick.weights, pick.ids, pick=pick,
                     shared=(shared_out, shared_w) if shared else None)
    assert torch.equal(pick.ids.cpu(), want_ids.cpu())
    torch.testing.assert_close(pick.weights.cpu(), want_w.cpu(), atol=1e-6, rtol=0)
    assert rel_err(got, want) < 1e-5, rel_err(got, want)
    if not shared:
        assert rel_err(got, moe_experts_ref(x, w13, w2, want_w, want_ids)) < 1e-4


def test_pending_pick_with_the_norm(device):
    """The norm-folded router (residual, norm weight) leaves the same picks for the experts."""
    from homelab_llm.engine.kernels.moe_router import route_gate_topk_norm

    gen = torch.Generator().manual_seed(77)
    x, res = torch.randn(2, 1, 64, generator=gen).to(device)
    nw = (torch.rand(64, generator=gen) + 0.5).to(device)
    gate = torch.randn(16, 64, generator=gen).to(device)
    want_w, want_ids, _, want_normed, want_summed = route_gate_topk_norm(x, res, nw, 1e-6, gate,
                                                                        4, False)
    pick, _, normed, summed = route_gate_pending(x, res, nw, 1e-6, gate, 4, False)
    torch.testing.assert_close(normed.cpu(), want_normed.cpu(), atol=0, rtol=0)
    torch.testing.assert_close(summed.cpu(), want_summed.cpu(), atol=0, rtol=0)
    pick.finish()  # the path without the PICK launch: the router's own kernel over the logits
    assert torch.equal(pick.ids.cpu(), want_ids.cpu())
    torch.testing.assert_close(pick.weights.cpu(), want_w.cpu(), atol=1e-6, rtol=0)


def test_other_expert_paths_finish_the_pick(device):
    """fused_moe's GEMM route (decode="gemm") finishes a pending pick before it reads it."""
    from homelab_llm.engine.kernels.fused_moe import fused_moe

    gen = torch.Generator().manual_seed(78)
    w13, w2 = _experts(gen, False, device)
    x = torch.randn(1, 64, generator=gen).to(device)
    gate = torch.randn(8, 64, generator=gen).to(device)
    want_w, want_ids, _ = route_gate_topk(x, gate, 2, True)
    pick, _, _, _ = route_gate_pending(x, None, None, 0.0, gate, 2, True)
    got = fused_moe(x, w13, w2, pick.weights, pick.ids, decode="gemm", pick=pick)
    assert torch.equal(pick.ids.cpu(), want_ids.cpu())
    assert rel_err(got, moe_experts_ref(x, w13, w2, want_w, want_ids)) < 1e-4


def test_bad_pending_picks_are_refused(device):
    from homelab_llm.engine.kernels.fused_moe_decode import moe_decode

    gen = torch.Generator().manual_seed(79)
    w13, w2 = _experts(gen, False, device)
    gate = torch.randn(8, 64, generator=gen).to(device)
    with pytest.raises(ValueError, match="one token, got 2"):
        route_gate_pending(torch.zeros(2, 64, device=device), None, None, 0.0, gate, 2, True)
    pick, _, _, _ = route_gate_pending(torch.randn(1, 64, device=device), None, None, 0.0, gate,
                                       2, True)
    other = PendingPick(pick.logits, 8, True, pick.weights.clone(), pick.ids.clone())
    with pytest.raises(ValueError, match="pending pick"):
        moe_decode(torch.randn(1, 64, device=device), w13, w2, pick.weights, pick.ids, pick=other)
    with pytest.raises(ValueError, match="pending pick"):
        moe_decode(torch.randn(2, 64, device=device), w13, w2, pick.weights.expand(2, 2),
                   pick.ids.expand(2, 2), pick=pick)
