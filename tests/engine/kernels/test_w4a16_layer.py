"""The Llama-style decoder layer with W4A16 linears on its fused decode path (layers/norm_linear.py:
input_layernorm in qkv_proj's packed-half GEMV prologue, post_attention_layernorm in gate_up's,
SiLU-and-mul in down_proj's) against the same layer through the separate ops.

On the CPU the route is off, so here it is forced on: the fused projections run the packed-half
GEMV in the interpreter (compiled on a GPU), the others the dequantizing reference (the layer:
layer_inputs.stub_layer, its attention a fixed map of qkv)."""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels import dispatch
from homelab_llm.engine.kernels import w4a16_pack as wp
from homelab_llm.engine.layers.linear import LinearBase
from homelab_llm.engine.model.llama import LlamaDecoderLayer
from tests.engine.kernels.layer_inputs import stub_layer


def _layer(device: torch.device, act: str = "silu") -> LlamaDecoderLayer:
    layer = stub_layer(128, 256, 4, 2, 32, 5, hidden_act=act).to(device)
    for module in layer.modules():
        if isinstance(module, LinearBase):
            module.set_w4(wp.quantize_rtn(module.weight.data, 64, False))
    return layer


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.float() - b.float()).norm(dim=1) / b.float().norm(dim=1)).max())


@pytest.mark.parametrize("rows,first,act", [(1, True, "silu"), (2, False, "silu"),
                                             (1, False, "gelu_pytorch_tanh")])  # Gemma's MLP
def test_w4a16_fused_layer_matches_separate_ops(rows: int, first: bool, act: str, monkeypatch,
                                                device: torch.device) -> None:
    layer = _layer(device, act)
    gen = torch.Generator().manual_seed(rows)
    hidden = torch.randn(rows, 128, generator=gen).to(device, torch.bfloat16)
    residual = None if first else torch.randn(rows, 128, generator=gen).to(device, torch.bfloat16)
    launches = []
    real_h2 = dispatch.w4a16_act_matmul

    def counting_silu(gate_up, weight, act):
        launches.append((gate_up.shape, act))
        return real_h2(gate_up, weight, act)

    monkeypatch.setattr(dispatch, "w4a16_prologue_route", lambda x, w: False)
    want, want_res = layer(hidden, residual, None)
    monkeypatch.setattr(dispatch, "w4a16_prologue_route", lambda x, w: True)
    monkeypatch.setattr(dispatch, "w4a16_act_matmul", counting_silu)
    got, got_res = layer(hidden, residual, None)
    # down_proj took gate | up: the activation in its prologue
    assert launches == [((rows, 512), "silu" if act == "silu" else "gelu_tanh")]
    # The output passes 4 W4A16 GEMVs (the residual 2), the fused ones in the packed-half
    # kernel's fp16 arithmetic (~2e-3 a GEMV) against the reference's fp32, plus bf16 roundings
    # (the interpreter's cast truncates: 2^-7): ~2e-2 at most; a wrong norm, residual or gate is
    # of order 1.
    assert _rel(got_res, want_res) < 2e-2
    assert _rel(got, want) < 3e-2
