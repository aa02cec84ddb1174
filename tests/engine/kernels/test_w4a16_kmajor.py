"""The K-major W4A16 GEMV (kernels/w4a16_kmajor.py, a candidate the engine does not route to yet)
against the dequantized fp64 reference.

Error bounds, per output row relative to the reference. fp32 mode: every product and sum is fp32
(nibbles and pre-scales are exact), ~sqrt(K) 2^-24 of the row's magnitude: 1e-5. half2 mode: a
word's eight products and their pair sums are fp16 (2^-11 relative) on activations scaled per
group into (-2, 2), then fp32, as in the packed-half GEMV: 5e-3. A bf16 output adds 2^-8 per
element: 1e-2. A wrong nibble, pair, group scale, column or split gives > 0.1.
"""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels import w4a16_pack as wp
from homelab_llm.engine.kernels.ref import dequantize_w4_ref

BOUND = {False: 1e-5, True: 5e-3}  # fp32 output, by half2
BF16_BOUND = 1e-2

# (K, N, group, block_n, split, symmetric, x dtype): odd N (a partial column block), K that does
# not fill the K step (masked words, groups past K clamped), 3 and 5 splits (uneven last split,
# the ticket reduction), groups 32/64/128, asymmetric biases, fp16 activations.
CASES = [
    (256, 96, 128, 1, None, True, torch.bfloat16),
    (384, 67, 64, 2, 3, False, torch.float16),
    (1280, 33, 128, 4, 5, False, torch.bfloat16),
    (512, 40, 32, 4, 1, True, torch.bfloat16),
    (96, 9, 32, 2, None, False, torch.float16),
    (640, 70, 128, 16, 2, False, torch.bfloat16),
    (256, 21, 64, 8, None, True, torch.bfloat16),
]


def _case(k: int, n: int, group: int, symmetric: bool, dtype: torch.dtype, device: torch.device):
    gen = torch.Generator().manual_seed(k * 7 + n + group)
    w = wp.quantize_rtn(torch.randn(n, k, generator=gen) * 0.05, group, symmetric).to(device)
    x = torch.randn(1, k, generator=gen).to(device, dtype)
    return w, x, x.double() @ dequantize_w4_ref(w).double()


def _row_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.double() - want).norm(dim=1) / want.norm(dim=1)).max())


@pytest.mark.parametrize("half2", [False, True])
@pytest.mark.parametrize("k,n,group,block_n,split,symmetric,dtype", CASES)
def test_kmajor_matches_reference(k, n, group, block_n, split, symmetric, dtype, half2,
                                  device) -> None:
    from homelab_llm.engine.kernels.w4a16_kmajor import to_kmajor, w4a16_kmajor

    w, x, want = _case(k, n, group, symmetric, dtype, device)
    wk = to_kmajor(w)
    for _ in range(2):  # the second call finds the tickets reset
        got = w4a16_kmajor(x, wk, torch.empty((1, n), dtype=torch.float32, device=device),
                           block_n=block_n, num_warps=1, split=split, half2=half2)
        assert _row_rel_err(got, want) < BOUND[half2]
    got = w4a16_kmajor(x, wk, torch.empty((1, n), dtype=dtype, device=device), block_n=block_n,
                       num_warps=1, split=split, half2=half2)
    assert _row_rel_err(got, want) < BF16_BOUND


def test_kmajor_half2_keeps_outliers_and_tiny_groups(device) -> None:
    """Per-group scaling: a group of activations near fp16's limit next to a group near zero
    (each within its own bound), and an all-zero group (scale 0, no NaN)."""
    from homelab_llm.engine.kernels.w4a16_kmajor import to_kmajor, w4a16_kmajor

    w, x, _ = _case(512, 16, 128, False, torch.bfloat16, device)
    x = x.float()
    x[0, :128] *= 3e4
    x[0, 128:256] *= 1e-6
    x[0, 256:384] = 0.0
    x = x.to(torch.bfloat16)
    want = x.double() @ dequantize_w4_ref(w).double()
    got = w4a16_kmajor(x, to_kmajor(w), torch.empty((1, 16), dtype=torch.float32, device=device),
                       num_warps=1, half2=True)
    assert torch.isfinite(got).all() and _row_rel_err(got, want) < BOUND[True]


def test_kmajor_layout_is_the_transpose(device) -> None:
    from homelab_llm.engine.kernels.w4a16_kmajor import to_kmajor

    w, _, _ = _case(256, 24, 64, False, torch.bfloat16, device)
    wk = to_kmajor(w)
    assert (wk.in_features, wk.out_features) == (w.in_features, w.out_features)
    assert torch.equal(wk.qk, w.qweight.t()) and wk.qk.is_contiguous()
    assert torch.equal(wk.scales, w.scales.t()) and torch.equal(wk.biases, w.biases.t())


def test_kmajor_rejects_bad_calls(device) -> None:
    from homelab_llm.engine.kernels.w4a16_kmajor import to_kmajor, w4a16_kmajor

    w, x, _ = _case(128, 8, 32, True, torch.bfloat16, device)
    wk = to_kmajor(w)
    out = torch.empty((2, 8), dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match="one row"):
        w4a16_kmajor(x.expand(2, -1).contiguous(), wk, out)
    with pytest.raises(ValueError, match="block_n"):
        w4a16_kmajor(x, wk, out[:1], block_n=3)


def test_measurement_route_takes_one_row_calls(monkeypatch, device) -> None:
    """HOMELAB_LLM_W4A16_KMAJOR sends 1-row w4a16_matmul calls to the K-major kernel on a copy
    made once; more rows keep their route; a malformed value is a clear error."""
    from homelab_llm.engine.kernels import w4a16

    w, x, want = _case(256, 24, 64, False, torch.bfloat16, device)
    monkeypatch.setenv(w4a16.KMAJOR_ENV, "2,1")
    got = w4a16.w4a16_matmul(x, w)
    assert w.kmajor is not None and _row_rel_err(got, want) < BF16_BOUND
    copy = w.kmajor
    w4a16.w4a16_matmul(x, w)
    assert w.kmajor is copy
    two = torch.cat([x, x])
    assert _row_rel_err(w4a16.w4a16_matmul(two, w), torch.cat([want, want])) < BF16_BOUND
    monkeypatch.setenv(w4a16.KMAJOR_ENV, "eight")
    with pytest.raises(ValueError, match="BLOCK_N,WARPS"):
        w4a16.w4a16_matmul(x, w)
