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
from homelab_llm.engine.kernels.gdn_pending import PendingRows, state_word
from tests.engine.kernels.gdn_inputs import FULL_CONV_CHANNELS, cu_seqlens, pending_inputs


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


def test_rows_of_a_wider_projection_need_no_copy(device: torch.device) -> None:
    """x as the Gated DeltaNet layer passes it: the conv's columns of the fused projection (a
    strided view, its z columns beside them): the same outputs and states as a contiguous copy,
    for decode rows in verify groups (2 rows a sequence) and for prefill."""
    from homelab_llm.engine.kernels.gdn_conv import conv1d_decode, conv1d_prefill

    gen = torch.Generator().manual_seed(3)
    x, weight, bias, state, _, init = _inputs([3, 5], 40, 4, gen, torch.float32, device, True)
    wide = torch.randn(8, 40 + 24, generator=gen).to(device)
    wide[:, :40] = x
    view = wide[:, :40]
    assert not view.is_contiguous()
    cu = cu_seqlens([3, 5], device)
    slots = torch.tensor([0, 2], dtype=torch.int32, device=device)
    s_view, s_copy = state.clone(), state.clone()
    got = conv1d_prefill(view, weight, bias, cu, s_view, slots, init)
    torch.testing.assert_close(got, conv1d_prefill(x, weight, bias, cu, s_copy, slots, init),
                               atol=0, rtol=0)
    assert torch.equal(s_view, s_copy)
    words = torch.tensor([state_word(0, 1), 0, state_word(2, 2, 1), 2], dtype=torch.int32, device=device)
    pend = pending_inputs(4, 2, 1, 1, 4, 4, 40, gen, device=device)
    p_view, p_copy = pend, PendingRows(pend.d, pend.k, pend.u, pend.x.clone())
    got = conv1d_decode(wide[:4, :40], weight, bias, s_view, words, rows_per_seq=2, pending=p_view)
    want = conv1d_decode(x[:4].contiguous(), weight, bias, s_copy, words, rows_per_seq=2, pending=p_copy)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert torch.equal(s_view, s_copy) and torch.equal(p_view.x, p_copy.x)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP device")
def test_conv_full_shape() -> None:
    _check([8192, 1, 2, 500, 3000], FULL_CONV_CHANNELS, 4, torch.Generator().manual_seed(2), torch.bfloat16,
           torch.device("cuda"), False)
