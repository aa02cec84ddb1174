"""The one-launch router kernel (moe_router.py) vs moe_ref.route_topk_ref on fresh random logits.

Bounds: expert ids exact (random fp32 logits have no ties); weights within 1e-6 absolute (both
sides compute exp(x - max) / sum in fp32, summed in a different order). The RMSNorm prologue
(route_gate_topk(norm_weight=...), route_gate_topk_norm) against add_rms_norm_ref / rms_norm_ref
and the reference router: picks exact on inputs whose norm is exact in bf16, the normalized rows
and the summed residual within one rounding (row-relative 1e-2).
"""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels.moe_ref import route_topk_ref
from homelab_llm.engine.kernels.ref import add_rms_norm_ref, rms_norm_ref


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 128, 8), (5, 60, 4), (3, 512, 10), (2, 8, 8)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_matches_reference(tokens, experts, top_k, renormalize, dtype, device):
    from homelab_llm.engine.kernels.moe_router import route_topk

    gen = torch.Generator().manual_seed(tokens * experts + top_k)
    logits = (torch.randn(tokens, experts, generator=gen) * 3).to(dtype).to(device)
    if dtype == torch.bfloat16:  # bf16 rounding makes ties likely: distinct, exact values
        step = min(1.0, 256 / experts)  # bf16 holds these steps exactly within [-128, 128]
        rows = [torch.randperm(experts, generator=gen) for _ in range(tokens)]
        logits = ((torch.stack(rows).float() - experts / 2) * step / 8).to(dtype).to(device)
    weights, ids = route_topk(logits, top_k, renormalize)
    want_w, want_ids = route_topk_ref(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.cpu(), want_ids.cpu())
    torch.testing.assert_close(weights.cpu(), want_w.cpu(), atol=1e-6, rtol=0)


def test_router_rejects_bad_top_k(device):
    from homelab_llm.engine.kernels.moe_router import route_topk

    with pytest.raises(ValueError, match="top_k 9 of 8"):
        route_topk(torch.zeros(2, 8, device=device), 9, True)


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 128, 8), (5, 60, 4), (8, 512, 10)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_router_matches_reference(tokens, experts, top_k, renormalize, dtype, device):
    """route_gate_topk (the gate matmul fused in) vs route_topk_ref(F.linear(x, W)). The hidden
    states pick one column of W per token, whose entries are distinct values exact in bf16, so
    the logits are exact on both sides and the ids compare exactly; weights within 1e-6."""
    from homelab_llm.engine.kernels.moe_router import route_gate_topk

    hidden = 96
    gen = torch.Generator().manual_seed(tokens * experts + top_k + 1)
    step = min(1.0, 256 / experts)
    cols = [(torch.randperm(experts, generator=gen).float() - experts / 2) * step / 8
            for _ in range(hidden)]
    weight = torch.stack(cols, dim=1).to(dtype).to(device)  # [E, H]
    x = torch.zeros(tokens, hidden)
    x[torch.arange(tokens), torch.randint(0, hidden, (tokens,), generator=gen)] = 1.0
    x = x.to(dtype).to(device)
    weights, ids, _ = route_gate_topk(x, weight, top_k, renormalize)
    want_w, want_ids = route_topk_ref(torch.nn.functional.linear(x, weight), top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.cpu(), want_ids.cpu())
    torch.testing.assert_close(weights.cpu(), want_w.cpu(), atol=1e-6, rtol=0)


def test_fused_router_random_logits(device):
    """Dense random x and W (fp32): the fused logits are the linear layer's within rounding, so
    the picked sets agree (random fp32 logits have no near ties at this size)."""
    from homelab_llm.engine.kernels.moe_router import route_gate_topk

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4, 200, generator=gen).to(device)  # 200: a partial last hidden step
    weight = torch.randn(64, 200, generator=gen).to(device)
    weights, ids, _ = route_gate_topk(x, weight, 6, True)
    want_w, want_ids = route_topk_ref(torch.nn.functional.linear(x, weight), 6, True)
    assert torch.equal(ids.cpu(), want_ids.cpu())
    torch.testing.assert_close(weights.cpu(), want_w.cpu(), atol=1e-5, rtol=0)


