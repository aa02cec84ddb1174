"""The packed-half W4A16 GEMV's prologue forms (kernels/w4a16_prologue.py) against the separate
kernels they replace: RMSNorm (+ residual add) before the GEMV, SiLU-and-mul before it.

The fused GEMV must see the very inputs the separate kernels store (same formulas, one rounding
to the activation dtype where they round; the interpreter's fp32 -> bf16 conversion truncates
where a GPU rounds to nearest, so the separate path here is the Triton kernels, not the torch
references), so:
  - SiLU-and-mul: output bit-equal to elementwise.silu_and_mul then the GEMV;
  - the summed residual: bit-equal to the separate add;
  - RMSNorm: the row's sum of squares is taken in another order, so 1/rms may differ in its
    last bit and flip the rounding of a few normalized inputs by one bf16 ulp (2^-8 relative of
    that element): per output row within 1e-3 relative of the separate path (a wrong rstd,
    weight or order is off by > 1e-2), and within the GEMV's own 1e-2 of the fp64 reference.
"""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels import dispatch, elementwise
from homelab_llm.engine.kernels import w4a16_pack as wp
from homelab_llm.engine.kernels.ref import dequantize_w4_ref
from homelab_llm.engine.kernels.tuning import h2_tiles
from homelab_llm.engine.kernels.w4a16_h2 import w4a16_h2

FUSED_VS_SEPARATE, VS_FP64 = 1e-3, 1e-2


