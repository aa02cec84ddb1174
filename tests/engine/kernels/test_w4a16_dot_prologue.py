"""The few-row W4A16 kernel's prologue forms (w4a16_dot(norm_weight=, residual=, act_in=)) against
the separate kernels they replace, and the dispatch that sends 3-16-row layers to them.

The norm here is not the separate kernel's arithmetic: the dot reads bf16(s * norm_weight) and
the per-row 1/rms (summed over the K splits like the partial dots) scales the result, where the
separate path rounds s * rstd * norm_weight. Each input differs by at most an ulp of bf16 (2^-8
relative; the interpreter's casts truncate, so two), so a row of outputs stays within 8e-3 of
the separate path (a wrong rstd, weight, split share or row is off by > 5e-2) and within the
kernel's own 1e-2 of the fp64 reference. The summed residual and SiLU-and-mul feed the same
values as the separate kernels: bit-equal.
"""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels import dispatch, elementwise
from homelab_llm.engine.kernels import w4a16_pack as wp
from homelab_llm.engine.kernels.ref import dequantize_w4_ref
from homelab_llm.engine.kernels.w4a16_dot import w4a16_dot

NORM_VS_SEPARATE, VS_FP64 = 8e-3, 1e-2


def _weight(k: int, n: int, group: int, device: torch.device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return wp.quantize_rtn(torch.randn(n, k, generator=gen) * 0.05, group, False).to(device), gen


def _row_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float(((got - want).norm(dim=1) / want.norm(dim=1)).max())


def _out(m: int, n: int, device: torch.device) -> torch.Tensor:
    return torch.empty((m, n), dtype=torch.bfloat16, device=device)


# (M, K, N, split): one program's K range, 3 uneven splits (each program's share of the squares
# summed by the last), 20 rows (two row blocks of 16 in the interpreter), several column blocks
NORM_CASES = [(3, 256, 40, 1), (5, 384, 72, 3), (20, 256, 48, None)]


@pytest.mark.parametrize("m,k,n,split", NORM_CASES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_prologue_matches_separate_norm(m: int, k: int, n: int, split: int | None,
                                             with_residual: bool, device: torch.device) -> None:
    w, gen = _weight(k, n, 128, device, m * 100 + k + n)
    x = (torch.randn(m, k, generator=gen) * 3).to(device, torch.bfloat16)
    res = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
    nw = (1 + 0.3 * torch.randn(k, generator=gen)).to(device, torch.bfloat16)
    eps = 1e-6
    if with_residual:
        normed, want_sum = elementwise.add_rms_norm(x, res, nw, eps)
        summed = torch.full_like(x, float("nan"))
        got = w4a16_dot(x, w, _out(m, n, device), split=split, norm_weight=nw, eps=eps,
                        residual=res, summed=summed)
        assert torch.equal(summed, want_sum)
    else:
        normed = elementwise.rms_norm(x, nw, eps)
        got = w4a16_dot(x, w, _out(m, n, device), split=split, norm_weight=nw, eps=eps)
    separate = w4a16_dot(normed, w, _out(m, n, device), split=split, permute=False)
    assert _row_rel(got, separate) < NORM_VS_SEPARATE
    assert _row_rel(got, normed.double() @ dequantize_w4_ref(w).double()) < VS_FP64


def test_norm_prologue_takes_the_whole_rows_scale(device: torch.device) -> None:
    """Rows of very different scales through 3 K splits: each output row carries its own 1/rms of
    the whole row (a program's share alone, or another row's, would be off by far more)."""
    w, gen = _weight(384, 40, 128, device, 3)
    x = torch.randn(4, 384, generator=gen)
    x[1] *= 100.0
    x[2, :128] *= 50.0  # one split's range dominates the row's sum of squares
    x = x.to(device, torch.bfloat16)
    nw = torch.ones(384, dtype=torch.bfloat16, device=device)
    got = w4a16_dot(x, w, _out(4, 40, device), split=3, norm_weight=nw, eps=1e-6)
    want = elementwise.rms_norm(x, nw, 1e-6).double() @ dequantize_w4_ref(w).double()
    assert _row_rel(got, want) < VS_FP64


@pytest.mark.parametrize("m,split", [(3, 1), (8, 3)])
def test_silu_prologue_is_bit_equal_to_separate_kernel(m: int, split: int,
                                                       device: torch.device) -> None:
    w, gen = _weight(256, 72, 128, device, m)
    gate_up = (torch.randn(m, 512, generator=gen) * 2).to(device, torch.bfloat16)
    got = w4a16_dot(gate_up, w, _out(m, 72, device), split=split, act_in="silu")
    act = elementwise.silu_and_mul(gate_up)
    assert torch.equal(got, w4a16_dot(act, w, _out(m, 72, device), split=split))
    assert _row_rel(got, act.double() @ dequantize_w4_ref(w).double()) < VS_FP64


def test_forms_need_steps_inside_a_group(device: torch.device) -> None:
    """A 32-wide group (K steps of 128 cross it), the left-operand loop or explicit tiles: a
    prologue form is refused with the reason, never computed another way."""
    w, gen = _weight(256, 32, 32, device, 1)
    x = torch.randn(3, 256, generator=gen).to(device, torch.bfloat16)
    nw = torch.ones(256, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="group 32"):
        w4a16_dot(x, w, _out(3, 32, device), norm_weight=nw, eps=1e-6)
    w, _ = _weight(256, 32, 128, device, 2)
    with pytest.raises(ValueError, match="eight-dot loop"):
        w4a16_dot(x, w, _out(3, 32, device), w_left=True, norm_weight=nw, eps=1e-6)
    with pytest.raises(ValueError, match="act_in"):
        w4a16_dot(x, w, _out(3, 32, device), act_in="silu")  # [M, K] is not gate | up


def test_dispatch_routes_few_rows_to_the_forms(device: torch.device, monkeypatch) -> None:
    """An arch whose table gives the few-row kernel fused rows sends norm + linear and
    act + linear of those rows to one launch (not a keep call: the normalized rows are never
    stored), with the outputs the kernel gives directly; past the fused rows, and for a 32-wide
    group, the separate ops."""
    import dataclasses

    from homelab_llm.engine.kernels import tuning

    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    arch = tuning.tiles_for(device)
    w, gen = _weight(256, 48, 128, device, 4)
    x = torch.randn(5, 256, generator=gen).to(device, torch.bfloat16)
    res = torch.randn(5, 256, generator=gen).to(device, torch.bfloat16)
    nw = (1 + 0.3 * torch.randn(256, generator=gen)).to(device, torch.bfloat16)
    assert tuning.w4a16_route(5, device) == "dot"
    assert not dispatch.w4a16_prologue_route(x, w)
    monkeypatch.setitem(tuning.TABLE, arch.name, dataclasses.replace(arch, w4a16_dot_fused_rows=8))
    assert dispatch.w4a16_prologue_route(x, w) and not dispatch.w4a16_prologue_route(x, w, keep=True)
    assert not dispatch.w4a16_prologue_route(torch.cat([x, x]), w)  # 10 rows
    assert not dispatch.w4a16_prologue_route(x, _weight(256, 48, 32, device, 5)[0])
    out, summed = dispatch.w4a16_norm_matmul(x, res, nw, 1e-6, w)
    direct = w4a16_dot(x, w, _out(5, 48, device), norm_weight=nw, eps=1e-6, residual=res,
                       summed=torch.empty_like(x))
    assert torch.equal(out, direct) and torch.equal(summed, elementwise.add_rms_norm(x, res, nw, 1e-6)[1])
    gate_up = torch.randn(5, 512, generator=gen).to(device, torch.bfloat16)
    assert torch.equal(dispatch.w4a16_act_matmul(gate_up, w),
                       w4a16_dot(gate_up, w, _out(5, 48, device), act_in="silu"))
