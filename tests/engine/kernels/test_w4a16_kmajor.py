"""The K-major W4A16 GEMV (kernels/w4a16_kmajor.py, a candidate the engine does not route to yet)
against the dequantized fp64 reference.

Error bound, per output row relative to the reference: every product and sum is fp32 (nibbles and
pre-scales are exact), so ~sqrt(K) 2^-24 of the row's magnitude before the output's rounding:
1e-5 with an fp32 output, 1e-2 with bf16 (2^-8 per element). A wrong nibble, group, column or
split gives > 0.1.
"""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels import w4a16_pack as wp
from homelab_llm.engine.kernels.ref import dequantize_w4_ref

FP32_BOUND, BF16_BOUND = 1e-5, 1e-2

# (K, N, group, block_n, split, symmetric, x dtype): odd N (a partial column block), K that does
# not fill the K step (masked words, groups past K clamped), 3 and 5 splits (uneven last split,
# the ticket reduction), groups 32/64/128, asymmetric biases, fp16 activations.
CASES = [
    (256, 96, 128, 1, None, True, torch.bfloat16),
    (384, 67, 64, 2, 3, False, torch.float16),
    (1280, 33, 128, 4, 5, False, torch.bfloat16),
    (512, 40, 32, 4, 1, True, torch.bfloat16),
    (96, 9, 32, 2, None, False, torch.float16),
]


def _case(k: int, n: int, group: int, symmetric: bool, dtype: torch.dtype, device: torch.device):
    gen = torch.Generator().manual_seed(k * 7 + n + group)
    w = wp.quantize_rtn(torch.randn(n, k, generator=gen) * 0.05, group, symmetric).to(device)
    x = torch.randn(1, k, generator=gen).to(device, dtype)
    return w, x, x.double() @ dequantize_w4_ref(w).double()


def _row_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.double() - want).norm(dim=1) / want.norm(dim=1)).max())


@pytest.mark.parametrize("k,n,group,block_n,split,symmetric,dtype", CASES)
def test_kmajor_matches_reference(k, n, group, block_n, split, symmetric, dtype, device) -> None:
    from homelab_llm.engine.kernels.w4a16_kmajor import to_kmajor, w4a16_kmajor

    w, x, want = _case(k, n, group, symmetric, dtype, device)
    wk = to_kmajor(w)
    for _ in range(2):  # the second call finds the tickets reset
        got = w4a16_kmajor(x, wk, torch.empty((1, n), dtype=torch.float32, device=device),
                           block_n=block_n, num_warps=1, split=split)
        assert _row_rel_err(got, want) < FP32_BOUND
    got = w4a16_kmajor(x, wk, torch.empty((1, n), dtype=dtype, device=device), block_n=block_n,
                       num_warps=1, split=split)
    assert _row_rel_err(got, want) < BF16_BOUND


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
