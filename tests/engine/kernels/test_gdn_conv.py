"""The causal conv1d kernels (kernels/gdn_conv.py) against gdn_ref.causal_conv1d_*.

Bounds: fp32 1e-5 absolute (W products summed in another order); bf16 one output rounding,
1e-2 relative. The conv state is copied input values, so it must match exactly. Sequences
shorter than W-1, an empty one, a padding row (slot -1) and spare slots that must stay untouched
are in every case; the `gpu` test runs Qwen3.6-27B's 10240 channels on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels import gdn_ref
from tests.engine.kernels.gdn_inputs import FULL_CONV_CHANNELS, cu_seqlens


def _inputs(lens, channels, width, gen, dtype, device, with_bias):
    x = torch.randn(sum(lens), channels, generator=gen).to(device, dtype)
    weight = torch.randn(channels, width, generator=gen).to(device, dtype)
    bias = torch.randn(channels, generator=gen).to(device, dtype) if with_bias else None
    state = torch.randn(len(lens) + 2, width - 1, channels, generator=gen).to(device, dtype)
    slots = torch.tensor(list(range(len(lens)))[::-1], dtype=torch.int32, device=device)
    slots[len(lens) // 2] = -1
    init = torch.tensor([i % 2 == 0 for i in range(len(lens))], device=device)
    return x, weight, bias, state, slots, init


def _check(lens, channels, width, gen, dtype, device, with_bias) -> None:
    from homelab_llm.engine.kernels.gdn_conv import conv1d_decode, conv1d_prefill

    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    x, weight, bias, state, slots, init = _inputs(lens, channels, width, gen, dtype, device, with_bias)
    want_state = state.clone()
    cu = cu_seqlens(lens, device)
    want = gdn_ref.causal_conv1d_prefill_ref(x, weight, bias, cu, want_state, slots, init)
    got = conv1d_prefill(x, weight, bias, cu, state, slots, init)
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(state, want_state)

    xd = torch.randn(len(lens), channels, generator=gen).to(device, dtype)
    want = gdn_ref.causal_conv1d_decode_ref(xd, weight, bias, want_state, slots)
    got = conv1d_decode(xd, weight, bias, state, slots)
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(state, want_state)


@pytest.mark.parametrize("dtype,with_bias,width", [(torch.float32, False, 4), (torch.float32, True, 3),
                                                   (torch.bfloat16, False, 4)])
def test_conv_matches_reference(dtype, with_bias, width, device: torch.device) -> None:
    _check([1, 2, 0, 7, 40, 3], 48, width, torch.Generator().manual_seed(0), dtype, device, with_bias)


def test_split_prefill_equals_one_shot(device: torch.device) -> None:
    from homelab_llm.engine.kernels.gdn_conv import conv1d_prefill

    gen = torch.Generator().manual_seed(1)
    x, weight, _, state, _, _ = _inputs([21], 40, 4, gen, torch.float32, device, False)
    slots = torch.tensor([1], dtype=torch.int32, device=device)
    s_one, s_two = state.clone(), state.clone()
    no_history = torch.tensor([False], device=device)
    whole = conv1d_prefill(x, weight, None, cu_seqlens([21], device), s_one, slots, no_history)
    parts = [conv1d_prefill(x[a:b], weight, None, cu_seqlens([b - a], device), s_two, slots,
                            torch.tensor([a > 0], device=device)) for a, b in ((0, 2), (2, 3), (3, 21))]
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-6, rtol=1e-6)
    assert torch.equal(s_one, s_two)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP device")
def test_conv_full_shape() -> None:
    _check([8192, 1, 2, 500, 3000], FULL_CONV_CHANNELS, 4, torch.Generator().manual_seed(2), torch.bfloat16,
           torch.device("cuda"), False)
