"""The Llama-style decoder layer's fused decode path (norms and SiLU folded into the GEMVs,
layers/norm_linear.py) against its unfused path, through the Triton interpreter.

On the CPU the route is off (the engine's parity tests run the unfused ops), so here it is
forced on: qkv_proj and gate_up_proj take dense_gemv with the norm prologue, o_proj and
down_proj the plain GEMV (interpreted on the CPU, compiled on a GPU); the layer is
layer_inputs.stub_layer, its attention a fixed map of qkv."""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels import dispatch
from homelab_llm.engine.model.llama import LlamaDecoderLayer
from tests.engine.kernels.layer_inputs import stub_layer


def _layer(act: str, bias: bool, qk_norm: bool) -> LlamaDecoderLayer:
    return stub_layer(64, 80, 4, 2, 16, 3, hidden_act=act, attention_bias=bias, qk_norm=qk_norm)


def _run(layer, hidden, residual, fused: bool, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    monkeypatch.setattr(dispatch, "dense_gemv_route", lambda x, w: fused)
    return layer(hidden, residual, None)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.float() - b.float()).norm(dim=1) / b.float().norm(dim=1)).max())


@pytest.mark.parametrize("rows,act,bias,qk_norm,first", [
    (1, "silu", False, False, True),     # the first layer: no residual yet
    (3, "silu", True, False, False),     # Qwen2-style qkv bias, 3 rows
    (2, "gelu_pytorch_tanh", False, True, False),  # Gemma's GELU MLP; Qwen3 q/k norms
])
def test_fused_layer_matches_unfused(rows, act, bias, qk_norm, first, monkeypatch, device: torch.device) -> None:
    layer = _layer(act, bias, qk_norm).to(device)
    gen = torch.Generator().manual_seed(rows)
    hidden = torch.randn(rows, 64, generator=gen).to(device, torch.bfloat16)
    residual = None if first else torch.randn(rows, 64, generator=gen).to(device, torch.bfloat16)
    want, want_res = _run(layer, hidden, residual, False, monkeypatch)
    got, got_res = _run(layer, hidden, residual, True, monkeypatch)
    # Row-relative bounds: the output passes 4 GEMVs (the residual 2), each result rounded to
    # bf16 by both paths, and the unfused path also rounds its normalized inputs and gate/up: a
    # few bf16 roundings (2^-8 each, the interpreter's cast truncates: 2^-7) compound to ~2e-2
    # at most; a wrong norm, residual, bias or gate is of order 1.
    assert _rel(got_res, want_res) < 2e-2
    assert _rel(got, want) < 3e-2
    assert layer.mlp.gated_act == ("silu" if act == "silu" else "gelu_tanh")
