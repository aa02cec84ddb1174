"""The few-row W4A16 kernel's chained epilogues (kernels/w4a16_epilogue.py, w4a16_chain.py)
against the separate kernels they replace: on a GPU at Llama-3.1-8B's shapes on the device's
table, on the CPU at small ones on the interpreter's table patched to the left-operand kernel
with x in pair order.

Bounds: the linear before the norm stores s = round(round(x W) + residual) bit for bit as the
plain launch (same split) then the norm kernel's add make it (the same sums in the same order),
s * norm_weight within one bf16 ulp of torch's product (the interpreter truncates fp32 -> bf16
where a GPU rounds), and the rows' 1 / rms within 1e-5 relative of torch's (fp32 sums in another order). The
linear after the norm, and its act-and-mul, within 1e-2 row-relative of norm -> linear ->
act-and-mul through the separate kernels: the norm's output is rounded as s * w instead of s *
rstd * w (a bf16 rounding, 2^-9, per element; x in a wrong order or a missing 1 / rms is of
order 1).
"""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels import elementwise
from homelab_llm.engine.kernels import w4a16_pack as wp
from homelab_llm.engine.kernels.pair_order import pair_order
from homelab_llm.engine.kernels.ref import dequantize_w4_ref
from homelab_llm.engine.kernels.w4a16_chain import paired_dot, norm_out_dot
from homelab_llm.engine.kernels.w4a16_dot import w4a16_dot, x_pairs_block
from tests.engine.kernels.left_table import use_left_table

EPS = 1e-6


def _shapes(monkeypatch, device: torch.device) -> tuple[int, int]:
    """(hidden, intermediate): 8B's on a GPU (its table's tiles), small ones on the CPU's
    patched table."""
    if device.type == "cuda":
        return 4096, 14336
    use_left_table(monkeypatch, x_pairs=True)
    return 256, 384


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1)).max())


def _weight(k: int, n: int, gen: torch.Generator, device: torch.device) -> wp.W4Weight:
    return wp.quantize_rtn(torch.randn(n, k, generator=gen).to(device) * k ** -0.5, 128, False)


def _rows(shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(device, torch.bfloat16)


def _plain(x: torch.Tensor, w: wp.W4Weight, paired: bool = True, split: int | None = None) -> torch.Tensor:
    out = torch.empty((x.shape[0], w.out_features), dtype=x.dtype, device=x.device)
    return w4a16_dot(x, w, out, split=split, w_left=True, x_paired=paired)


@pytest.mark.parametrize("rows", [3, 5, 16, 40])  # 40: three row blocks of 16, a counter each
def test_norm_out_forms_the_next_norms_input(monkeypatch, rows: int, device: torch.device) -> None:
    """o_proj's launch with the post-attention norm's add in its epilogue: the next residual bit
    for bit, s * w in gate_up's pair order, the rows' 1 / rms (the last column block to finish
    sums the others' squares); whole K in one program and split in 3 (the tile's last program
    finishes)."""
    hidden, inter = _shapes(monkeypatch, device)
    gen = torch.Generator().manual_seed(71)
    w = _weight(inter, hidden, gen, device)
    x = pair_order(_rows((rows, inter), gen, device), x_pairs_block(rows, w, device))
    residual = _rows((rows, hidden), gen, device)
    norm_w = (torch.rand(hidden, generator=gen) + 0.5).to(device, torch.bfloat16)
    block = 128  # the next linear's K step (any whole steps)
    for split in (1, 3):
        want_sum = elementwise.add_rms_norm(_plain(x, w, split=split), residual, norm_w, EPS)[1]
        want_y = pair_order(want_sum.float() * norm_w.float(), block)
        y, rstd, summed = norm_out_dot(x, w, residual, norm_w, EPS, block, split=split)
        assert torch.equal(summed, want_sum), split
        assert bool(((y.float() - want_y).abs() <= want_y.abs() * 2 ** -7).all()), split
        want_rstd = torch.rsqrt((want_sum.float() ** 2).mean(1) + EPS)
        assert float(((rstd - want_rstd).abs() / want_rstd).max()) < 1e-5, split


@pytest.mark.parametrize("act,rows", [("silu", 4), ("gelu_tanh", 4), ("silu", 40)])
def test_norm_in_and_act_out_match_the_separate_kernels(monkeypatch, act: str, rows: int,
                                                       device: torch.device) -> None:
    """gate_up after the norm (its 1 / rms from o_proj's launch) with the act-and-mul in its
    epilogue, stored in down's pair order; and qkv_proj's form (the norm's scale only), both
    against norm -> linear (-> act-and-mul) through the separate kernels; split 1 and 2."""
    hidden, inter = _shapes(monkeypatch, device)
    gen = torch.Generator().manual_seed(73)
    o_proj, gate_up = _weight(inter, hidden, gen, device), _weight(hidden, 2 * inter, gen, device)
    down_pairs = x_pairs_block(rows, o_proj, device)  # a down projection's K step (its K is inter too)
    x = pair_order(_rows((rows, inter), gen, device), down_pairs)
    residual = _rows((rows, hidden), gen, device)
    norm_w = (torch.rand(hidden, generator=gen) + 0.5).to(device, torch.bfloat16)
    y, rstd, summed = norm_out_dot(x, o_proj, residual, norm_w, EPS, x_pairs_block(rows, gate_up, device))
    normed = elementwise.rms_norm(summed, norm_w, EPS)
    s32 = summed.float()
    exact = (s32 * torch.rsqrt((s32 * s32).mean(1, keepdim=True) + EPS) * norm_w.float()) @ dequantize_w4_ref(gate_up)
    want_gu = _plain(normed, gate_up, paired=False)
    want_act = elementwise.silu_and_mul(want_gu) if act == "silu" else \
        (torch.nn.functional.gelu(want_gu[:, :inter].float(), approximate="tanh").to(torch.bfloat16).float()
         * want_gu[:, inter:].float()).to(torch.bfloat16)
    for split in (1, 2):
        got = paired_dot(y, gate_up, rstd, act=act, act_pairs=down_pairs, split=split)
        assert got.shape == (rows, inter)
        assert _rel(got, pair_order(want_act, down_pairs)) < 1e-2, split
        got_gu = paired_dot(y, gate_up, rstd, split=split)
        assert _rel(got_gu, want_gu) < 1e-2, split
        # and as close to fp32 math as the separate kernels are (both ~6e-3 off on the CPU, whose
        # interpreter truncates where a GPU rounds)
        assert _rel(got_gu, exact) < 1.25 * _rel(want_gu, exact) + 1e-3, split
    with pytest.raises(ValueError, match="whole half blocks"):  # 80 features: not halves of 64
        paired_dot(y, _weight(hidden, 2 * 80, gen, device), rstd, act=act, act_pairs=16)


def test_only_the_norm_epilogue_specializes_on_the_column_blocks() -> None:
    """PARTS_BLOCK shapes NORM_OUT's read of its partial sums alone; every other launch passes 1,
    so linears of different widths share one compiled kernel."""
    from homelab_llm.engine.kernels.w4a16_epilogue import ACT_OUT, NORM_OUT, DotChain

    assert DotChain().meta(5120, 64, 80)["PARTS_BLOCK"] == 1
    assert DotChain().meta(34816, 64, 544) == DotChain().meta(5120, 64, 80)
    assert DotChain(epi=ACT_OUT).meta(256, 64, 4)["PARTS_BLOCK"] == 1
    parts = torch.zeros((80, 3))
    assert DotChain(epi=NORM_OUT, parts=parts).meta(5120, 64, 80)["PARTS_BLOCK"] == 128
