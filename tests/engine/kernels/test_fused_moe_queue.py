"""The MoE block in one launch (fused_moe_queue.moe_queue) against its three-launch form
(moe_router.route_gate_topk_norm, then fused_moe_h2.moe_h2 on the rows it normalized) and the
fp32 reference, on fresh random inputs, 1 and 3 tokens, with and without a residual.

Bounds: the queue runs the same programs on the same inputs as the three launches, so the picks,
the normalized and summed rows and the output are bitwise equal to theirs; against the fp32
reference (moe_ref.moe_experts_ref on the normalized rows, the same picks) 2e-2 relative
Frobenius error, test_fused_moe_h2's bound (a wrong pick, column or weight is O(1)). Every
counter is back at zero after a call (CUDA/HIP graphs replay it), and a second call is bitwise
equal to the first.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from homelab_llm.engine.kernels.moe_ref import MoeW4, moe_experts_ref
from homelab_llm.engine.kernels.tuning import QueueTiles, RowsTiles, tiles_for
from tests.engine.kernels.moe_inputs import random_moe_w4, rel_err

BOUND = 2e-2


def _inputs(gen, full_shapes, device, tokens, residual):
    e, h, i, top_k, g = (128, 2048, 768, 8, 128) if full_shapes else (8, 128, 128, 4, 32)
    w = MoeW4(random_moe_w4(gen, e, h, 2 * i, g, device), random_moe_w4(gen, e, i, h, g, device))
    x = torch.randn(tokens, h, generator=gen).to(torch.bfloat16).to(device)
    res = torch.randn(tokens, h, generator=gen).to(torch.bfloat16).to(device) if residual else None
    nw = (torch.rand(h, generator=gen) + 0.5).to(torch.bfloat16).to(device)
    gate = (torch.randn(e, h, generator=gen) * h ** -0.5).to(torch.bfloat16).to(device)
    return w, x, res, nw, gate, top_k


def _tiles(device) -> QueueTiles:
    tiles = tiles_for(device).moe_queue
    if tiles is None:
        pytest.skip(f"no moe_queue entry on {device}")
    return tiles


@pytest.mark.parametrize("tokens,residual,pause", [(1, True, 0), (3, True, 0), (1, False, 0),
                                                  (1, True, 500)])
def test_queue_matches_three_launches(tokens, residual, pause, device, full_shapes):
    """pause: ns a waiting item sleeps between polls (on a GPU; the interpreter never waits)."""
    from homelab_llm.engine.kernels.fused_moe_h2 import moe_h2
    from homelab_llm.engine.kernels.fused_moe_queue import moe_queue, router_tiles
    from homelab_llm.engine.kernels.moe_router import route_gate_topk_norm
    from homelab_llm.engine.kernels.work_queue import MAX_COUNTERS, counters

    gen = torch.Generator().manual_seed(1210 + tokens + 7 * residual + pause)
    w, x, res, nw, gate, top_k = _inputs(gen, full_shapes, device, tokens, residual)
    tiles = dataclasses.replace(_tiles(device), poll_pause_ns=pause)
    got = moe_queue(x, res, nw, 1e-6, gate, top_k, True, w, tiles)
    weights, ids, _, normed, summed = route_gate_topk_norm(
        x, res, nw, 1e-6, gate, top_k, True,
        tiles=router_tiles(tiles, tokens))
    assert torch.equal(got.ids, ids) and torch.equal(got.weights, weights)
    assert torch.equal(got.summed, summed)
    want = moe_h2(normed, w, weights, ids, (tiles.up, tiles.down))
    assert torch.equal(got.out, want)
    ref = moe_experts_ref(normed.float(), w, None, weights, ids.long())
    assert rel_err(got.out, ref) < BOUND, rel_err(got.out, ref)
    assert not counters(device, MAX_COUNTERS).any()  # every counter reset by the last program out
    again = moe_queue(x, res, nw, 1e-6, gate, top_k, True, w, tiles)
    assert torch.equal(again.out, got.out) and torch.equal(again.ids, got.ids)


def test_bad_calls_are_refused(device):
    from homelab_llm.engine.kernels.fused_moe_queue import moe_queue

    gen = torch.Generator().manual_seed(1290)
    w, x, res, nw, gate, top_k = _inputs(gen, False, device, 1, True)
    tiles = _tiles(device)
    with pytest.raises(ValueError, match="moe_queue"):
        moe_queue(x, res[:, :64], nw, 1e-6, gate, top_k, True, w, tiles)
    with pytest.raises(ValueError, match="router"):
        moe_queue(x, res, nw, 1e-6, gate[:, :64], top_k, True, w, tiles)
    two = QueueTiles(tiles.up, RowsTiles(64, 4, 2 * tiles.up.num_warps, prefetch=True, whole_k=True),
                     tiles.router_block_e, tiles.router_block_k)
    with pytest.raises(ValueError, match="same"):
        moe_queue(x, res, nw, 1e-6, gate, top_k, True, w, two)


def test_layer_takes_one_launch_with_the_switch(monkeypatch):
    """A 4-bit Qwen3-MoE block at batch 1 through model/llama.mlp_after_norm: with
    HOMELAB_LLM_MOE_QUEUE=1 one launch gives what the three (router, gate_up, down) give, bit
    for bit; =0 (the interpreter's table default too) keeps the three."""
    import os
    from collections import Counter

    from homelab_llm.engine.kernels import dispatch
    from homelab_llm.engine.kernels.fused_moe_queue import ENV
    from homelab_llm.engine.layers.moe import SparseMoeBlock
    from homelab_llm.engine.layers.norm import RMSNorm
    from homelab_llm.engine.model.llama import mlp_after_norm
    from tests.engine.kernels.launch_count import count_calls

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("counts launches through the Triton interpreter (CPU only)")
    gen = torch.Generator().manual_seed(1300)
    cpu = torch.device("cpu")
    w, x, res, nw, gate, top_k = _inputs(gen, False, cpu, 1, True)
    block = SparseMoeBlock(128, 8, top_k, 128, True).to(torch.bfloat16)
    block.experts.set_w4(w)
    norm = RMSNorm(128, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        block.gate.weight.copy_(gate)
        norm.weight.copy_(nw)
    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    runs = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(ENV, switch)
        mlp_after_norm(x, res, norm, block)  # first-use buffers outside the count
        runs[switch] = count_calls(monkeypatch, lambda: mlp_after_norm(x, res, norm, block))
    (three, (want, want_res)), (one, (got, got_res)) = runs["0"], runs["1"]
    assert torch.equal(got, want) and torch.equal(got_res, want_res)
    assert one == Counter({"triton._moe_queue_kernel": 1}), one
    assert sum(three.values()) == 3 and three["triton.route_gate_kernel"] == 1, three


def test_switches_pick_the_tiles(monkeypatch):
    """ENV=0 / 1 / unset against the interpreter's entry (not on by default), TILES_ENV's
    changes, a K no entry fits, and a bad switch value."""
    from homelab_llm.engine.kernels.fused_moe_queue import ENV, TILES_ENV, queue_tiles

    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(1310)
    w = _inputs(gen, False, cpu, 1, True)[0]
    table = _tiles(cpu)
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(TILES_ENV, raising=False)
    assert queue_tiles(cpu, w) is (table if table.default else None)
    monkeypatch.setenv(ENV, "1")
    assert queue_tiles(cpu, w) == table
    monkeypatch.setenv(TILES_ENV, "poll_pause_ns=700,router_block_e=2")
    assert queue_tiles(cpu, w) == dataclasses.replace(table, poll_pause_ns=700, router_block_e=2)
    narrow = _inputs(torch.Generator().manual_seed(1311), False, cpu, 1, True)[0]
    narrow = MoeW4(narrow.w13, random_moe_w4(gen, 8, 64, 128, 32, cpu))  # down's K 64: no fit
    assert queue_tiles(cpu, narrow) is None
    monkeypatch.setenv(ENV, "0")
    assert queue_tiles(cpu, w) is None
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ValueError, match=ENV):
        queue_tiles(cpu, w)