def _weight(k: int, n: int, group: int, device: torch.device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return wp.quantize_rtn(torch.randn(n, k, generator=gen) * 0.05, group, True).to(device), gen


def _row_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float(((got - want).norm(dim=1) / want.norm(dim=1)).max())


def _out(m: int, n: int, device: torch.device) -> torch.Tensor:
    return torch.empty((m, n), dtype=torch.bfloat16, device=device)


def _tiles(m: int, n: int, device: torch.device):
    """The fused call's tiles, given to the separate GEMV too: a device's table may give fused
    calls their own entry (sm_90 at 1 row), whose K split sums in another order."""
    return h2_tiles(m, device, n, fused=True)


# (M, K, N, group, split): one program per column block and K over 3 uneven splits; several
# column blocks (only block 0's programs store the sum); 5 rows (padded BLOCK_M)
NORM_CASES = [(1, 256, 96, 128, None), (2, 384, 67, 64, 3), (5, 256, 40, 32, 2)]


@pytest.mark.parametrize("m,k,n,group,split", NORM_CASES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_prologue_matches_separate_norm(m: int, k: int, n: int, group: int, split: int | None,
                                             with_residual: bool, device: torch.device) -> None:
    w, gen = _weight(k, n, group, device, m * 100 + k + n)
    x = (torch.randn(m, k, generator=gen) * 3).to(device, torch.bfloat16)
    res = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
    nw = (1 + 0.3 * torch.randn(k, generator=gen)).to(device, torch.bfloat16)
    eps = 1e-6
    kept = torch.full_like(x, float("nan"))  # the normalized rows, for other linears
    if with_residual:
        normed, want_sum = elementwise.add_rms_norm(x, res, nw, eps)
        summed = torch.full_like(x, float("nan"))
        got = w4a16_h2(x, w, _out(m, n, device), split=split, norm_weight=nw, eps=eps,
                       residual=res, summed=summed, normed=kept)
        assert torch.equal(summed, want_sum)
    else:
        normed = elementwise.rms_norm(x, nw, eps)
        got = w4a16_h2(x, w, _out(m, n, device), split=split, norm_weight=nw, eps=eps,
                       normed=kept)
    # the separate kernel's values, up to its sum of squares' order (a rounding of rsqrt)
    torch.testing.assert_close(kept, normed, rtol=2 ** -7, atol=0)
    separate = w4a16_h2(normed, w, _out(m, n, device), _tiles(m, n, device), split=split)
    assert _row_rel(got, separate) < FUSED_VS_SEPARATE
    assert _row_rel(got, normed.double() @ dequantize_w4_ref(w).double()) < VS_FP64


@pytest.mark.parametrize("m,k,n,group,split", [(1, 256, 96, 128, None), (3, 384, 67, 64, 3)])
def test_silu_prologue_is_bit_equal_to_separate_kernel(m: int, k: int, n: int, group: int,
                                                       split: int | None, device: torch.device) -> None:
    w, gen = _weight(k, n, group, device, m * 7 + k + n)
    gate_up = (torch.randn(m, 2 * k, generator=gen) * 2).to(device, torch.bfloat16)
    got = w4a16_h2(gate_up, w, _out(m, n, device), split=split, act_in="silu")
    act = elementwise.silu_and_mul(gate_up)
    assert torch.equal(got, w4a16_h2(act, w, _out(m, n, device), _tiles(m, n, device), split=split))
    assert _row_rel(got, act.double() @ dequantize_w4_ref(w).double()) < VS_FP64


def test_gelu_prologue_matches_separate_ops(device: torch.device) -> None:
    """Gemma's GELU-tanh-and-mul formed in the prologue (rounded where the torch ops round:
    gelu(gate), then the product) against the GEMV of those ops' output. On a GPU the two
    differ by the activation's fp32 formula (sigmoid form vs tanh): an ulp of bf16 on few
    elements; in the interpreter the kernel's two casts truncate where torch rounds to nearest
    (2^-8 relative an element): bound 1.5e-2. A wrong activation is off by ~10%."""
    from homelab_llm.engine.kernels.ref import gelu_tanh_and_mul_ref

    w, gen = _weight(256, 96, 128, device, 5)
    gate_up = (torch.randn(2, 512, generator=gen) * 2).to(device, torch.bfloat16)
    got = w4a16_h2(gate_up, w, _out(2, 96, device), act_in="gelu_tanh")
    act = gelu_tanh_and_mul_ref(gate_up)
    assert _row_rel(got, w4a16_h2(act, w, _out(2, 96, device), _tiles(2, 96, device))) < 1.5e-2
    silu = w4a16_h2(gate_up, w, _out(2, 96, device), act_in="silu")
    assert _row_rel(silu, got) > 0.05
    with pytest.raises(ValueError, match="act_in 'relu'"):
        w4a16_h2(gate_up, w, _out(2, 96, device), act_in="relu")


def test_prologue_rejects_bad_combinations(device: torch.device) -> None:
    w, gen = _weight(128, 32, 128, device, 1)
    x = torch.randn(1, 128, generator=gen).to(device, torch.bfloat16)
    nw = torch.ones(128, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="act_in"):  # a [M, K] input is not gate | up
        w4a16_h2(x, w, _out(1, 32, device), act_in="silu")
    with pytest.raises(ValueError, match="residual"):  # a residual needs somewhere to go
        w4a16_h2(x, w, _out(1, 32, device), norm_weight=nw, residual=x.clone())
    with pytest.raises(ValueError, match="alias"):
        w4a16_h2(x, w, _out(1, 32, device), norm_weight=nw, residual=x.clone(), summed=x)
    with pytest.raises(ValueError, match="normed takes"):  # the rows need a norm to be normed
        w4a16_h2(x, w, _out(1, 32, device), normed=torch.empty_like(x))


def test_prologue_calls_take_the_fused_entry(device: torch.device, monkeypatch) -> None:
    """A call with a prologue form takes the arch's w4a16_h2_fused entry for its rows (sm_90: 1
    row, the register-prefetch tile), or its w4a16_h2_fused_thin entry for outputs of at most
    THIN_N columns; plain calls and other row counts keep w4a16_h2's; a launch through the fused
    entry (here a small prefetching tile) still matches the separate path."""
    import dataclasses

    from homelab_llm.engine.kernels import tuning
    from homelab_llm.engine.kernels.tuning import RowsTiles

    assert tuning.TABLE["sm90"].w4a16_h2_fused[0][1].prefetch
    assert tuning.thin_entry(tuning.TABLE["sm90"].w4a16_h2_fused_thin, 1).prefetch
    fused = RowsTiles(16, 8, 1, waves=8, min_steps=1, prefetch=True)
    thin = RowsTiles(16, 8, 1, waves=4, min_steps=2, prefetch=True)
    arch = tuning.tiles_for(device)
    monkeypatch.setitem(tuning.TABLE, arch.name, dataclasses.replace(
        arch, w4a16_h2_fused=((1, fused),), w4a16_h2_fused_thin=((1, 2, thin),)))
    assert tuning.h2_tiles(1, device, tuning.THIN_N + 1, fused=True) is fused
    assert tuning.h2_tiles(1, device, tuning.THIN_N, fused=True) is thin
    assert tuning.h2_tiles(1, device, 96) not in (fused, thin)
    assert tuning.h2_tiles(2, device, 96, fused=True) is not thin  # no 2-row fused entry
    monkeypatch.setitem(tuning.TABLE, arch.name, dataclasses.replace(
        arch, w4a16_h2_fused=((1, fused),), w4a16_h2_fused_thin=()))
    assert tuning.h2_tiles(1, device, 96, fused=True) is fused
    w, gen = _weight(256, 96, 64, device, 11)
    gate_up = torch.randn(1, 512, generator=gen).to(device, torch.bfloat16)
    got = w4a16_h2(gate_up, w, _out(1, 96, device), act_in="silu")
    want = w4a16_h2(elementwise.silu_and_mul(gate_up), w, _out(1, 96, device), tiles=fused)
    assert torch.equal(got, want)


def test_prologue_route_needs_fused_tiles(device: torch.device, monkeypatch) -> None:
    """The layers fuse only rows whose fused tiles the arch table has (where the fused calls were
    measured ahead of the separate kernels), on the packed-half route, without act-order."""
    import dataclasses

    from homelab_llm.engine.kernels import tuning
    from homelab_llm.engine.kernels.tuning import RowsTiles

    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    arch = tuning.tiles_for(device)
    w, gen = _weight(128, 32, 64, device, 3)
    one, two = (torch.randn(m, 128, generator=gen).to(device, torch.bfloat16) for m in (1, 2))
    monkeypatch.setitem(tuning.TABLE, arch.name, dataclasses.replace(arch, w4a16_h2_fused=()))
    assert not dispatch.w4a16_prologue_route(one, w)
    tile = RowsTiles(16, 8, 1, waves=8, min_steps=1, prefetch=True)
    monkeypatch.setitem(tuning.TABLE, arch.name, dataclasses.replace(arch, w4a16_h2_fused=((1, tile),)))
    on_h2 = tuning.w4a16_route(1, device) == "h2"
    assert dispatch.w4a16_prologue_route(one, w) == on_h2
    assert not dispatch.w4a16_prologue_route(two, w)  # no 2-row entry
    assert not dispatch.w4a16_prologue_route(one, dataclasses.replace(w, perm=torch.arange(128, device=device)))


def test_two_row_fused_entry(device: torch.device, monkeypatch) -> None:
    """A table with a 2-row fused entry (sm_90: the plain 2-row tile) folds the norm into 2-row
    GEMVs (verify K = 1, batch-2 decode), which match the separate norm then GEMV on that tile;
    3 rows have no entry."""
    import dataclasses

    from homelab_llm.engine.kernels import tuning
    from homelab_llm.engine.kernels.tuning import RowsTiles

    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    arch = tuning.tiles_for(device)
    one = RowsTiles(16, 8, 1, waves=8, min_steps=1, prefetch=True)
    tile = next(t for rows, t in arch.w4a16_h2 if rows >= 2)
    monkeypatch.setitem(tuning.TABLE, arch.name,
                        dataclasses.replace(arch, w4a16_h2_fused=((1, one), (2, tile)),
                                            w4a16_h2_fused_thin=()))
    assert tuning.h2_fused_tiles(1, device) is one and tuning.h2_fused_tiles(2, device) is tile
    assert tuning.h2_fused_tiles(3, device) is None
    w, gen = _weight(256, 96, 64, device, 13)
    x = (torch.randn(2, 256, generator=gen) * 3).to(device, torch.bfloat16)
    assert dispatch.w4a16_prologue_route(x, w) == (tuning.w4a16_route(2, device) == "h2")
    nw = (1 + 0.3 * torch.randn(256, generator=gen)).to(device, torch.bfloat16)
    got = w4a16_h2(x, w, _out(2, 96, device), norm_weight=nw, eps=1e-6)
    assert tuning.h2_tiles(2, device, 96, fused=True) is tile
    separate = w4a16_h2(elementwise.rms_norm(x, nw, 1e-6), w, _out(2, 96, device), tile)
    assert _row_rel(got, separate) < FUSED_VS_SEPARATE


@pytest.mark.parametrize("m,k,n,group,split", [(1, 256, 96, 128, None), (2, 384, 67, 64, 3)])
@pytest.mark.parametrize("form", ["norm", "norm_residual", "silu", "plain"])
def test_loads_first_prologue_is_bit_equal(m: int, k: int, n: int, group: int, split: int | None,
                                           form: str, device: torch.device) -> None:
    """A prefetching tile whose K range is one prep chunk issues its prologue's loads (the norm's
    row, its own inputs) before its first words (w4a16_h2.loads_first, LOADS_FIRST): the same
    arithmetic as the chunk loop, so the output, the summed residual and the normalized rows
    equal, bit for bit, those of the same tile without the prefetch."""
    from homelab_llm.engine.kernels.tuning import RowsTiles
    from homelab_llm.engine.kernels.w4a16_h2 import CHUNK_VALUES, loads_first

    w, gen = _weight(k, n, group, device, m * 31 + k + n + len(form))
    x = (torch.randn(m, 2 * k if form == "silu" else k, generator=gen) * 3).to(device, torch.bfloat16)
    res = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
    nw = (1 + 0.3 * torch.randn(k, generator=gen)).to(device, torch.bfloat16)
    first = RowsTiles(32, 4, 1, waves=2, min_steps=1, prefetch=True)
    plain = RowsTiles(32, 4, 1, waves=2, min_steps=1)
    norm = form.startswith("norm")
    assert k <= CHUNK_VALUES and loads_first(first, m, k, k, norm, {})
    assert not loads_first(plain, m, k, k, norm, {})
    assert not loads_first(first, m, k, k, norm, {"PDL": 1, "launch_pdl": True})
    assert not loads_first(first, m, 4 * CHUNK_VALUES, 2 * CHUNK_VALUES, norm, {})
    outs = []
    for tiles in (first, plain):
        kw = {}
        if norm:
            kw = dict(norm_weight=nw, eps=1e-6, normed=torch.full((m, k), float("nan"), dtype=x.dtype,
                                                                  device=device))
            if form == "norm_residual":
                kw.update(residual=res, summed=torch.full_like(kw["normed"], float("nan")))
        elif form == "silu":
            kw = dict(act_in="silu")
        got = w4a16_h2(x, w, _out(m, n, device), tiles, split=split, **kw)
        outs.append([got] + [kw[key] for key in ("normed", "summed") if key in kw])
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    if form == "silu":
        want = elementwise.silu_and_mul(x)
    elif norm:
        want = elementwise.add_rms_norm(x, res, nw, 1e-6)[0] if form == "norm_residual" \
            else elementwise.rms_norm(x, nw, 1e-6)
    else:
        want = x
    assert _row_rel(outs[0][0], want.double() @ dequantize_w4_ref(w).double()) < VS_FP64