def test_fused_router_rejects_bad_shapes(device):
    from homelab_llm.engine.kernels.moe_router import route_gate_topk

    with pytest.raises(ValueError, match="9 tokens"):
        route_gate_topk(torch.zeros(9, 16, device=device), torch.zeros(8, 16, device=device), 2, True)
    with pytest.raises(ValueError, match=r"\(8, 12\)"):
        route_gate_topk(torch.zeros(1, 16, device=device), torch.zeros(8, 12, device=device), 2, True)


@pytest.mark.parametrize("tokens,block_e", [(1, 1), (3, 4), (8, 2)])
def test_fused_router_shared_gate(tokens, block_e, device):
    """The shared expert's gate as the extra row E (in whichever program holds it): its
    sigmoid(x @ g) within 1e-6 of the reference, the routed picks unchanged by it."""
    from homelab_llm.engine.kernels.moe_router import route_gate_topk
    from homelab_llm.engine.kernels.tuning import RouterTiles

    gen = torch.Generator().manual_seed(40 + tokens)
    x = torch.randn(tokens, 48, generator=gen).to(device)
    weight = torch.randn(10, 48, generator=gen).to(device)
    gate = (torch.randn(1, 48, generator=gen) * 0.2).to(device)
    # one token runs on one_token_warps (the sm_90 table's 1), more on num_warps
    tiles = RouterTiles(block_e=block_e, block_k=32, num_warps=1 if device.type == "cpu" else 4,
                        one_token_warps=1)
    weights, ids, shared_w = route_gate_topk(x, weight, 3, True, gate, tiles=tiles)
    want_w, want_ids = route_topk_ref(torch.nn.functional.linear(x, weight), 3, True)
    want_shared = torch.sigmoid(torch.nn.functional.linear(x, gate)).reshape(-1)
    assert torch.equal(ids.cpu(), want_ids.cpu())
    torch.testing.assert_close(weights.cpu(), want_w.cpu(), atol=1e-5, rtol=0)
    assert shared_w.shape == (tokens,) and shared_w.dtype == torch.float32
    torch.testing.assert_close(shared_w.cpu(), want_shared.cpu(), atol=1e-6, rtol=0)


def test_nan_logits_still_pick_real_experts(device):
    """A NaN row (an overflowed activation) must not send the expert kernels out of range."""
    from homelab_llm.engine.kernels.moe_router import route_topk

    logits = torch.randn(2, 60).to(device)
    logits[1] = float("nan")
    _, ids = route_topk(logits, 4, True)
    assert int(ids.min()) >= 0 and int(ids.max()) < 60


def _one_hot_case(device, dtype=torch.bfloat16):
    """Hidden states c * e_h (and a residual d * e_h): RMSNorm makes them sign * sqrt(H) *
    nw[h] * e_h exactly, so with nw = 1/4 and H = 64 the router's logits are 2 * W[:, h],
    exact in bf16 on both sides, and the picks compare exactly."""
    gen = torch.Generator().manual_seed(5)
    hidden, e = 64, 16
    cols = [(torch.randperm(e, generator=gen).float() - e / 2) / 4 for _ in range(hidden)]
    gate = torch.stack(cols, dim=1).to(device, dtype)  # [E, H], distinct exact values a column
    x = torch.zeros(2, hidden)
    res = torch.zeros(2, hidden)
    x[0, 3], res[0, 3] = 3.0, -1.5       # x + r = 1.5 e_3
    x[1, 40], res[1, 40] = -0.75, -0.25  # x + r = -e_40
    nw = torch.full((hidden,), 0.25)
    return x.to(device, dtype), res.to(device, dtype), nw.to(device, dtype), gate


