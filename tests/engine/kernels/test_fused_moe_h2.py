"""Decode-size 4-bit MoE experts on the packed-half GEMV (fused_moe_h2.py, w4a16_h2 with Picks)
vs moe_ref.moe_experts_ref on fresh random inputs, 1-8 tokens.

Error bound: 2e-2 relative Frobenius error against the fp32 reference of the same bf16 inputs,
as test_fused_moe_decode's at bf16 (the packed-half products round at 2^-11, and gate_up and the
output are rounded to bf16, as the dense MLP's GEMV pair does; the interpreter rounds to bf16 by
truncation, a bias toward zero: observed 1.2e-2 there, each GEMV alone 7e-4 / 3e-3 against
references fed its own inputs. A wrong expert, pick, column or router weight is O(1)).
Repeated calls are bitwise equal: a token's picks are summed in pick order (graph == eager),
and a token's row is the same alone and inside a batch.
"""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels.moe_ref import MoeW4, add_shared_ref, moe_experts_ref, route_topk_ref
from homelab_llm.engine.kernels.tuning import RowsTiles
from tests.engine.kernels.moe_inputs import random_moe_w4, rel_err

BOUND = 2e-2


def _layer(gen, full_shapes, device, inter=None, tokens=1):
    e, h, i, top_k, g = (128, 2048, 768, 8, 128) if full_shapes else (8, 128, inter or 128, 4, 32)
    w = MoeW4(random_moe_w4(gen, e, h, 2 * i, g, device), random_moe_w4(gen, e, i, h, g, device))
    x = (torch.randn(tokens, h, generator=gen) * 0.5).to(torch.bfloat16).to(device)
    weights, ids = route_topk_ref(torch.randn(tokens, e, generator=gen).to(device), top_k, True)
    return w, x, weights, ids.to(torch.int32)


def _want(x, w, weights, ids):
    return moe_experts_ref(x.float(), w, None, weights, ids)


@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_decode_tokens_match_reference(tokens, device, full_shapes):
    """1-8 tokens (8 on the GPU only: the interpreter's time)."""
    from homelab_llm.engine.kernels.fused_moe import fused_moe
    from homelab_llm.engine.kernels.fused_moe_h2 import moe_h2, moe_h2_route
    from homelab_llm.engine.kernels.tuning import moe_h2_tiles

    if tokens == 8 and not full_shapes:
        pytest.skip("8 tokens at full shapes on the GPU")
    gen = torch.Generator().manual_seed(910 + tokens)
    w, x, weights, ids = _layer(gen, full_shapes, device, tokens=tokens)
    tiles = moe_h2_route(x[:1], w)
    if tiles is None:
        pytest.skip(f"no moe_h2 entry on {device}")
    got = moe_h2(x, w, weights, ids, tiles)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert rel_err(got, _want(x, w, weights, ids)) < BOUND, rel_err(got, _want(x, w, weights, ids))
    assert torch.equal(moe_h2(x, w, weights, ids, tiles), got)  # deterministic
    assert torch.equal(moe_h2(x[-1:], w, weights[-1:], ids[-1:], tiles), got[-1:])  # batch-free
    # fused_moe's decode route (int64 ids as route_topk_ref gives them) where the table sends
    # this many tokens
    if moe_h2_route(x, w) is not None:
        assert torch.equal(fused_moe(x, w, None, weights, ids.long()), got)
    assert moe_h2_tiles(device, 1 << 20, 128) is None  # no entry takes an input that long


def test_gated_shared_expert_joins_the_sum(device, full_shapes):
    """Qwen3.5-MoE / Qwen3-Next: the shared expert's gated row added in down's sum, through
    fused_moe's route too; a zero gate leaves the experts' sum as it was, bit for bit."""
    from homelab_llm.engine.kernels.fused_moe import fused_moe
    from homelab_llm.engine.kernels.fused_moe_h2 import moe_h2, moe_h2_route

    gen = torch.Generator().manual_seed(940)
    w, x, weights, ids = _layer(gen, full_shapes, device, tokens=2)
    tiles = moe_h2_route(x[:1], w)
    if tiles is None:
        pytest.skip(f"no moe_h2 entry on {device}")
    shared_out = (torch.randn(x.shape, generator=gen) * 2).to(x.dtype).to(device)
    gate = torch.tensor([0.7, 0.2], device=device)
    want = add_shared_ref(_want(x, w, weights, ids), shared_out.float(), gate)
    got = moe_h2(x, w, weights, ids, tiles, shared=(shared_out, gate))
    assert rel_err(got, want) < BOUND, rel_err(got, want)
    one = (shared_out[:1], gate[:1])
    assert torch.equal(fused_moe(x[:1], w, None, weights[:1], ids[:1], shared=one), got[:1])
    zero = moe_h2(x, w, weights, ids, tiles, shared=(shared_out, torch.zeros(2, device=device)))
    assert torch.equal(zero, moe_h2(x, w, weights, ids, tiles))


