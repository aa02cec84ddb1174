"""The next linear's weights asked into the L2 by a GEMV's tail (kernels/l2_next.py).

The request itself (`prefetch.global.L2`) is PTX and changes no value; what can go wrong is which
lines it asks for: outside the next weight's tensors (a fault on the GPU), or not the ones the
plan says (a weight half asked for). So the kernel's address arithmetic runs on the interpreter
with the request replaced by a recorder, and every address must be a line of the next weight's
words, scales or biases, each planned line asked for, nothing else; and the chain's links
follow the calls (a weight picked by data is never a target).
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels import l2_next
from homelab_llm.engine.kernels.l2_next import Chain, next_plan, parse_budget, plan_for, prefetch_next, region_lines
from homelab_llm.engine.kernels.tuning import RowsTiles, interpreting, tiles_for
from homelab_llm.engine.kernels.w4a16_pack import W4Weight


@triton.jit
def _probe(w, s, b, wc, wp, ws, wl, gc, gp, gs, gl, NEXT_LINES: tl.constexpr):
    prefetch_next(tl.program_id(0), w, s, b, wc, wp, ws, wl, gc, gp, gs, gl, NEXT_LINES)


def _weight(k: int, n: int) -> W4Weight:
    return W4Weight(torch.zeros((k // 8, n), dtype=torch.int32), torch.zeros((k // 128, n), dtype=torch.float16),
                    torch.zeros((k // 128, n), dtype=torch.float16), 128)


def _lines(t: torch.Tensor, lines: list[int]) -> set[int]:
    return {t.data_ptr() + 128 * line for line in lines}


@pytest.mark.parametrize("k,n,cap_kb,bands,programs", [(1024, 256, 1 << 20, 16, 3), (1024, 256, 40, 4, 5),
                                                       (2048, 96, 20, 16, 7), (256, 64, 1, 16, 1)])
def test_requests_are_the_planned_lines(k, n, cap_kb, bands, programs, monkeypatch) -> None:
    if not interpreting():
        pytest.skip("the recorder runs on the interpreter (a GPU's requests record nothing)")
    w = _weight(k, n)
    plan = plan_for(w, programs, cap_kb << 10, bands)
    seen: list = []
    monkeypatch.setattr(l2_next, "l2_prefetch", lambda ptrs: seen.append(ptrs.handle.data.copy()))
    a = plan.kernel_args()
    _probe[(programs,)](a["nx_w_ptr"], a["nx_s_ptr"], a["nx_b_ptr"], a["nx_w_count"], a["nx_w_per"],
                        a["nx_w_stride"], a["nx_w_last"], a["nx_g_count"], a["nx_g_per"], a["nx_g_stride"],
                        a["nx_g_last"], NEXT_LINES=plan.lines)
    got = {int(v) for arr in seen for v in arr}
    want = (_lines(w.qweight, region_lines(plan.words)) | _lines(w.scales, region_lines(plan.groups))
            | _lines(w.biases, region_lines(plan.groups)))
    assert got == want
    assert plan.lines * programs >= plan.words.count + 2 * plan.groups.count
    for r, t in ((plan.words, w.qweight), (plan.groups, w.scales)):  # every line inside its tensor
        assert 0 <= min(region_lines(r)) and 128 * max(region_lines(r)) < t.numel() * t.element_size()
    lines = -(-k // 8 * n * 4 // 128)
    if cap_kb << 10 >= k // 8 * n * 4 + 2 * (k // 128) * n * 2:
        assert sorted(region_lines(plan.words)) == list(range(lines))  # all of it
    else:  # the budget, spread over the bands: each band's first lines
        assert plan.words.count < lines
        starts = {line // plan.words.stride for line in region_lines(plan.words)}
        assert starts == set(range(-(-lines // plan.words.stride)))
        assert plan.words.count * 128 <= (cap_kb << 10) + bands * 128


def test_chain_links_follow_the_calls() -> None:
    a, b, c, experts = _weight(256, 64), _weight(256, 64), _weight(256, 32), _weight(256, 128)
    chain = Chain()
    for w in (a, b, c):
        chain.observe(w, True)
    assert chain.next_of(a) is b and chain.next_of(b) is c and chain.next_of(c) is None
    chain.observe(experts, False)  # picked by data: never a target, and c's link dropped
    chain.observe(a, True)  # the experts' call links to the next fixed one
    assert chain.next_of(c) is None and chain.next_of(experts) is a
    chain.observe(c, True)  # a new order replaces a's link
    assert chain.next_of(a) is c
    del b
    gc.collect()
    assert chain.next_of(_weight(256, 64)) is None


def test_budget_parse_and_off(monkeypatch) -> None:
    assert parse_budget("") == (0, 1) and parse_budget("0") == (0, 16)
    assert parse_budget("8") == (8 << 20, 16) and parse_budget("0.5,4") == (1 << 19, 4)
    for bad in ("x", "1,0", "-1", "1,2,3"):
        with pytest.raises(ValueError, match="MB"):
            parse_budget(bad)
    a, b = _weight(256, 64), _weight(256, 64)
    dev = torch.device("cpu")
    monkeypatch.delenv(l2_next.ENV, raising=False)
    assert next_plan(a, 4, True, dev, True) is None  # off by default
    monkeypatch.setattr(l2_next, "tiles_for", lambda device: dataclasses.replace(
        tiles_for(device), l2_next_mb=0.25, l2_next_bands=4))
    assert l2_next.budget(dev) == (1 << 18, 4)  # the arch table's where the env is unset
    monkeypatch.setenv(l2_next.ENV, "")
    assert l2_next.budget(dev) == (0, 1)  # set but empty: off
    monkeypatch.setenv(l2_next.ENV, "1")
    l2_next.CHAINS.clear()
    try:
        assert next_plan(a, 4, True, dev, False) is None  # not PTX: nothing recorded either
        assert next_plan(a, 4, True, dev, True) is None and next_plan(b, 4, True, dev, True) is None
        plan = next_plan(a, 4, True, dev, True)
        # (64 + 2 x 2 lines) / 4 programs, rounded up to a power of two
        assert plan is not None and plan.w is b and plan.lines == 32
    finally:
        l2_next.CHAINS.clear()


def _record_launches(monkeypatch) -> list:
    """Requests of w4a16_h2's launches on the interpreter: the plans as on a PTX target, each
    request recorded instead of sent."""
    from homelab_llm.engine.kernels import w4a16_h2 as h2

    seen: list = []
    monkeypatch.setattr(l2_next, "l2_prefetch", lambda ptrs: seen.append(ptrs.handle.data.copy()))
    monkeypatch.setattr(h2, "next_plan", lambda w, programs, target, device, ptx:
                        next_plan(w, programs, target, device, True))
    monkeypatch.setattr(h2, "picked_plan", lambda experts, programs, ptx, device:
                        l2_next.picked_plan(experts, programs, True, device))
    monkeypatch.setenv(l2_next.ENV, "1")
    l2_next.CHAINS.clear()
    return seen


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def test_gemv_chain_requests_the_next_weight(monkeypatch) -> None:
    """Three linears in a row, twice: the second pass's calls ask for the next one's lines
    (the last for the first's), and the outputs are those of calls without requests."""
    from homelab_llm.engine.kernels import w4a16_pack as wp
    from homelab_llm.engine.kernels.w4a16_h2 import w4a16_h2

    if not interpreting():
        pytest.skip("the recorder runs on the interpreter")
    gen = torch.Generator().manual_seed(5)
    ws = [wp.quantize_rtn(torch.randn(n, 128, generator=gen) * 0.05, 32, True) for n in (128, 128, 128)]
    x = torch.randn(1, 128, generator=gen).to(torch.bfloat16)
    t = RowsTiles(32, 4, 1, prefetch=True, whole_k=True)
    plain = [w4a16_h2(x, w, torch.empty((1, 128), dtype=torch.bfloat16), t) for w in ws]
    seen = _record_launches(monkeypatch)
    try:
        for first_pass in (True, False):
            for w, want in zip(ws, plain):
                assert torch.equal(w4a16_h2(x, w, torch.empty((1, 128), dtype=torch.bfloat16), t), want)
                if first_pass:
                    seen.clear()
        got = {int(v) for arr in seen for v in arr}
    finally:
        l2_next.CHAINS.clear()
    for w in ws:  # every weight was a next one in the second pass: all of its lines asked for
        for part in (w.qweight, w.scales, w.biases):
            lo, hi = _span(part)
            assert {a for a in got if lo <= a < hi} == set(range(lo, hi, 128))
    spans = [_span(p) for w in ws for p in (w.qweight, w.scales, w.biases)]
    assert all(any(lo <= a < hi for lo, hi in spans) for a in got)


def test_moe_gate_up_requests_its_picks_down_experts(monkeypatch) -> None:
    """gate_up's programs ask for their picks' down experts, whole (within the budget), and no
    other expert's line; the layer's output unchanged."""
    from homelab_llm.engine.kernels.fused_moe_h2 import moe_h2
    from homelab_llm.engine.kernels.moe_ref import MoeW4, route_topk_ref
    from tests.engine.kernels.moe_inputs import random_moe_w4

    if not interpreting():
        pytest.skip("the recorder runs on the interpreter")
    gen = torch.Generator().manual_seed(6)
    e, h, i, top_k = 8, 128, 128, 3
    w = MoeW4(random_moe_w4(gen, e, h, 2 * i, 32, "cpu"), random_moe_w4(gen, e, i, h, 32, "cpu"))
    x = (torch.randn(1, h, generator=gen) * 0.5).to(torch.bfloat16)
    weights, ids = route_topk_ref(torch.randn(1, e, generator=gen), top_k, True)
    ids = ids.to(torch.int32)
    tiles = (RowsTiles(32, 4, 1, prefetch=True, whole_k=True),) * 2
    want = moe_h2(x, w, weights, ids, tiles)
    seen = _record_launches(monkeypatch)
    try:
        assert torch.equal(moe_h2(x, w, weights, ids, tiles), want)
    finally:
        l2_next.CHAINS.clear()
    got = {int(v) for arr in seen for v in arr}
    picked = set(ids.flatten().tolist())
    for expert in range(e):
        for part in (w.w2.qweight[expert], w.w2.scales[expert], w.w2.biases[expert]):
            lo, hi = _span(part)
            asked = {a for a in got if lo <= a < hi}
            assert asked == (set(range(lo, hi, 128)) if expert in picked else set()), expert
    spans = [_span(p[k]) for k in picked for p in (w.w2.qweight, w.w2.scales, w.w2.biases)]
    assert all(any(lo <= a < hi for lo, hi in spans) for a in got)
