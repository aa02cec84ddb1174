"""The batch-1 MoE layer as decode GEMVs (kernels/moe_gemv.py: dense_gemv's expert modes and the
router's norm prologue) against the references: add_rms_norm_ref, route_topk_ref(F.linear) and
moe_ref.moe_experts_ref, on fresh random inputs (seeded), through the interpreter on the CPU.

Bounds are row-relative. The references round the normalized input, each gate/up product and
each pick's down product to bf16/fp16 (2^-8 relative each; the interpreter's casts truncate:
2^-7), the kernels keep them in fp32: a few such roundings compound to ~1e-2; a wrong expert,
weight, norm or residual is of order 1.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from homelab_llm.engine.kernels.moe_ref import moe_experts_ref, route_topk_ref
from homelab_llm.engine.kernels.ref import add_rms_norm_ref, rms_norm_ref


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float().cpu(), want.float().cpu()
    return float(((got - want).norm(dim=-1) / want.norm(dim=-1)).max())


def _experts(gen, e, hidden, inter, dtype, device):
    w13 = torch.randn(e, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(e, hidden, inter, generator=gen) * inter ** -0.5
    return w13.to(device, dtype), w2.to(device, dtype)


def _picks(gen, tokens, e, top_k, device):
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return weights.to(device), ids.to(torch.int32).to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm,residual", [(False, False), (True, False), (True, True)])
def test_expert_gemv_gated_matches_reference(dtype, norm, residual, device) -> None:
    from homelab_llm.engine.kernels.dense_gemv import expert_gemv

    gen = torch.Generator().manual_seed(7 + 2 * norm + residual)
    tokens, e, top_k, hidden, inter = 2, 6, 3, 64, 48
    w13, _ = _experts(gen, e, hidden, inter, dtype, device)
    _, ids = _picks(gen, tokens, e, top_k, device)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    res = torch.randn(tokens, hidden, generator=gen).to(device, dtype) if residual else None
    nw = (torch.rand(hidden, generator=gen) + 0.5).to(device, dtype) if norm else None
    act, summed = expert_gemv(x, w13, ids, norm_weight=nw, eps=1e-6, residual=res, gated=True)
    xin, want_sum = x, None
    if residual:
        xin, want_sum = add_rms_norm_ref(x, res, nw, 1e-6)
    elif norm:
        xin = rms_norm_ref(x, nw, 1e-6)
    want = []
    for t in range(tokens):
        for j in range(top_k):
            gu = F.linear(xin[t:t + 1].float(), w13[ids[t, j]].float())
            want.append(F.silu(gu[:, :inter]) * gu[:, inter:])
    assert act.shape == (tokens * top_k, inter) and act.dtype == dtype
    assert _rel(act, torch.cat(want)) < 2e-2
    if residual:
        assert _rel(summed, want_sum) < 1e-2  # one rounding of x + r (truncated: 2^-7)
    else:
        assert summed is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter", [48, 40])  # 40: the table's K step halves to divide it
def test_expert_sum_gemv_is_the_weighted_sum(dtype, inter, device) -> None:
    from homelab_llm.engine.kernels.dense_gemv import expert_sum_gemv

    gen = torch.Generator().manual_seed(inter)
    tokens, e, top_k, hidden = 3, 5, 2, 64
    _, w2 = _experts(gen, e, hidden, inter, dtype, device)
    weights, ids = _picks(gen, tokens, e, top_k, device)
    act = torch.randn(tokens, top_k * inter, generator=gen).to(device, dtype)
    out = expert_sum_gemv(act, w2, ids, weights)
    want = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for j in range(top_k):
            seg = act[t, j * inter:(j + 1) * inter].float().cpu()
            want[t] += weights[t, j].cpu() * (w2[ids[t, j]].float().cpu() @ seg)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    assert _rel(out, want) < 1e-2  # one rounding of the sum to dtype


@pytest.mark.parametrize("tokens", [1, 2])
def test_moe_gemv_matches_fused_reference(tokens, device, full_shapes) -> None:
    """On a GPU at the Qwen3-30B-A3B layer's shape (the table's tiles, K steps within a pick)."""
    from homelab_llm.engine.kernels.moe_gemv import moe_gemv

    gen = torch.Generator().manual_seed(11 + tokens)
    e, top_k, hidden, inter = (128, 8, 2048, 768) if full_shapes else (8, 4, 64, 32)
    w13, w2 = _experts(gen, e, hidden, inter, torch.bfloat16, device)
    weights, ids = _picks(gen, tokens, e, top_k, device)
    x = torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16)
    out, summed = moe_gemv(x, w13, w2, weights, ids)
    assert summed is None
    assert _rel(out, moe_experts_ref(x, w13, w2, weights, ids)) < 3e-2


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
def test_router_norm_prologue(residual, device) -> None:
    from homelab_llm.engine.kernels.moe_router import route_gate_topk

    x, res, nw, gate = _one_hot_case(device)
    if not residual:
        x, res = x + res, None
    weights, ids, _ = route_gate_topk(x, gate, 4, True, norm_weight=nw, eps=0.0, residual=res)
    normed = add_rms_norm_ref(x, res, nw, 0.0)[0] if residual else rms_norm_ref(x, nw, 0.0)
    want_w, want_ids = route_topk_ref(F.linear(normed, gate), 4, True)
    assert torch.equal(ids.cpu(), want_ids.cpu())
    torch.testing.assert_close(weights.cpu(), want_w.cpu(), atol=1e-6, rtol=0)
    # without the norm the logits would be 1.5 W and -W: other weights, and row 1's picks flip
    plain_w, _ = route_topk_ref(F.linear((x if res is None else x + res), gate), 4, True)
    assert (plain_w.cpu() - want_w.cpu()).abs().max() > 1e-2


def test_router_norm_checks_shapes(device) -> None:
    from homelab_llm.engine.kernels.moe_router import route_gate_topk

    x, res, nw, gate = _one_hot_case(device)
    with pytest.raises(ValueError, match="norm weight"):
        route_gate_topk(x, gate, 2, True, norm_weight=nw[:10])
    with pytest.raises(ValueError, match="goes with a norm"):
        route_gate_topk(x, gate, 2, True, residual=res)


def test_moe_layer_gemv_matches_unfused_ops(device) -> None:
    """The whole MLP from the attention's output: norm, router, experts, new residual."""
    from homelab_llm.engine.kernels.moe_gemv import moe_layer_gemv

    gen = torch.Generator().manual_seed(23)
    e, top_k, hidden, inter = 8, 2, 64, 32
    w13, w2 = _experts(gen, e, hidden, inter, torch.bfloat16, device)
    # a router whose top-2 are far apart from the rest for this input: picks compare exactly
    x = torch.randn(1, hidden, generator=gen).to(device, torch.bfloat16)
    res = torch.randn(1, hidden, generator=gen).to(device, torch.bfloat16)
    nw = (torch.rand(hidden, generator=gen) + 0.5).to(device, torch.bfloat16)
    normed, want_sum = add_rms_norm_ref(x, res, nw, 1e-6)
    direction = normed.float() / normed.float().norm()
    gate = torch.randn(e, hidden, generator=gen).to(device) * 0.01
    gate[2] += 4 * direction[0]
    gate[5] += 3 * direction[0]
    gate = gate.to(torch.bfloat16)
    want_w, want_ids = route_topk_ref(F.linear(normed, gate), top_k, True)
    out, summed = moe_layer_gemv(x, res, nw, 1e-6, gate, top_k, True, w13, w2)
    assert sorted(want_ids[0].tolist()) == [2, 5]
    assert _rel(summed, want_sum) < 1e-2
    assert _rel(out, moe_experts_ref(normed, w13, w2, want_w, want_ids)) < 3e-2


def test_expert_gemv_rejects_bad_shapes(device) -> None:
    from homelab_llm.engine.kernels.dense_gemv import expert_gemv, expert_sum_gemv

    x = torch.zeros(1, 64, dtype=torch.bfloat16, device=device)
    w = torch.zeros(4, 32, 64, dtype=torch.bfloat16, device=device)
    ids = torch.zeros(1, 2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="want int32"):
        expert_gemv(x, w, ids.long())
    with pytest.raises(ValueError, match="expected top_k x K = 128"):
        expert_sum_gemv(x, w, ids, torch.ones(1, 2, device=device))


@pytest.mark.parametrize("tokens,residual", [(1, True), (3, True), (2, False)])
def test_router_writes_the_normalized_rows(tokens, residual, device) -> None:
    """route_gate_topk_norm: the picks of route_gate_topk(norm_weight=...) and the rows
    add_rms_norm gives (each within an ulp: the sum of squares is gathered in another order)."""
    from homelab_llm.engine.kernels.moe_router import route_gate_topk, route_gate_topk_norm

    gen = torch.Generator().manual_seed(40 + tokens)
    hidden, e = 96, 16
    x = torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16)
    res = torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16) if residual else None
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
