"""Shared inputs for the MoE kernel tests: random stacked 4-bit experts and the error measure."""

from __future__ import annotations

import torch

from homelab_llm.engine.kernels.w4a16_pack import W4Weight


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative Frobenius error, in fp32."""
    return float((got.float() - want.float()).norm() / want.float().norm())


def random_moe_w4(gen, e, k, n, group, device) -> W4Weight:
    """E experts' [K, N] 4-bit weights: random words, scales ~0.05, biases near -8 * scale (so
    the dequantized weights are centred)."""
    qweight = torch.randint(-(2 ** 31), 2 ** 31, (e, k // 8, n), generator=gen,
                            dtype=torch.int64).to(torch.int32)
    scales = ((torch.rand(e, k // group, n, generator=gen) + 0.5) * 0.05).half()
    biases = (-8.0 * scales.float() + torch.randn(e, k // group, n, generator=gen) * 0.01).half()
    return W4Weight(qweight.to(device), scales.to(device), biases.to(device), group)
