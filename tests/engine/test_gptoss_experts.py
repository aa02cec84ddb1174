"""gpt-oss experts: the graph-safe formulations (gathered, dense) against the per-expert loop
reference, and the clamped SwiGLU against its formula, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels.moe_gptoss_ref import (clamped_swiglu_ref, gptoss_experts_dense,
                                                      gptoss_experts_gathered, gptoss_experts_ref)


def test_clamped_swiglu_formula() -> None:
    gate = torch.tensor([-9.0, 0.0, 2.0, 9.0])
    up = torch.tensor([-9.0, 1.0, 9.0, 0.5])
    got = clamped_swiglu_ref(gate, up, 1.702, 7.0)
    g = torch.tensor([-9.0, 0.0, 2.0, 7.0])
    u = torch.tensor([-7.0, 1.0, 7.0, 0.5])
    torch.testing.assert_close(got, (u + 1) * g * torch.sigmoid(1.702 * g))


@pytest.mark.parametrize("fn", [gptoss_experts_gathered, gptoss_experts_dense])
@pytest.mark.parametrize("with_b2", [True, False])
def test_static_formulations_match_the_loop(fn, with_b2: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    e, h, i, t, k = 6, 32, 24, 5, 2
    x = torch.randn(t, h, generator=gen)
    w13, b13 = torch.randn(e, 2 * i, h, generator=gen), torch.randn(e, 2 * i, generator=gen)
    w2, b2 = torch.randn(e, h, i, generator=gen) * 0.2, torch.randn(e, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    weights = torch.softmax(torch.randn(t, k, generator=gen), -1)
    b2 = b2 if with_b2 else None
    want = gptoss_experts_ref(x, w13, b13, w2, b2, weights, ids, 1.702, 7.0)
    got = fn(x, w13, b13, w2, b2, weights, ids, 1.702, 7.0)
    # float32 throughout, sums in a different order: 1e-4 relative on O(10) values
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
