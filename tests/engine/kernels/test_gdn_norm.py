"""Gated RMSNorm and the gating kernels (kernels/gdn_norm.py) against gdn_ref.

Bounds: fp32 1e-5 (same fp32 math); bf16 outputs one rounding, 1e-2 relative. Gating covers
softplus's linear branch (a + dt_bias > 20) and large negative inputs.
"""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels import gdn_ref


def _tol(dtype: torch.dtype) -> dict:
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,dim", [(37, 32), (5, 48)])
def test_gated_rms_norm(dtype, rows, dim, device: torch.device) -> None:
    from homelab_llm.engine.kernels.gdn_norm import gated_rms_norm

    gen = torch.Generator().manual_seed(0)
    x, z = (torch.randn(rows, dim, generator=gen).mul(3).to(device, dtype) for _ in range(2))
    w = torch.randn(dim, generator=gen).to(device, dtype)
    torch.testing.assert_close(gated_rms_norm(x, z, w, 1e-6), gdn_ref.gated_rms_norm_ref(x, z, w, 1e-6), **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gating(dtype, device: torch.device) -> None:
    from homelab_llm.engine.kernels.gdn_norm import gdn_gating

    gen = torch.Generator().manual_seed(1)
    a = (torch.randn(33, 6, generator=gen) * 15).to(device, dtype)
    b = (torch.randn(33, 6, generator=gen) * 5).to(device, dtype)
    a_log, dt_bias = torch.randn(6, generator=gen).to(device), torch.randn(6, generator=gen).to(device, dtype)
    g, beta = gdn_gating(a, b, a_log, dt_bias)
    want_g, want_beta = gdn_ref.gdn_gating_ref(a, b, a_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    torch.testing.assert_close(g, want_g, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(beta, want_beta, **_tol(dtype))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP device")
def test_full_shape() -> None:
    from homelab_llm.engine.kernels.gdn_norm import gated_rms_norm, gdn_gating

    gen = torch.Generator().manual_seed(2)
    dev = torch.device("cuda")
    x, z = (torch.randn(8192 * 48, 128, generator=gen).to(dev, torch.bfloat16) for _ in range(2))
    w = torch.randn(128, generator=gen).to(dev, torch.bfloat16)
    want = gdn_ref.gated_rms_norm_ref(x, z, w, 1e-6)
    torch.testing.assert_close(gated_rms_norm(x, z, w, 1e-6), want, **_tol(x.dtype))
    a, b = (torch.randn(8192, 48, generator=gen).to(dev, torch.bfloat16) for _ in range(2))
    a_log, dt_bias = torch.randn(48, generator=gen).to(dev), torch.randn(48, generator=gen).to(dev)
    for got, want in zip(gdn_gating(a, b, a_log, dt_bias), gdn_ref.gdn_gating_ref(a, b, a_log, dt_bias)):
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
