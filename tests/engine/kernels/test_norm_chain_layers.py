"""A tiny W4A16 Llama's decode step with its norms and SiLU-and-mul inside the few-row linears
(layers/norm_chain.py, kernels/w4a16_epilogue.py; HOMELAB_LLM_NORM_CHAIN=1) against the same
step with their own launches (=0, the default): on a GPU on its own table's few-row tiles, on the CPU on the
interpreter's table patched to the left-operand kernel reading x in pair order (where the
launches are counted too).

Bounds: the final hidden rows within 2e-2 row-relative: the chained norm rounds s * w instead of
s * rstd * w, a bf16 rounding per element, and the interpreter truncates where a GPU rounds, so
two equally exact paths drift ~6e-3 apart a layer here (test_w4a16_chain checks the chained
linear is as close to fp32 math as the separate kernels); a missing 1 / rms or a wrong residual
is of order 1. Launches: the first layer's input norm and the final norm only, no
SiLU-and-mul, the same linears.
"""

from __future__ import annotations

import copy

import pytest
import torch

from homelab_llm.engine.kernels import dispatch
from homelab_llm.engine.layers.norm_chain import CHAIN_ENV
from tests.engine.kernels.left_table import (
    four_rows_context, interpreted, on_device, use_left_table, w4_gated_mlp, w4_linears,
)

HIDDEN, INTER, LAYERS = 128, 256, 2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1)).max())


def _model(o_proj_bias: bool = False, layers: int = LAYERS):
    from homelab_llm.engine.model.config import ModelConfig
    from homelab_llm.engine.model.llama import LlamaForCausalLM
    from tests.engine.kernels.launch_count import bind_cache, random_weights

    config = ModelConfig(architecture="llama", vocab_size=64, hidden_size=HIDDEN, intermediate_size=INTER,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         o_proj_bias=o_proj_bias, name="tiny-w4-chain")
    torch.manual_seed(81)
    model = random_weights(LlamaForCausalLM(config), 0.1).to(torch.bfloat16)
    w4_linears(model)
    for attn in model.attention_layers:
        bind_cache(attn, torch.bfloat16, pages=8)
    return model


def _step(monkeypatch, model, chain: str, ctx=None):
    """(launches by kernel, hidden) of one decode step for 4 sequences, from the caches (and
    states) as bound, on the model's device (launches are counted through the interpreter only)."""
    from homelab_llm.engine.context import forward_context
    from tests.engine.kernels.launch_count import count_calls

    ctx = ctx or four_rows_context()
    ids = torch.tensor([3, 9, 27, 41], device=ctx.positions.device)
    monkeypatch.setenv(CHAIN_ENV, chain)
    with torch.no_grad(), forward_context(ctx):
        copy.deepcopy(model)(ids, ctx.positions)  # first-use buffers (tickets) outside the count
        fresh = copy.deepcopy(model)
        return count_calls(monkeypatch, lambda: fresh(ids, ctx.positions))


def _gpu_path(monkeypatch, device: torch.device) -> None:
    """The few-row kernel's route: the device's own table on a GPU; on the CPU the GPU path
    through the interpreter on its patched table."""
    if device.type == "cpu":
        from homelab_llm.engine.kernels import gdn

        monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
        monkeypatch.setattr(gdn, "use_triton", lambda t: True)  # the Gated DeltaNet kernels too
        use_left_table(monkeypatch, x_pairs=True)


def test_llama_decode_step_runs_its_norms_inside_the_linears(monkeypatch, device: torch.device) -> None:
    """The chain ("1"): norms and SiLU-and-muls inside the linears; "act": only the
    SiLU-and-muls (gate_up's epilogue), every norm its own launch."""
    _gpu_path(monkeypatch, device)
    model, ctx = on_device(_model(), four_rows_context(), device)
    want_counts, want = _step(monkeypatch, model, "0", ctx)
    got_counts, got = _step(monkeypatch, model, "1", ctx)
    act_counts, act = _step(monkeypatch, model, "act", ctx)
    assert _rel(got, want) < 2e-2 and _rel(act, want) < 2e-2
    if device.type != "cpu":
        return
    assert act_counts["triton._rms_norm_kernel"] == 2 * LAYERS + 1 and act_counts["triton._silu_and_mul_kernel"] == 0
    assert act_counts["triton._w4a16_dot_kernel"] == 4 * LAYERS
    assert want_counts["triton._rms_norm_kernel"] == 2 * LAYERS + 1
    assert want_counts["triton._silu_and_mul_kernel"] == LAYERS
    assert got_counts["triton._rms_norm_kernel"] == 2  # the first input norm, the final norm
    assert got_counts["triton._silu_and_mul_kernel"] == 0
    assert got_counts["triton._w4a16_dot_kernel"] == want_counts["triton._w4a16_dot_kernel"] == 4 * LAYERS
    same = {k: v for k, v in want_counts.items() if "rms_norm" not in k and "silu" not in k}
    assert {k: got_counts[k] for k in same} == same


