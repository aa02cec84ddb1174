"""The packed-half W4A16 GEMV with programs over all of K (RowsTiles.whole_k, w4a16_h2.lanes_loop).

Such a program's threads split K into lane_groups() ranges and sum them once, in shared memory,
instead of K ranges in separate programs summed by the split-K epilogue. Each K step's products
are the same (the same words, pairs and scales); the sums differ in order: the fp32 sum over
the steps, and on GPUs the fp16x2 sum over a step's word rows (a reduction over another axis
of the tile), whose roundings are most of the packed-half GEMV's own error (2.5e-3 of the
fp64 reference on the H200 at the 8B's shapes, 2.9e-3 between the two forms). So:
  - output rows within 1e-2 relative of the split-K form's (the interpreter's fp32 twin agrees
    to ~1e-6; a lane range dropped, summed twice or given another range's scales is off by
    > 5e-2: 1/16 of K or more), and within the GEMV's own 1e-2 of the fp64 reference;
  - the prologue's stores (the summed residual, the normalized rows) bit-equal to the split-K
    form's: the same loads and arithmetic, stored once by column block 0.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from homelab_llm.engine.kernels import elementwise, tuning
from homelab_llm.engine.kernels import w4a16_pack as wp
from homelab_llm.engine.kernels.ref import dequantize_w4_ref
from homelab_llm.engine.kernels.tuning import RowsTiles, whole_k_fits
from homelab_llm.engine.kernels.w4a16_h2 import w4a16_h2

VS_SPLIT, VS_FP64 = 1e-2, 1e-2


def _row_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float(((got - want).norm(dim=1) / want.norm(dim=1)).max())


def _tiles(full: bool) -> tuple[RowsTiles, RowsTiles]:
    """(whole-K, split-K) tiles of one column width: on a GPU sm_90's thin entry (16 lane groups
    of 16 threads), on the interpreter 4 lane groups of 8 threads."""
    if full:
        return (RowsTiles(64, 8, 8, prefetch=True, whole_k=True),
                RowsTiles(64, 8, 8, waves=4, min_steps=4, prefetch=True))
    return (RowsTiles(32, 4, 1, prefetch=True, whole_k=True),
            RowsTiles(32, 4, 1, waves=2, min_steps=1, prefetch=True))


@pytest.mark.parametrize("m,loads_first,steps", [(1, True, 4), (1, True, 2), (1, True, 3), (1, False, 4),
                                                 (1, False, 3), (2, True, 4), (5, True, 2)])
@pytest.mark.parametrize("form", ["plain", "norm", "norm_residual", "silu"])
def test_whole_k_matches_split_k(m: int, loads_first: bool, steps: int, form: str,
                                 device: torch.device, full_shapes: bool, monkeypatch) -> None:
    """loads_first False: the prologue's chunk loop (prep_x_pairs, one chunk of all K) instead
    of its loads-first form, as a launch under PDL's early launch takes it. steps: K steps a
    lane group (2: both steps' words requested before the prologue, w4a16_h2.two_steps; 3: K
    not a power of two, its prologue's trip masked past K)."""
    from homelab_llm.engine.kernels import w4a16_h2 as h2

    if not loads_first:
        monkeypatch.setattr(h2, "loads_first", lambda *a, **kw: False)
    whole, split_k = _tiles(full_shapes)
    # N: two column blocks and a masked third (N not a multiple of block_n)
    k, n = (1024 * steps, 6144 + 16) if full_shapes else (128 * steps, 80)
    assert h2.two_steps(whole, k, 8 * whole.wrows) == (steps == 2)
    gen = torch.Generator().manual_seed(m * 17 + len(form))
    w = wp.quantize_rtn(torch.randn(n, k, generator=gen) * 0.05, 128, True).to(device)
    x = (torch.randn(m, 2 * k if form == "silu" else k, generator=gen) * 3).to(device, torch.bfloat16)
    res = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
    nw = (1 + 0.3 * torch.randn(k, generator=gen)).to(device, torch.bfloat16)
    assert whole_k_fits(whole, k, 128) and not split_k.whole_k
    outs = []
    for tiles in (whole, split_k):
        kw = {}
        if form.startswith("norm"):
            kw = dict(norm_weight=nw, eps=1e-6,
                      normed=torch.full((m, k), float("nan"), dtype=x.dtype, device=device))
            if form == "norm_residual":
                kw.update(residual=res, summed=torch.full_like(kw["normed"], float("nan")))
        elif form == "silu":
            kw = dict(act_in="silu")
        got = w4a16_h2(x, w, torch.empty((m, n), dtype=torch.bfloat16, device=device), tiles, **kw)
        outs.append([got] + [kw[key] for key in ("normed", "summed") if key in kw])
    rel = _row_rel(outs[0][0], outs[1][0])
    assert rel < VS_SPLIT, f"whole-K vs split-K {rel:.2e}"
    for a, b in zip(outs[0][1:], outs[1][1:]):
        assert torch.equal(a, b), f"prologue stores differ: {float((a.float() - b.float()).abs().max()):.2e}"
    if form == "silu":
        want = elementwise.silu_and_mul(x)
    elif form == "norm_residual":
        want = outs[1][1]  # the split-K form's normalized rows (checked against the norm kernel
        # in test_w4a16_prologue.py)
    elif form == "norm":
        want = outs[1][1]
    else:
        want = x
    assert _row_rel(outs[0][0], want.double() @ dequantize_w4_ref(w).double()) < VS_FP64


def test_whole_k_fits_and_refuses(device: torch.device) -> None:
    """whole_k_fits: equal whole-step lane ranges (any count of steps) and K, rounded up to a
    power of two, within WHOLE_K_THREAD_VALUES a thread, prefetching tiles; a call given whole-K
    tiles that do not fit is refused."""
    t = RowsTiles(32, 4, 1, prefetch=True, whole_k=True)  # 4 lane groups, 32-value steps
    assert t.lane_groups() == 4
    assert whole_k_fits(t, 128, 128) and whole_k_fits(t, 1024, 128)
    assert whole_k_fits(t, 384, 128)  # 3 steps a lane group
    assert not whole_k_fits(t, 64, 128)  # 2 steps for 4 lane groups
    assert not whole_k_fits(t, 160, 128)  # 5 steps for 4 lane groups
    assert not whole_k_fits(t, 1152, 128)  # 2,048 rounded: past 32 a thread at 1 warp
    assert whole_k_fits(RowsTiles(32, 4, 16, prefetch=True, whole_k=True), 14336, 128)
    assert not whole_k_fits(RowsTiles(64, 8, 8, prefetch=True, whole_k=True), 14336, 128)
    assert not whole_k_fits(dataclasses.replace(t, prefetch=False), 256, 128)
    assert not whole_k_fits(dataclasses.replace(t, whole_k=False), 256, 128)
    assert whole_k_fits(t, 64, 16)  # group 16: 16-value steps, 4 of them
    w = wp.quantize_rtn(torch.randn(32, 160) * 0.05, 32, True).to(device)
    x = torch.randn(1, 160).to(device, torch.bfloat16)
    with pytest.raises(ValueError, match="whole-K"):
        w4a16_h2(x, w, torch.empty((1, 32), dtype=torch.bfloat16, device=device), t)


def test_every_table_entry_matches_split_k(device: torch.device, full_shapes: bool) -> None:
    """Each whole-K entry of the device's table (GPU) or the interpreter's stand-in, at its
    largest K and N with a masked column block, against the split-K form (plain and SiLU)."""
    arch = tuning.tiles_for(device)
    entries = arch.w4a16_h2_whole_k if full_shapes else ((1, 96, 256, _tiles(False)[0]),)
    if not entries:
        pytest.skip(f"{arch.name} has no whole-K entries")
    _, split_k = _tiles(full_shapes)
    gen = torch.Generator().manual_seed(5)
    for _, max_n, max_k, whole in entries:
        n = min(max_n, 8192) - 16
        assert whole_k_fits(whole, max_k, 128), whole
        w = wp.quantize_rtn(torch.randn(n, max_k, generator=gen) * 0.05, 128, True).to(device)
        for act in (None, "silu"):
            x = torch.randn(1, 2 * max_k if act else max_k, generator=gen).to(device, torch.bfloat16)
            got, want = (w4a16_h2(x, w, torch.empty((1, n), dtype=torch.bfloat16, device=device),
                                  t, act_in=act) for t in (whole, split_k))
            rel = _row_rel(got, want)
            assert rel < VS_SPLIT, f"{whole} act {act}: whole-K vs split-K {rel:.2e}"


def test_calls_take_the_whole_k_entry_where_it_fits(device: torch.device, monkeypatch) -> None:
    """h2_tiles gives a call the arch's first w4a16_h2_whole_k entry covering its rows and
    columns that fits its K (before the thin, fused and plain entries), and the others
    otherwise; a launch through it matches the split-K form."""
    whole, _ = _tiles(False)
    arch = tuning.tiles_for(device)
    monkeypatch.setitem(tuning.TABLE, arch.name,
                        dataclasses.replace(arch, w4a16_h2_whole_k=((1, 96, 512, whole),)))
    assert tuning.h2_tiles(1, device, 96, k=256) is whole
    assert tuning.h2_tiles(1, device, 96, fused=True, k=256) is whole
    assert tuning.h2_tiles(1, device, 97, k=256) is not whole  # wider than the entry
    assert tuning.h2_tiles(2, device, 96, k=256) is not whole  # more rows
    assert tuning.h2_tiles(1, device, 96, k=160) is not whole  # K does not fit
    assert tuning.h2_tiles(1, device, 96, k=1024) is not whole  # past the entry's max_k
    assert tuning.h2_tiles(1, device, 96) is not whole  # K not given
    gen = torch.Generator().manual_seed(5)
    w = wp.quantize_rtn(torch.randn(96, 256, generator=gen) * 0.05, 128, True).to(device)
    x = torch.randn(1, 256, generator=gen).to(device, torch.bfloat16)
    got = w4a16_h2(x, w, torch.empty((1, 96), dtype=torch.bfloat16, device=device))
    want = x.double() @ dequantize_w4_ref(w).double()
    assert _row_rel(got, want) < VS_FP64
    other = w4a16_h2(x, w, torch.empty((1, 96), dtype=torch.bfloat16, device=device),
                     RowsTiles(32, 4, 1, waves=2, min_steps=1, prefetch=True))
    assert _row_rel(got, other) < VS_SPLIT
    # a call that asks for a K split keeps the split-K entries (w4a16_matmul's split_k)
    split = w4a16_h2(x, w, torch.empty((1, 96), dtype=torch.bfloat16, device=device), split=2)
    assert _row_rel(split, want) < VS_FP64