@pytest.mark.parametrize("residual", [True, False])
def test_router_norm_prologue(residual, device):
    from homelab_llm.engine.kernels.moe_router import route_gate_topk

    x, res, nw, gate = _one_hot_case(device)
    if not residual:
        x, res = x + res, None
    weights, ids, _ = route_gate_topk(x, gate, 4, True, norm_weight=nw, eps=0.0, residual=res)
    normed = add_rms_norm_ref(x, res, nw, 0.0)[0] if residual else rms_norm_ref(x, nw, 0.0)
    want_w, want_ids = route_topk_ref(torch.nn.functional.linear(normed, gate), 4, True)
    assert torch.equal(ids.cpu(), want_ids.cpu())
    torch.testing.assert_close(weights.cpu(), want_w.cpu(), atol=1e-6, rtol=0)
    # without the norm the logits would be 1.5 W and -W: other weights, and row 1's picks flip
    plain = x if res is None else x + res
    plain_w, _ = route_topk_ref(torch.nn.functional.linear(plain, gate), 4, True)
    assert (plain_w.cpu() - want_w.cpu()).abs().max() > 1e-2


def test_router_norm_checks_shapes(device):
    from homelab_llm.engine.kernels.moe_router import route_gate_topk

    x, res, nw, gate = _one_hot_case(device)
    with pytest.raises(ValueError, match="norm weight"):
        route_gate_topk(x, gate, 2, True, norm_weight=nw[:10])
    with pytest.raises(ValueError, match="goes with a norm"):
        route_gate_topk(x, gate, 2, True, residual=res)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float().cpu(), want.float().cpu()
    return float(((got - want).norm(dim=-1) / want.norm(dim=-1)).max())


@pytest.mark.parametrize("tokens,residual", [(1, True), (3, True), (2, False)])
def test_router_writes_the_normalized_rows(tokens, residual, device):
    """route_gate_topk_norm: the picks of route_gate_topk(norm_weight=...) and the rows
    add_rms_norm gives (each within an ulp: the sum of squares is gathered in another order)."""
    from homelab_llm.engine.kernels.moe_router import route_gate_topk, route_gate_topk_norm

    gen = torch.Generator().manual_seed(40 + tokens)
    hidden, e = 96, 16
    x = torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16)
    res = (torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16) if residual
           else None)
    nw = (torch.rand(hidden, generator=gen) + 0.5).to(device, torch.bfloat16)
    gate = (torch.randn(e, hidden, generator=gen) * 0.3).to(device, torch.bfloat16)
    weights, ids, shared_w, normed, summed = route_gate_topk_norm(x, res, nw, 1e-6, gate, 4, True)
    want_w, want_ids, _ = route_gate_topk(x, gate, 4, True, norm_weight=nw, eps=1e-6, residual=res)
    assert shared_w is None and torch.equal(ids, want_ids) and torch.equal(weights, want_w)
    want_normed, want_sum = add_rms_norm_ref(x, res, nw, 1e-6) if residual else \
        (rms_norm_ref(x, nw, 1e-6), x)
    assert normed.shape == x.shape and normed.dtype == x.dtype
    assert _rel(normed, want_normed) < 1e-2  # one rounding (truncated in the interpreter)
    assert _rel(summed, want_sum) < 1e-2
    if not residual:
        assert summed is x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_keyed_pick_equals_the_chain(dtype, renormalize, device):
    """16-bit logits take the one-max-a-pick keys (ROUNDED); the same values as fp32 take the
    max-and-argmin chain: ids equal, with many ties (five values, -0 and +0 among them: ties go
    to the lowest id on both) and a row of wider values (within exp's range of the row's max:
    below it, probabilities of 0 tie for the chain, not for the keys -- picks of weight 0 either
    way). Weights bit for bit in the interpreter, within 1e-6 relative on a GPU: the keys
    re-form each pick's exp(l - max) / total from its logit, the chain divides the row's vector,
    and the GPU's exp and division are approximate (3 ulp apart seen on an H200)."""
    from homelab_llm.engine.kernels.moe_router import route_topk

    gen = torch.Generator().manual_seed(11)
    values = torch.tensor([-1.0, -0.5, -0.0, 0.0, 0.5, 1.0])
    rows = values[torch.randint(0, 6, (4, 60), generator=gen)]
    rows[3] = torch.randn(60, generator=gen) * 8
    logits = rows.to(dtype).to(device)
    weights, ids = route_topk(logits, 8, renormalize)
    want_w, want_ids = route_topk(logits.float(), 8, renormalize)
    assert torch.equal(ids.cpu(), want_ids.cpu())
    torch.testing.assert_close(weights.cpu(), want_w.cpu(), rtol=1e-6, atol=0)
