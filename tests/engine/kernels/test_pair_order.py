"""Pair order written where the input is made (kernels/pair_order.py): the RMSNorm (with and
without its residual add) and the SiLU-and-mul store their rows in the few-row W4A16 left
loop's pair order, and a table whose left-operand tiles read x so (GemmTiles.x_pairs) gets a
pre-norm linear's and a gated MLP's input from them, with no reorder of its own.

Bounds: the producers' rows are the k-order rows moved, bit for bit (the same arithmetic, only
the store index differs). Through the layers, against the same table reading x in k order
(split in registers): row-relative 1e-2 on bf16 outputs (the integer-zero form's sums are the
same products in the same order; 1e-2 leaves room for a bf16 rounding flipped by a different
fp32 summation on a GPU), where x in the wrong order is of order 1.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from homelab_llm.engine.kernels import dispatch, elementwise, tuning
from homelab_llm.engine.kernels import w4a16_dot as dot_mod
from homelab_llm.engine.kernels import w4a16_pack as wp
from homelab_llm.engine.kernels.pair_order import pair_check, pair_order


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_producers_write_pair_order(dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(51)
    x = torch.randn(3, 384, generator=gen).to(device, dtype)
    res = torch.randn(3, 384, generator=gen).to(device, dtype)
    w = (torch.rand(384, generator=gen) + 0.5).to(device)
    for block in (128, 384, 8):
        assert torch.equal(elementwise.rms_norm(x, w, 1e-6, pair_block=block),
                           pair_order(elementwise.rms_norm(x, w, 1e-6), block)), block
        normed, summed = elementwise.add_rms_norm(x, res, w, 1e-6, pair_block=block)
        want, want_sum = elementwise.add_rms_norm(x, res, w, 1e-6)
        assert torch.equal(normed, pair_order(want, block)) and torch.equal(summed, want_sum), block
    gate_up = torch.randn(2, 2 * 1536, generator=gen).to(device, dtype)  # two programs of 1024
    for block in (128, 512):
        assert torch.equal(elementwise.silu_and_mul(gate_up, pair_block=block),
                           pair_order(elementwise.silu_and_mul(gate_up), block)), block
    with pytest.raises(ValueError, match="whole K steps"):
        pair_check(384, 256)
    with pytest.raises(ValueError, match="whole K steps"):
        pair_check(384, 12)


HIDDEN, INTER, ROWS = 256, 384, 4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1)).max())


def _table(monkeypatch, x_pairs: bool) -> None:
    """The interpreter's table routing 3-16 rows to the left-operand kernel on 16 x 64 tiles
    in the integer-zero form, reading x in pair order or not."""
    tiles = tuning.GemmTiles(16, 64, 128, num_warps=4, num_stages=2, split_k=4, int_zeros=True,
                             x_pairs=x_pairs)
    monkeypatch.setitem(tuning.W4A16_ROUTES, "interpret", ((2, "h2"), (16, "dotL"), (1 << 62, "deq")))
    monkeypatch.setitem(tuning.TABLE, "interpret", dataclasses.replace(
        tuning.TABLE["interpret"], w4a16_dot_left=((16, tiles),), w4a16_dot_left_thin=()))


def _mlp():
    from homelab_llm.engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
    from homelab_llm.engine.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(53)
    norm = RMSNorm(HIDDEN)
    norm.weight.data = torch.rand(HIDDEN, generator=gen) + 0.5
    gate_up = MergedColumnParallelLinear(HIDDEN, [INTER, INTER])
    down = RowParallelLinear(INTER, HIDDEN)
    for lin in (gate_up, down):
        w = torch.randn(lin.weight.shape, generator=gen) * lin.weight.shape[-1] ** -0.5
        lin.set_w4(wp.quantize_rtn(w, 128, False))
        assert lin.w4.int_zeros
    return norm, gate_up, down


def test_norm_and_gated_mlp_feed_the_left_loop_in_pair_order(monkeypatch) -> None:
    from homelab_llm.engine.layers.norm_linear import gated_mlp, norm_then_linear

    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)  # the GPU path, interpreted
    norm, gate_up, down = _mlp()
    gen = torch.Generator().manual_seed(55)
    x = torch.randn(ROWS, HIDDEN, generator=gen).to(torch.bfloat16)
    residual = torch.randn(ROWS, HIDDEN, generator=gen).to(torch.bfloat16)

    _table(monkeypatch, x_pairs=False)  # x in k order: the left loop splits it in registers
    assert dispatch.w4a16_pairs_block(x, gate_up.w4) == 0
    want_h, want_res = norm_then_linear(x, residual, norm, gate_up)
    want_out = down(want_h, act_in="silu")
    want_first = norm_then_linear(x, None, norm, gate_up)[0]  # the first layer: no residual yet

    _table(monkeypatch, x_pairs=True)
    assert dispatch.w4a16_pairs_block(x, gate_up.w4) == 128
    assert dispatch.w4a16_pairs_block(x[:2], gate_up.w4) == 0  # 2 rows: the packed-half GEMV

    def no_reorder(*args, **kwargs):
        raise AssertionError("the producer was to write pair order")

    monkeypatch.setattr(dot_mod, "pair_order", no_reorder)
    h, res = norm_then_linear(x, residual, norm, gate_up)
    assert torch.equal(res, want_res)
    assert _rel(h, want_h) < 1e-2
    out, res = gated_mlp(x, residual, norm, gate_up, down)
    assert torch.equal(res, want_res)
    assert _rel(out, want_out) < 1e-2
    first, same = norm_then_linear(x, None, norm, gate_up)
    assert same is x and _rel(first, want_first) < 1e-2
