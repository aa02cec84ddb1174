"""The layers' norm-then-linear and gated MLP on the mma.sync kernel's route (kernels/w4a16_mma.py):
the RMSNorm (with its residual add) and the SiLU-and-mul run inside the pairs' launches
(prep_pairs), not as launches of their own. On the CPU the interpreter's table is patched to route
2-8 rows there (up to 16 for the 12-row case; the kernel runs through mma_twin), where the
launches are counted.

Bounds (row-relative, against the reference ops): one linear 1e-2, the gated MLP 2e-2. The
interpreter truncates where a GPU rounds, and the pairs' launch scales the fp32 norm or
activation where the reference rounds it to bf16 first: ~4e-3 a linear here, ~8e-3 for the act
form (the packed-half GEMV's act prologue is as far: 7.5e-3), and the MLP adds gate_up's error
to down's. A missing 1 / rms, a wrong residual or a swapped gate and up is of order 1. The
residual sum is exact (the same bf16 add)."""

from __future__ import annotations

import copy

import pytest
import torch

from homelab_llm.engine.kernels import dispatch, tuning
from tests.engine.kernels.left_table import interpreted, w4_gated_mlp

HIDDEN, INTER, ROWS = 256, 384, 4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1)).max())


@interpreted
@pytest.mark.parametrize("rows", [ROWS, 12])
def test_norm_and_act_run_in_the_pairs_launches(monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    """norm_then_linear: one pairs' launch and one mma launch, no norm launch; gated_mlp: two of
    each, no norm and no SiLU-and-mul launch; one row stays off the route. 12 rows: a table
    routing up to 16 rows there (two row tiles a launch)."""
    from homelab_llm.engine.layers.norm_linear import fuses, gated_mlp, norm_then_linear
    from tests.engine.kernels.launch_count import count_calls

    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    monkeypatch.setitem(tuning.W4A16_ROUTES, "interpret", ((1, "h2"), (16, "mma"), (1 << 62, "deq")))
    gen = torch.Generator().manual_seed(91)
    norm, gate_up, down = w4_gated_mlp(HIDDEN, INTER, gen)
    x, residual = (torch.randn(rows, HIDDEN, generator=gen).to(torch.bfloat16) for _ in range(2))
    assert fuses(x, gate_up) and dispatch.w4a16_mma_route(x, gate_up.w4)

    normed, want_res = norm(x, residual)  # the separate ops (the reference path: no triton)
    with monkeypatch.context() as ref:
        ref.setattr(dispatch, "use_triton", lambda t: False)
        want_h = gate_up(normed)
        want = down(dispatch.gated_act(want_h, "silu"))

    counts, (h, res) = count_calls(monkeypatch, lambda: norm_then_linear(x, residual, norm, gate_up))
    assert torch.equal(res, want_res) and _rel(h, want_h) < 1e-2
    assert counts["triton._rms_norm_kernel"] == 0 and counts["triton._prep_kernel"] == 1
    assert counts["triton._w4a16_mma_kernel"] == 1

    counts, (got, res) = count_calls(monkeypatch, lambda: gated_mlp(x, residual, norm, gate_up, down))
    assert torch.equal(res, want_res) and _rel(got, want) < 2e-2
    assert counts["triton._rms_norm_kernel"] == 0 and counts["triton._silu_and_mul_kernel"] == 0
    assert counts["triton._prep_kernel"] == 2 and counts["triton._w4a16_mma_kernel"] == 2

    one = x[:1]  # one row stays off the mma route: the packed-half GEMV's fused prologue
    assert not dispatch.w4a16_mma_route(one, gate_up.w4)


@interpreted
def test_hybrid_decode_step_on_the_mma_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny W4A16 Qwen3.5 hybrid's 4-row decode step (a Gated DeltaNet layer, a gated attention
    one) with every linear on the mma kernel against the same step on the left-operand
    kernel: hidden rows within 2e-2 (two equally exact paths through the truncating interpreter
    drift ~6e-3 a layer, test_norm_chain_layers), a pairs' launch for each linear but out_proj
    (the Gated DeltaNet decode writes its pairs), and no norm or SiLU-and-mul launch but the
    final norm (the input norms ride in in_proj_qkvz's and qkv_proj's pairs' launches, which
    keep the normalized rows for the bf16 in_proj_ba)."""
    from homelab_llm.engine.context import forward_context
    from homelab_llm.engine.kernels import gdn
    from tests.engine.kernels.launch_count import count_calls
    from tests.engine.kernels.left_table import hybrid_w4_model, use_left_table

    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    monkeypatch.setattr(gdn, "use_triton", lambda t: True)
    model, config, ctx = hybrid_w4_model(128, 256, 93, ("linear_attention", "full_attention"))
    ids = torch.tensor([3, 9, 27, 41])
    use_left_table(monkeypatch, x_pairs=True)
    with torch.no_grad(), forward_context(ctx):
        want = copy.deepcopy(model)(ids, ctx.positions)
        monkeypatch.setitem(tuning.W4A16_ROUTES, "interpret", ((1, "h2"), (8, "mma"), (1 << 62, "deq")))
        copy.deepcopy(model)(ids, ctx.positions)  # first-use buffers (tickets) outside the count
        fresh = copy.deepcopy(model)
        counts, got = count_calls(monkeypatch, lambda: fresh(ids, ctx.positions))
    assert _rel(got, want) < 2e-2
    linears = 4 * config.num_hidden_layers  # qkvz | qkv, out_proj | o_proj, gate_up, down
    # out_proj's pairs come from the Gated DeltaNet decode's gated norm: no pairs' launch
    assert counts["triton._w4a16_mma_kernel"] == linears
    assert counts["triton._prep_kernel"] == linears - len(model.gdn_layers)
    assert counts["triton._rms_norm_kernel"] == 1 and counts["triton._silu_and_mul_kernel"] == 0
    assert counts["triton._w4a16_dot_kernel"] == 0
