"""Decoder layers on their fused decode path (interpreted) against the same layers through the
separate ops, bf16 and W4A16, and the launches they save: Gemma 3 (input_layernorm inside
qkv_proj's GEMV, the pre-feedforward norm and GELU-tanh-and-mul inside the MLP's GEMVs) and a
Qwen3.5/3.6 hybrid's gated-attention layer (its input norm inside qkv_proj's GEMV). Attention
is replaced by a fixed map of qkv (attention has its own tests), as in layer_inputs.stub_layer.

Bounds (row-relative): the fused path keeps the normalized input and the gate/up products in
fp32 where the separate ops round them to bf16 (truncated in the interpreter: 2^-7 each), over 4
GEMVs and 2 post-sublayer norms: 3e-2 for the output, 2e-2 for the residual; a wrong norm
weight (Gemma's 1 + w), residual or activation is of order 1.
"""

from __future__ import annotations

import os

import pytest
import torch

from homelab_llm.engine.kernels import dispatch
from homelab_llm.engine.kernels import w4a16_pack as wp
from homelab_llm.engine.layers.linear import LinearBase
from homelab_llm.engine.model.config import ModelConfig
from homelab_llm.engine.model.gemma3 import Gemma3DecoderLayer
from tests.engine.kernels.launch_count import count_calls

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="counts launches through the Triton interpreter (CPU only)")

HIDDEN, HEADS, D = 64, 4, 16


def _gemma3() -> Gemma3DecoderLayer:
    config = ModelConfig(architecture="gemma3", vocab_size=64, hidden_size=HIDDEN,
                         intermediate_size=96, num_hidden_layers=1, num_attention_heads=HEADS,
                         num_key_value_heads=2, head_dim=D, qk_norm=True,
                         hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=D, name="tiny")
    return Gemma3DecoderLayer(config, 0)


def _qwen3_5_attention():
    from homelab_llm.engine.model.qwen3_5 import PartialRotary, Qwen3_5DecoderLayer

    config = ModelConfig(architecture="qwen3_5", vocab_size=64, hidden_size=HIDDEN,
                         intermediate_size=96, num_hidden_layers=1, num_attention_heads=HEADS,
                         num_key_value_heads=2, head_dim=D, layer_types=("full_attention",),
                         partial_rotary_factor=0.25, attn_output_gate=True, name="tiny")
    return Qwen3_5DecoderLayer(config, "full_attention", PartialRotary(config))


def _layer(w4: bool, make=_gemma3):
    torch.manual_seed(4)
    layer = make()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name
                    else torch.randn_like(p) * p.shape[-1] ** -0.5)
    layer = layer.to(torch.bfloat16)
    if w4:
        for module in layer.modules():
            if isinstance(module, LinearBase):
                module.set_w4(wp.quantize_rtn(module.weight.data, 32, False))
    attn = layer.self_attn

    q_cols = HEADS * D

    def attend(qkv: torch.Tensor, rope) -> torch.Tensor:  # stands in for rope + attention
        q = qkv[:, :q_cols] * 0.5 + qkv[:, -D:].repeat(1, HEADS)
        return attn.o_proj(q.contiguous())

    attn.attend = attend
    attn.forward = lambda hidden, rope: attend(attn.qkv_proj(hidden), rope)
    return layer


def _run(layer, hidden, residual, fused: bool, w4: bool, monkeypatch, call=None):
    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    monkeypatch.setattr(dispatch, "dense_gemv_route", lambda x, w: fused)
    monkeypatch.setattr(dispatch, "w4a16_prologue_route", lambda x, w: fused)
    if w4:  # the W4A16 linears a packed-half GEMV each, fused or not
        monkeypatch.setattr(dispatch, "w4a16_matmul", _h2_matmul)
    call = call or (lambda: layer(hidden, residual, None, None))
    call()  # first-use buffers (tickets) outside the count
    result = count_calls(monkeypatch, call)
    monkeypatch.undo()
    return result


def _h2_matmul(x: torch.Tensor, w) -> torch.Tensor:
    from homelab_llm.engine.kernels.w4a16_h2 import w4a16_h2

    return w4a16_h2(x.contiguous(), w, torch.empty((x.shape[0], w.out_features), dtype=x.dtype))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.float() - b.float()).norm(dim=1) / b.float().norm(dim=1)).max())


@pytest.mark.parametrize("w4", [False, True])
def test_gemma3_layer_fused_matches_separate_ops(w4: bool, monkeypatch) -> None:
    layer = _layer(w4)
    gen = torch.Generator().manual_seed(8 + w4)
    hidden = torch.randn(1, HIDDEN, generator=gen).to(torch.bfloat16)
    residual = torch.randn(1, HIDDEN, generator=gen).to(torch.bfloat16)
    off, (want, want_res) = _run(layer, hidden, residual, False, w4, monkeypatch)
    on, (got, got_res) = _run(layer, hidden, residual, True, w4, monkeypatch)
    assert _rel(got_res, want_res) < 2e-2
    assert _rel(got, want) < 3e-2
    # input norm (add + RMSNorm), pre-feedforward norm, GELU and its multiply: 4 launches fewer
    assert off["triton._rms_norm_kernel"] == 4 and on["triton._rms_norm_kernel"] == 2
    assert off["aten.gelu"] == 1 and "aten.gelu" not in on
    assert sum(on.values()) == sum(off.values()) - 4, (on, off)


@pytest.mark.parametrize("w4", [False, True])
def test_hybrid_attention_layer_input_norm_in_qkv(w4: bool, monkeypatch) -> None:
    """The 27B's gated-attention layers: input_layernorm (+ residual) inside qkv_proj's GEMV;
    its MLP's norm and SiLU as Llama's (mlp_after_norm)."""
    layer = _layer(w4, _qwen3_5_attention)
    gen = torch.Generator().manual_seed(18 + w4)
    hidden = torch.randn(1, HIDDEN, generator=gen).to(torch.bfloat16)
    residual = torch.randn(1, HIDDEN, generator=gen).to(torch.bfloat16)
    call = (lambda: layer(hidden, residual, None))
    off, (want, want_res) = _run(layer, hidden, residual, False, w4, monkeypatch, call)
    on, (got, got_res) = _run(layer, hidden, residual, True, w4, monkeypatch, call)
    assert _rel(got_res, want_res) < 2e-2
    assert _rel(got, want) < 3e-2
    assert off["triton._rms_norm_kernel"] == 2 and "triton._rms_norm_kernel" not in on
    assert sum(on.values()) == sum(off.values()) - 3, (on, off)  # 2 norms, SiLU-and-mul
