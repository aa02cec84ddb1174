"""A Qwen3-MoE layer's MLP at batch 1 on the GPU path (interpreted): with the GEMV route
(kernels/moe_gemv.py: the norm in the router's and gate_up's launches) against the route off
(add_rms_norm, the fused router, fused_moe_decode), through model/llama.mlp_after_norm, and the
launches each takes.

Bound: row-relative 3e-2 on the output (the route keeps the normalized input and the picks'
products in fp32 where the other path rounds them to bf16, which the interpreter truncates:
2^-7 each); the new residual within one rounding (1e-2). A wrong expert or weight is of order 1.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

from homelab_llm.engine.kernels import dispatch
from homelab_llm.engine.layers.moe import SparseMoeBlock
from homelab_llm.engine.layers.norm import RMSNorm
from homelab_llm.engine.model.llama import mlp_after_norm
from tests.engine.kernels.launch_count import count_calls

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="counts launches through the Triton interpreter (CPU only)")


def _block(seed: int, shared: bool = False) -> tuple[SparseMoeBlock, RMSNorm]:
    torch.manual_seed(seed)
    shared_mlp = None
    if shared:
        from homelab_llm.engine.model.config import ModelConfig
        from homelab_llm.engine.model.llama import LlamaMLP

        shared_mlp = LlamaMLP(ModelConfig(architecture="qwen3_moe", vocab_size=8, hidden_size=64,
                                          intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=16, name="tiny"))
    block = SparseMoeBlock(64, 8, 2, 32, True, shared_mlp)
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        for module in (block, norm):
            for name, p in module.named_parameters():
                p.copy_(torch.rand_like(p) + 0.5 if "norm" in name or p.dim() == 1
                        else torch.randn_like(p) * p.shape[-1] ** -0.5)
    return block.to(torch.bfloat16), norm.to(torch.bfloat16)


def _run(block, norm, hidden, residual, route: bool, monkeypatch):
    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    monkeypatch.setattr(dispatch, "moe_gemv_route", lambda x, w13, w2: route)
    mlp_after_norm(hidden, residual, norm, block)  # first-use buffers (tickets) outside the count
    return count_calls(monkeypatch, lambda: mlp_after_norm(hidden, residual, norm, block))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.float() - b.float()).norm(dim=1) / b.float().norm(dim=1)).max())


@pytest.mark.parametrize("seed", [0, 1])
def test_moe_mlp_route_matches_and_saves_a_launch(seed, monkeypatch) -> None:
    block, norm = _block(seed)
    gen = torch.Generator().manual_seed(100 + seed)
    hidden = torch.randn(1, 64, generator=gen).to(torch.bfloat16)
    residual = torch.randn(1, 64, generator=gen).to(torch.bfloat16)
    off_counts, (want, want_res) = _run(block, norm, hidden, residual, False, monkeypatch)
    on_counts, (got, got_res) = _run(block, norm, hidden, residual, True, monkeypatch)
    assert _rel(got_res, want_res) < 1e-2
    assert _rel(got, want) < 3e-2
    assert off_counts == Counter({"triton._rms_norm_kernel": 1, "triton._route_gate_kernel": 1,
                                  "triton._moe_decode_up_kernel": 1,
                                  "triton._moe_decode_down_kernel": 1}), off_counts
    assert on_counts == Counter({"triton._route_gate_kernel": 1,
                                 "triton._dense_gemv_kernel": 2}), on_counts


def test_shared_expert_keeps_the_separate_norm(monkeypatch) -> None:
    block, norm = _block(2, shared=True)
    monkeypatch.setattr(dispatch, "moe_gemv_route", lambda x, w13, w2: True)
    x = torch.randn(1, 64).to(torch.bfloat16)
    assert block.after_norm(x, x, norm) is None


def test_route_needs_a_gpu_and_the_table_or_the_switch(monkeypatch) -> None:
    w13 = torch.zeros(4, 64, 32, dtype=torch.bfloat16)
    w2 = torch.zeros(4, 32, 32, dtype=torch.bfloat16)
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    assert not dispatch.moe_gemv_route(x, w13, w2)  # the CPU
    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    monkeypatch.delenv("HOMELAB_LLM_MOE_GEMV", raising=False)
    assert not dispatch.moe_gemv_route(x, w13, w2)  # the interpreter's table row: off
    monkeypatch.setenv("HOMELAB_LLM_MOE_GEMV", "1")
    assert dispatch.moe_gemv_route(x, w13, w2)
    assert not dispatch.moe_gemv_route(torch.zeros(2, 32, dtype=torch.bfloat16), w13, w2)
    assert not dispatch.moe_gemv_route(x.float(), w13, w2)
    monkeypatch.setenv("HOMELAB_LLM_MOE_GEMV", "0")
    assert not dispatch.moe_gemv_route(x, w13, w2)
