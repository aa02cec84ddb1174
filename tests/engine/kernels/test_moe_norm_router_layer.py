"""A Qwen3-MoE layer's MLP at batch 1 on the GPU path (interpreted), through
model/llama.mlp_after_norm: the norm inside the router's launch (route_gate_topk_norm, then
fused_moe_decode on the rows it writes) against the separate ops (add_rms_norm, the fused
router, fused_moe_decode), and the launches each takes; also with a shared expert.

Bound: row-relative 3e-2 on the output (the rows the router normalizes match add_rms_norm's
within an ulp, its squares summed in another order, and the interpreter's bf16 casts truncate:
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


def _run(block, norm, hidden, residual, path: str, monkeypatch):
    """path: "separate" (the norm launch first) or "router" (the norm in the router)."""
    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    if path == "separate":
        monkeypatch.setattr(dispatch, "router_norm_route", lambda x: False)
    mlp_after_norm(hidden, residual, norm, block)  # first-use buffers (tickets) outside the count
    result = count_calls(monkeypatch, lambda: mlp_after_norm(hidden, residual, norm, block))
    monkeypatch.undo()
    return result


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.float() - b.float()).norm(dim=1) / b.float().norm(dim=1)).max())


SEPARATE = Counter({"triton._rms_norm_kernel": 1, "triton.route_gate_kernel": 1,
                    "triton._moe_decode_up_kernel": 1, "triton._moe_decode_down_kernel": 1})


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + seed)
    return (torch.randn(1, 64, generator=gen).to(torch.bfloat16),
            torch.randn(1, 64, generator=gen).to(torch.bfloat16))


@pytest.mark.parametrize("seed", [0, 1])
def test_moe_mlp_norm_folded_matches_and_saves_a_launch(seed, monkeypatch) -> None:
    block, norm = _block(seed)
    hidden, residual = _inputs(seed)
    off_counts, (want, want_res) = _run(block, norm, hidden, residual, "separate", monkeypatch)
    on_counts, (got, got_res) = _run(block, norm, hidden, residual, "router", monkeypatch)
    assert _rel(got_res, want_res) < 1e-2
    assert _rel(got, want) < 3e-2
    assert off_counts == SEPARATE, off_counts
    assert on_counts == Counter({"triton.route_gate_kernel": 1, "triton._moe_decode_up_kernel": 1,
                                 "triton._moe_decode_down_kernel": 1}), on_counts


def test_shared_expert_takes_the_router_norm(monkeypatch) -> None:
    """Qwen3.5-MoE / Qwen3-Next: the shared expert reads the router's normalized rows; its
    gate rides in the router's launch, its output in the experts' combine."""
    block, norm = _block(2, shared=True)
    hidden, residual = _inputs(2)
    off_counts, (want, want_res) = _run(block, norm, hidden, residual, "separate", monkeypatch)
    on_counts, (got, got_res) = _run(block, norm, hidden, residual, "router", monkeypatch)
    assert _rel(got_res, want_res) < 1e-2
    assert _rel(got, want) < 3e-2
    assert "triton._dense_gemv_kernel" in on_counts  # the shared expert's GEMVs
    assert sum(on_counts.values()) == sum(off_counts.values()) - 1
    assert off_counts["triton._rms_norm_kernel"] == 1 and "triton._rms_norm_kernel" not in on_counts
    assert on_counts["triton._moe_decode_down_kernel"] == 1


def test_router_norm_route_is_gpu_decode_only(monkeypatch) -> None:
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    assert not dispatch.router_norm_route(x)
    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    assert dispatch.router_norm_route(x)
    assert not dispatch.router_norm_route(torch.zeros(9, 64, dtype=torch.bfloat16))
