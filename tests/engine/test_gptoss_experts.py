"""gpt-oss experts: the clamped SwiGLU against its formula (the fused kernel's biased and
clamped paths are checked against the reference in tests/engine/kernels/test_fused_moe.py)."""

from __future__ import annotations

import torch

from homelab_llm.engine.kernels.moe_gptoss_ref import clamped_swiglu_ref


def test_clamped_swiglu_formula() -> None:
    gate = torch.tensor([-9.0, 0.0, 2.0, 9.0])
    up = torch.tensor([-9.0, 1.0, 9.0, 0.5])
    got = clamped_swiglu_ref(gate, up, 1.702, 7.0)
    g = torch.tensor([-9.0, 0.0, 2.0, 7.0])
    u = torch.tensor([-7.0, 1.0, 7.0, 0.5])
    torch.testing.assert_close(got, (u + 1) * g * torch.sigmoid(1.702 * g))