@pytest.mark.parametrize("inter", [128, 256])
@pytest.mark.parametrize("tiles", [RowsTiles(32, 4, 1, prefetch=True, whole_k=True),
                                   RowsTiles(64, 4, 2, prefetch=True, whole_k=True),
                                   RowsTiles(64, 4, 1, prefetch=True, whole_k=True)])
def test_tile_variants_match_reference(inter, tiles, device, full_shapes):
    """Two to four lane groups of one to four steps each, 1-2 warps, and an expert intermediate
    width of one or two lane trips: each GEMV must sum its picks' rows whole."""
    from homelab_llm.engine.kernels.fused_moe_h2 import moe_h2
    from homelab_llm.engine.kernels.tuning import whole_k_fits

    if full_shapes:
        pytest.skip("tile variants at the interpreter's shapes")
    gen = torch.Generator().manual_seed(920 + inter)
    w, x, weights, ids = _layer(gen, False, device, inter)
    assert whole_k_fits(tiles, 128, 32) and whole_k_fits(tiles, inter, 32)
    got = moe_h2(x, w, weights, ids, (tiles, tiles))
    assert rel_err(got, _want(x, w, weights, ids)) < BOUND, rel_err(got, _want(x, w, weights, ids))


def test_picks_form_refuses_bad_calls(device):
    from homelab_llm.engine.kernels.w4a16_h2 import Picks, w4a16_h2

    gen = torch.Generator().manual_seed(930)
    w, x, weights, ids = _layer(gen, False, device)
    tiles = RowsTiles(32, 4, 1, prefetch=True, whole_k=True)
    out = torch.empty((ids.numel(), 256), dtype=x.dtype, device=device)  # [P, 2I]
    with pytest.raises(ValueError, match="picks"):  # int64 ids
        w4a16_h2(x, w.w13, out, tiles, picks=Picks(ids.long(), token_x=True))
    with pytest.raises(ValueError, match="picks"):  # 1-D ids
        w4a16_h2(x, w.w13, out, tiles, picks=Picks(ids.reshape(-1), token_x=True))
    with pytest.raises(ValueError, match="picks"):  # split-K tiles
        w4a16_h2(x, w.w13, out, RowsTiles(32, 4, 1), picks=Picks(ids, token_x=True))
    with pytest.raises(ValueError, match="picks"):  # a summed call's output is a row a token
        w4a16_h2(x, w.w13, out, tiles, picks=Picks(ids, weights, token_x=True))
    with pytest.raises(ValueError, match="picks"):  # x: a row a pick without token_x
        w4a16_h2(x, w.w13, out, tiles, picks=Picks(ids))
    with pytest.raises(ValueError, match="picks"):  # 2-D weights
        w4a16_h2(x, w.expert("w13", 0), out, tiles, picks=Picks(ids, token_x=True))
    with pytest.raises(ValueError, match="picks"):  # an added row needs a summed call
        w4a16_h2(x, w.w13, out, tiles, picks=Picks(ids, token_x=True,
                                                   add=(out[:1], torch.ones(1, device=device))))
    with pytest.raises(ValueError, match="picks"):  # the norm prologue
        w4a16_h2(x, w.w13, out, tiles, norm_weight=x[0], eps=1e-6, picks=Picks(ids, token_x=True))
    with pytest.raises(ValueError, match="picks"):  # a residual (it would be ignored)
        w4a16_h2(x, w.w13, out, tiles, residual=x, summed=torch.empty_like(x),
                 picks=Picks(ids, token_x=True))


def test_route_follows_the_table_and_its_override(device, full_shapes, monkeypatch):
    from homelab_llm.engine.kernels.fused_moe_h2 import TOKENS_ENV, moe_h2_route
    from homelab_llm.engine.kernels.tuning import tiles_for

    gen = torch.Generator().manual_seed(950)
    w, x, _, _ = _layer(gen, full_shapes, device, tokens=3)
    if not tiles_for(device).moe_h2:
        pytest.skip(f"no moe_h2 entry on {device}")
    table = tiles_for(device).moe_h2_tokens
    assert (moe_h2_route(x, w) is not None) == (3 <= table)
    assert moe_h2_route(x.float(), w) is None  # fp32 activations keep the old kernels
    monkeypatch.setenv(TOKENS_ENV, "2")
    assert moe_h2_route(x[:2], w) is not None and moe_h2_route(x, w) is None
    monkeypatch.setenv(TOKENS_ENV, "0")
    assert moe_h2_route(x[:1], w) is None
    monkeypatch.setenv(TOKENS_ENV, "eight")
    with pytest.raises(ValueError, match=TOKENS_ENV):
        moe_h2_route(x[:1], w)