def test_hybrid_decode_step_runs_its_mlp_norms_inside_the_linears(monkeypatch, device: torch.device) -> None:
    """A tiny W4A16 Qwen3.5 hybrid (a Gated DeltaNet layer, a gated attention one, a Gated
    DeltaNet one: each kind after the other): every post-attention norm in out_proj's or o_proj's
    epilogue, the SiLU-and-muls in gate_up's, and each input norm but the first in the layer
    before's down_proj (a Gated DeltaNet's bf16 in_proj_ba normalizes the summed rows in its own
    GEMV's prologue: one launch, as before)."""
    from tests.engine.kernels.left_table import hybrid_w4_model

    _gpu_path(monkeypatch, device)
    model, config, ctx = hybrid_w4_model(HIDDEN, INTER, 83, ("linear_attention", "full_attention",
                                                              "linear_attention"))
    model, ctx = on_device(model, ctx, device)
    want_counts, want = _step(monkeypatch, model, "0", ctx)
    got_counts, got = _step(monkeypatch, model, "1", ctx)
    assert _rel(got, want) < 2e-2
    if device.type != "cpu":
        return
    layers = config.num_hidden_layers
    assert want_counts["triton._rms_norm_kernel"] == 2 * layers + 1
    assert got_counts["triton._rms_norm_kernel"] == 2  # the first input norm, the final norm
    assert want_counts["triton._silu_and_mul_kernel"] == layers and got_counts["triton._silu_and_mul_kernel"] == 0
    same = {k: v for k, v in want_counts.items() if "rms_norm" not in k and "silu" not in k}
    assert {k: got_counts[k] for k in same} == same


@interpreted
@pytest.mark.parametrize("why", ["o_proj bias", "two rows"])
def test_layers_keep_the_separate_launches_where_the_chain_cannot_go(monkeypatch, why: str) -> None:
    """o_proj with a bias (its sum is not the epilogue's left term) or 2 rows (the packed-half
    GEMV's prologue route): no norm in an epilogue; with the bias every norm keeps its launch
    and the MLP still takes its act-and-mul in gate_up's epilogue."""
    from homelab_llm.engine.layers.norm_chain import mlp_chain_pairs

    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    use_left_table(monkeypatch, x_pairs=True)
    model = _model(o_proj_bias=why == "o_proj bias", layers=1)
    layer = model.model.layers[0]
    rows = torch.zeros(2 if why == "two rows" else 4, HIDDEN, dtype=torch.bfloat16)
    assert mlp_chain_pairs(rows, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj) == 0
    if why == "o_proj bias":
        got, want = _step(monkeypatch, model, "1")[0], _step(monkeypatch, model, "0")[0]
        assert got["triton._rms_norm_kernel"] == want["triton._rms_norm_kernel"] == 3
        assert got["triton._silu_and_mul_kernel"] == 0 and want["triton._silu_and_mul_kernel"] == 1


@interpreted
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_mlp_after_its_norms_launch_runs_the_act_in_gate_ups_epilogue(monkeypatch, act: str) -> None:
    """Where the norm keeps its launch (tensor parallelism's all-reduce before it, Gemma's
    pre-feedforward norm) a W4A16 gated MLP on the left-operand kernel still folds its
    act-and-mul into gate_up's epilogue (GELU-tanh too, which otherwise runs as torch ops and a
    reorder): no SiLU-and-mul launch, the output within 1e-2 of the separate kernels'."""
    from homelab_llm.engine.layers.norm_linear import gated_mlp
    from tests.engine.kernels.launch_count import count_calls

    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    monkeypatch.setenv(CHAIN_ENV, "1")  # the chain's switch (off by default)
    use_left_table(monkeypatch, x_pairs=True)
    gen = torch.Generator().manual_seed(85)
    norm, gate_up, down = w4_gated_mlp(HIDDEN, INTER, gen)
    x, residual = (torch.randn(4, HIDDEN, generator=gen).to(torch.bfloat16) for _ in range(2))

    normed, want_res = norm(x, residual)  # the separate ops
    want = down(dispatch.gated_act(gate_up(normed), act))
    got_counts, (got, got_res) = count_calls(monkeypatch, lambda: gated_mlp(x, residual, norm, gate_up, down, act))
    assert torch.equal(got_res, want_res)
    assert _rel(got, want) < 1e-2
    assert got_counts["triton._silu_and_mul_kernel"] == 0 and got_counts["triton._rms_norm_kernel"] == 1
    assert got_counts["triton._w4a16_dot_kernel"] == 2
    monkeypatch.setenv(CHAIN_ENV, "0")
    if act == "silu":  # the switch: the SiLU-and-mul's own launch again
        assert count_calls(monkeypatch, lambda: gated_mlp(x, residual, norm, gate_up, down, act))[0][
            "triton._silu_and_mul_kernel"] == 1


@interpreted
def test_norm_after_takes_k_order_rows_too(monkeypatch) -> None:
    """A mixed step's Gated DeltaNet hands out_proj its rows in k order: NormAfter reorders them
    and gives what the paired rows give, bit for bit."""
    from homelab_llm.engine.kernels import w4a16_pack as wp
    from homelab_llm.engine.kernels.pair_order import pair_order
    from homelab_llm.engine.layers.linear import RowParallelLinear
    from homelab_llm.engine.layers.norm import RMSNorm
    from homelab_llm.engine.layers.norm_chain import NormAfter

    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    use_left_table(monkeypatch, x_pairs=True)
    gen = torch.Generator().manual_seed(87)
    out_proj = RowParallelLinear(INTER, HIDDEN)
    out_proj.set_w4(wp.quantize_rtn(torch.randn(HIDDEN, INTER, generator=gen) * INTER ** -0.5, 128, False))
    norm = RMSNorm(HIDDEN)
    x, residual = torch.randn(5, INTER, generator=gen).to(torch.bfloat16), torch.randn(5, HIDDEN).to(torch.bfloat16)
    after = NormAfter(out_proj, residual, norm, 128)
    block = after.rows_pairs_block(5, x)
    assert block == 128
    want, got = after(pair_order(x, block), paired=True), after(x)
    assert torch.equal(got.y, want.y) and torch.equal(got.rstd, want.rstd) and torch.equal(got.summed, want.summed)
