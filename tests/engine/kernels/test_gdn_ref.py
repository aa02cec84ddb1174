"""The Gated DeltaNet torch references (kernels/gdn_ref.py) against transformers' Qwen3.5 torch
functions, and the public front (kernels/gdn.py) on the CPU.

Everything is fp32, so the bounds are tight: 1e-4 absolute on outputs of order 1 (the chunked and
the token-by-token forms differ only in summation order; 64-token chunks with a strongly decaying
state keep the gap below 1e-5 in practice).
"""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels import gdn, gdn_ref
from tests.engine.kernels.gdn_inputs import cu_seqlens, rule_inputs

qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

ATOL = 1e-4


def _hf_rule(fn, q, k, v, g, beta, init_state):
    # The model repeats q and k up to the value heads before calling the rule (older releases of
    # the function take only equal head counts, as the GPU machine's transformers does).
    rep = v.shape[-2] // q.shape[-2]
    q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    o, s = fn(q[None], k[None], v[None], g[None], beta[None], initial_state=init_state,
              output_final_state=True, use_qk_l2norm_in_kernel=True)
    return o[0], s[0]


@pytest.mark.parametrize("lens,hk,hv,dk,dv", [
    ([1, 37, 64, 130], 2, 6, 16, 32),    # GQA 3, chunk-crossing, not multiples of 64
    ([70, 5], 2, 2, 32, 16),             # no GQA
    ([150], 1, 3, 128, 128),             # Qwen3.6 head dims
])
def test_prefill_matches_transformers(lens, hk, hv, dk, dv) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta, cu, state, slots, init = rule_inputs(lens, hk, hv, dk, dv, gen)
    before = state.clone()
    out = gdn_ref.gated_delta_rule_prefill_ref(q, k, v, g, beta, cu, state, slots, init)
    steps_state = before.clone()
    steps = gdn_ref.gated_delta_rule_steps_ref(q, k, v, g, beta, cu, steps_state, slots, init)
    for b, (s, e) in enumerate(gdn_ref.seq_bounds(cu)):
        slot = int(slots[b])
        s0 = before[slot][None] if init[b] else None
        for fn in (qwen.torch_chunk_gated_delta_rule, qwen.torch_recurrent_gated_delta_rule):
            o, s_end = _hf_rule(fn, q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], s0)
            torch.testing.assert_close(out[s:e], o, atol=ATOL, rtol=ATOL)
            torch.testing.assert_close(state[slot], s_end, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(out, steps, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(state, steps_state, atol=ATOL, rtol=ATOL)
    untouched = [i for i in range(state.shape[0]) if i not in slots.tolist()]
    assert torch.equal(state[untouched], before[untouched])


def test_decode_matches_transformers() -> None:
    gen = torch.Generator().manual_seed(1)
    hk, hv, dk, dv = 2, 6, 16, 32
    q, k, v, g, beta, _, state, _, _ = rule_inputs([1] * 4, hk, hv, dk, dv, gen)
    slots = torch.tensor([3, -1, 0, 5], dtype=torch.int32)
    before = state.clone()
    out = gdn_ref.gated_delta_rule_decode_ref(q, k, v, g, beta, state, slots)
    for b, slot in enumerate(slots.tolist()):
        if slot < 0:
            assert torch.count_nonzero(out[b]) == 0
            continue
        o, s_end = _hf_rule(qwen.torch_recurrent_gated_delta_rule, q[b:b + 1], k[b:b + 1], v[b:b + 1],
                            g[b:b + 1], beta[b:b + 1], before[slot][None])
        torch.testing.assert_close(out[b], o[0], atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(state[slot], s_end, atol=ATOL, rtol=ATOL)
    for slot in (1, 2, 4):
        assert torch.equal(state[slot], before[slot])


def test_prefill_padding_row_touches_nothing() -> None:
    gen = torch.Generator().manual_seed(2)
    q, k, v, g, beta, cu, state, _, init = rule_inputs([9, 4, 20], 1, 2, 16, 16, gen)
    slots = torch.tensor([1, -1, 0], dtype=torch.int32)
    before = state.clone()
    out = gdn_ref.gated_delta_rule_prefill_ref(q, k, v, g, beta, cu, state, slots, init)
    assert torch.count_nonzero(out[9:13]) == 0
    assert torch.equal(state[2:], before[2:])


def _hf_conv(x, weight, bias, hist):
    """transformers' update path over a whole sequence: x [L, C], hist [W-1, C] -> (y, new hist)."""
    conv_state = hist.t().contiguous()[None]
    y = qwen.causal_conv1d_update(x.t()[None], conv_state, weight, bias, "silu")
    return y[0].t(), conv_state[0].t()


@pytest.mark.parametrize("with_bias", [False, True])
def test_conv_prefill_and_decode_match_transformers(with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    lens, c, w = [1, 2, 7, 40], 24, 4
    x = torch.randn(sum(lens), c, generator=gen)
    weight = torch.randn(c, w, generator=gen)
    bias = torch.randn(c, generator=gen) if with_bias else None
    conv_state = torch.randn(6, w - 1, c, generator=gen)
    slots = torch.tensor([4, 0, -1, 2], dtype=torch.int32)
    init = torch.tensor([True, False, True, True])
    cu = cu_seqlens(lens)
    before = conv_state.clone()
    y = gdn_ref.causal_conv1d_prefill_ref(x, weight, bias, cu, conv_state, slots, init)
    for b, (s, e) in enumerate(gdn_ref.seq_bounds(cu)):
        slot = int(slots[b])
        if slot < 0:
            assert torch.count_nonzero(y[s:e]) == 0
            continue
        hist = before[slot] if init[b] else torch.zeros(w - 1, c)
        want_y, want_hist = _hf_conv(x[s:e], weight, bias, hist)
        torch.testing.assert_close(y[s:e], want_y, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(conv_state[slot], want_hist, atol=0.0, rtol=0.0)
    for slot in (1, 3, 5):
        assert torch.equal(conv_state[slot], before[slot])

    xd = torch.randn(4, c, generator=gen)
    before = conv_state.clone()
    yd = gdn_ref.causal_conv1d_decode_ref(xd, weight, bias, conv_state, slots)
    for b, slot in enumerate(slots.tolist()):
        if slot < 0:
            assert torch.count_nonzero(yd[b]) == 0
            continue
        want_y, want_hist = _hf_conv(xd[b:b + 1], weight, bias, before[slot])
        torch.testing.assert_close(yd[b], want_y[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(conv_state[slot], want_hist, atol=0.0, rtol=0.0)


def test_gated_rms_norm_and_gating_match_transformers() -> None:
    gen = torch.Generator().manual_seed(4)
    n, d = 10, 32
    x, z = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    norm = qwen.Qwen3_5RMSNormGated(d, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d, generator=gen))
        want = norm(x, z)
    torch.testing.assert_close(gdn_ref.gated_rms_norm_ref(x, z, norm.weight, 1e-6), want, atol=1e-5, rtol=1e-5)

    a, b = torch.randn(n, 6, generator=gen) * 4, torch.randn(n, 6, generator=gen)
    a_log, dt_bias = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    g, beta = gdn_ref.gdn_gating_ref(a, b, a_log, dt_bias)
    torch.testing.assert_close(g, -a_log.exp() * torch.nn.functional.softplus(a + dt_bias))
    torch.testing.assert_close(beta, b.sigmoid())
    assert g.dtype == torch.float32
    assert gdn_ref.gdn_gating_ref(a, b.bfloat16(), a_log, dt_bias)[1].dtype == torch.bfloat16


def test_front_runs_the_references_on_cpu() -> None:
    gen = torch.Generator().manual_seed(5)
    q, k, v, g, beta, cu, state, slots, init = rule_inputs([5, 70], 1, 2, 16, 16, gen)
    s1, s2 = state.clone(), state.clone()
    got = gdn.gated_delta_rule_prefill(q, k, v, g, beta, cu, s1, slots, init)
    want = gdn_ref.gated_delta_rule_prefill_ref(q, k, v, g, beta, cu, s2, slots, init)
    assert torch.equal(got, want) and torch.equal(s1, s2)
    got = gdn.gated_delta_rule_decode(q[:2], k[:2], v[:2], g[:2], beta[:2], s1, slots)
    want = gdn_ref.gated_delta_rule_decode_ref(q[:2], k[:2], v[:2], g[:2], beta[:2], s2, slots)
    assert torch.equal(got, want) and torch.equal(s1, s2)


def test_front_rejects_bad_shapes() -> None:
    gen = torch.Generator().manual_seed(6)
    q, k, v, g, beta, cu, state, slots, init = rule_inputs([5], 2, 6, 16, 16, gen)
    with pytest.raises(ValueError, match="value heads do not divide"):
        gdn.gated_delta_rule_prefill(q, k, v[:, :5], g[:, :5], beta[:, :5], cu, state[:, :5], slots, init)
    with pytest.raises(ValueError, match="ssm_state must be float32"):
        gdn.gated_delta_rule_prefill(q, k, v, g, beta, cu, state.bfloat16(), slots, init)
    with pytest.raises(ValueError, match="int32"):
        gdn.gated_delta_rule_prefill(q, k, v, g, beta, cu.long(), state, slots, init)
    with pytest.raises(ValueError, match="conv_state must be"):
        gdn.causal_conv1d_decode(torch.zeros(2, 8), torch.zeros(8, 4), None, torch.zeros(3, 4, 8), slots)
    with pytest.raises(ValueError, match=r"state_indices must be int32 \[2\]"):
        gdn.causal_conv1d_decode(torch.zeros(2, 8), torch.zeros(8, 4), None, torch.zeros(3, 3, 8), slots)
