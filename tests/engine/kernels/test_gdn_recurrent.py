"""The fused decode step (kernels/gdn_recurrent.py) against gdn_ref.gated_delta_rule_decode_ref,
and N decode steps against one prefill of the same N tokens.

Bounds (rel_err, see gdn_inputs): fp32 1e-5 per step (same fp32 math, different summation
order); bf16 inputs 1e-2 (output rounding only: the state stays fp32); N steps vs the chunked
prefill 1e-4 in fp32 (1e-2 on a GPU, where the chunked kernel's fp32 dots are tf32).
"""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels import gdn_ref
from tests.engine.kernels.gdn_inputs import (
    FULL_RULE, cu_seqlens, pending_inputs, pending_words, rel_err, rule_inputs,
)


def _verify_words(slots: list[int], rows: int, hk: int, hv: int, dk: int, dv: int, gen: torch.Generator,
                  device: torch.device):
    """(state words, pending areas) for decode rows in groups of `rows` (no areas for 1 row):
    random pending counts and halves (kernels/gdn_pending.py)."""
    if rows == 1:
        return torch.tensor(slots, dtype=torch.int32, device=device), None
    pend = pending_inputs(8, rows, hk, hv, dk, dv, 4, gen, device=device)
    return torch.tensor(pending_words(slots, rows, rows, gen), dtype=torch.int32, device=device), pend


def _copy(pend):
    from homelab_llm.engine.kernels.gdn_pending import PendingRows

    return None if pend is None else PendingRows(*(t.clone() for t in (pend.d, pend.k, pend.u, pend.x)))


def _check(batch, dims, gen, device, dtype, slots) -> None:
    from homelab_llm.engine.kernels.gdn_recurrent import recurrent_gated_delta_rule

    q, k, v, g, beta, _, state, slots_t, _ = rule_inputs([1] * batch, **dims, gen=gen, slots=slots,
                                                         dtype=dtype, device=device)
    want_state = state.clone()
    want = gdn_ref.gated_delta_rule_decode_ref(q, k, v, g, beta, want_state, slots_t)
    got = recurrent_gated_delta_rule(q, k, v, g, beta, state, slots_t)
    bound = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(got, want) <= bound and rel_err(state, want_state) <= 1e-5
    for b, slot in enumerate(slots):
        if slot < 0:
            assert torch.count_nonzero(got[b]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_reference(dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    _check(4, dict(hk=2, hv=6, dk=16, dv=32), gen, device, dtype, slots=[3, -1, 0, 5])
    _check(2, dict(hk=1, hv=1, dk=24, dv=40), gen, device, dtype, slots=[1, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_per_seq", [1, 3])
def test_gating_in_the_kernel(dtype: torch.dtype, rows_per_seq: int, device: torch.device) -> None:
    """gating=(A_log, dt_bias): the raw a and b (strided columns of one in_proj_ba row, as the
    model passes them) gated in the decode kernel == gdn_gating_ref then the decode reference,
    plain decode and a verify group of 3. a spans softplus's linear branch (x > 20) too. The
    gating is the gating kernel's formula in fp32; bounds below."""
    from homelab_llm.engine.kernels.gdn_recurrent import recurrent_gated_delta_rule

    gen = torch.Generator().manual_seed(4)
    hv, dims = 6, dict(hk=2, hv=6, dk=16, dv=32)
    slots = [3, 1, 0, -1, 5, 4] if rows_per_seq == 3 else [3, -1, 0, 5]
    q, k, v, _, _, _, state, _, _ = rule_inputs([1] * len(slots), **dims, gen=gen, slots=slots,
                                                dtype=dtype, device=device)
    slots_t, pend = _verify_words(slots, rows_per_seq, **dims, gen=gen, device=device)
    want_pend = _copy(pend)
    ba = torch.randn(len(slots), 2 * hv, generator=gen) * 3
    ba[0, hv:] += 25.0  # softplus(x) == x past 20
    ba = ba.to(device, dtype)
    b, a = ba[:, :hv], ba[:, hv:]
    a_log = torch.randn(hv, generator=gen).to(device)
    dt_bias = torch.randn(hv, generator=gen).to(device)
    want_state = state.clone()
    g, beta = gdn_ref.gdn_gating_ref(a, b, a_log, dt_bias)
    want = gdn_ref.gated_delta_rule_decode_ref(q, k, v, g, beta, want_state, slots_t, rows_per_seq=rows_per_seq,
                                               pending=want_pend)
    got = recurrent_gated_delta_rule(q, k, v, a, b, state, slots_t, rows_per_seq=rows_per_seq,
                                     gating=(a_log, dt_bias), pending=pend)
    # bf16: beta is rounded to b's dtype on both sides, a cast the interpreter truncates where a
    # GPU and torch round to nearest (one bf16 ulp of beta: ~4e-3 in the state).
    bound = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(got, want) <= bound and rel_err(state, want_state) <= bound
    if pend is not None:
        assert rel_err(pend.u, want_pend.u) <= bound and rel_err(pend.d, want_pend.d) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_per_seq,dv", [(1, 32), (3, 32), (1, 40)])
def test_gated_norm_in_the_kernel(dtype: torch.dtype, rows_per_seq: int, dv: int,
                                  device: torch.device) -> None:
    """gated_norm=(z, weight, eps): the last value-block program of each head normalizes the
    head's stored rows (rmsnorm * weight * silu(z)) == the decode then gdn_norm's gated norm
    kernel on its output, bit for bit up to the norm's sum order; plain decode, a verify group
    of 3 with a padding row, a head of 40 (not a power of two, two value blocks); padding rows
    stay zero. z is a strided view, as the layer passes it; run twice (the tickets reset)."""
    from homelab_llm.engine.kernels.gdn_norm import gated_rms_norm
    from homelab_llm.engine.kernels.gdn_recurrent import recurrent_gated_delta_rule

    gen = torch.Generator().manual_seed(9 + dv)
    hv, dims = 6, dict(hk=2, hv=6, dk=16, dv=dv)
    slots = [3, 1, -1, 0, 2, 4] if rows_per_seq == 3 else [3, -1, 0, 5]
    q, k, v, g, beta, _, state, _, _ = rule_inputs([1] * len(slots), **dims, gen=gen,
                                                   slots=slots, dtype=dtype, device=device)
    slots_t, pend = _verify_words(slots, rows_per_seq, **dims, gen=gen, device=device)
    zz = (torch.randn(len(slots), 2 * hv * dv, generator=gen) * 2).to(device, dtype)
    z = zz[:, hv * dv:].view(len(slots), hv, dv)  # the z half of a wider projection row
    w = (torch.rand(dv, generator=gen) + 0.5).to(device, dtype)
    for _ in range(2):
        s_sep, s_fused = state.clone(), state.clone()
        o = recurrent_gated_delta_rule(q, k, v, g, beta, s_sep, slots_t, rows_per_seq=rows_per_seq,
                                       pending=_copy(pend))
        want = gated_rms_norm(o.reshape(-1, dv), z.reshape(-1, dv), w, 1e-6).view(o.shape)
        got = recurrent_gated_delta_rule(q, k, v, g, beta, s_fused, slots_t,
                                         rows_per_seq=rows_per_seq, gated_norm=(z, w, 1e-6), pending=_copy(pend))
        assert torch.equal(s_fused, s_sep)
        torch.testing.assert_close(got, want, rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-6)
        for b, slot in enumerate(slots):
            if slot < 0:
                assert torch.count_nonzero(got[b]) == 0
    # the reference composition (the CPU's path through gdn.gated_delta_rule_decode)
    ref_state = state.clone()
    ref = gdn_ref.gated_rms_norm_ref(
        gdn_ref.gated_delta_rule_decode_ref(q, k, v, g, beta, ref_state, slots_t,
                                            rows_per_seq=rows_per_seq, pending=_copy(pend)).reshape(-1, dv),
        z.reshape(-1, dv), w, 1e-6).view(got.shape)
    assert rel_err(got, ref) <= (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("hv,dv,pair_block", [(2, 128, 128), (2, 128, 64), (4, 32, 128)])
def test_gated_norm_writes_pair_order(hv: int, dv: int, pair_block: int, device: torch.device,
                                      monkeypatch) -> None:
    """pair_block: the output rows are pair_order(the k-order output) bit for bit (the same
    values, only stored elsewhere): the norm's store permutes each head's values where the
    step divides Dv (one step a head, two a head), a reorder after it where a step spans heads,
    and past the ticket counters; a verify group of 3 with a padding row; the state the same.
    Without the gated norm, a clear error."""
    from homelab_llm.engine.kernels import gdn, gdn_recurrent
    from homelab_llm.engine.kernels.pair_order import pair_order

    gen = torch.Generator().manual_seed(31 + dv + pair_block)
    slots = [3, 1, -1, 0, 2, 4]
    q, k, v, g, beta, _, state, _, _ = rule_inputs([1] * len(slots), hk=2, hv=hv, dk=16, dv=dv, gen=gen,
                                                   slots=slots, dtype=torch.bfloat16, device=device)
    slots_t, pend = _verify_words(slots, 3, hk=2, hv=hv, dk=16, dv=dv, gen=gen, device=device)
    z = (torch.randn(v.shape, generator=gen) * 2).to(device, torch.bfloat16)
    norm = (z, (torch.rand(dv, generator=gen) + 0.5).to(device, torch.bfloat16), 1e-6)
    k_state = state.clone()
    want = gdn_recurrent.recurrent_gated_delta_rule(q, k, v, g, beta, k_state, slots_t, rows_per_seq=3,
                                                    gated_norm=norm, pending=_copy(pend))
    want = pair_order(want.reshape(len(slots), hv * dv), pair_block)
    for max_blocks in (gdn_recurrent.MAX_BLOCKS, 1):
        monkeypatch.setattr(gdn_recurrent, "MAX_BLOCKS", max_blocks)
        got_state = state.clone()
        got = gdn_recurrent.recurrent_gated_delta_rule(q, k, v, g, beta, got_state, slots_t, rows_per_seq=3,
                                                       gated_norm=norm, pair_block=pair_block, pending=_copy(pend))
        assert got.shape == v.shape and torch.equal(got_state, k_state), max_blocks
        assert torch.equal(got.reshape(len(slots), hv * dv), want), max_blocks
    with pytest.raises(ValueError, match="gated norm"):
        gdn_recurrent.recurrent_gated_delta_rule(q, k, v, g, beta, state, slots_t, rows_per_seq=3,
                                                 pair_block=pair_block, pending=_copy(pend))
    # the dispatching entry (the reference composition on the CPU) keeps the same contract
    plain = gdn.gated_delta_rule_decode(q, k, v, g, beta, state.clone(), slots_t, rows_per_seq=3,
                                        gated_norm=norm, pending=_copy(pend))
    paired = gdn.gated_delta_rule_decode(q, k, v, g, beta, state.clone(), slots_t, rows_per_seq=3,
                                         gated_norm=norm, pair_block=pair_block, pending=_copy(pend))
    assert torch.equal(paired.reshape(len(slots), hv * dv),
                       pair_order(plain.reshape(len(slots), hv * dv), pair_block))


@pytest.mark.parametrize("hv,dv,rows", [(2, 128, 3), (1, 256, 1), (4, 32, 1)])
def test_gated_norm_writes_mma_pairs(hv: int, dv: int, rows: int, device: torch.device, monkeypatch) -> None:
    """mma_pairs: the normed rows as the W4A16 mma kernel's pairs, bit for bit what its pairs'
    launch makes of the k-order output (the same bf16 values through the same arithmetic): from
    the norm's store where Dv is a power of two and whole groups of 128 (one group a head, two),
    through prep_pairs after it otherwise (Dv 32) and past the ticket counters; padding rows
    (slot -1) give zero pairs; the state the same. With pair order or without the norm, an error."""
    from homelab_llm.engine.kernels import gdn, gdn_recurrent
    from homelab_llm.engine.kernels.w4a16_mma import empty_pairs, prep_pairs

    gen = torch.Generator().manual_seed(41 + dv + rows)
    slots = [3, 1, -1, 0, 2, 4] if rows == 3 else [3, -1, 0, 2]
    q, k, v, g, beta, _, state, _, _ = rule_inputs([1] * len(slots), hk=1 if hv == 1 else 2, hv=hv, dk=16,
                                                   dv=dv, gen=gen, slots=slots, dtype=torch.bfloat16,
                                                   device=device)
    slots_t, pend = _verify_words(slots, rows, hk=1 if hv == 1 else 2, hv=hv, dk=16, dv=dv, gen=gen,
                                  device=device)
    z = (torch.randn(v.shape, generator=gen) * 2).to(device, torch.bfloat16)
    norm = (z, (torch.rand(dv, generator=gen) + 0.5).to(device, torch.bfloat16), 1e-6)
    k_state = state.clone()
    normed = gdn_recurrent.recurrent_gated_delta_rule(q, k, v, g, beta, k_state, slots_t, rows_per_seq=rows,
                                                      gated_norm=norm, pending=_copy(pend))
    m, width = len(slots), hv * dv
    want = prep_pairs(normed.reshape(m, width), 128)
    for max_blocks in (gdn_recurrent.MAX_BLOCKS, 1):
        monkeypatch.setattr(gdn_recurrent, "MAX_BLOCKS", max_blocks)
        got_state, pairs = state.clone(), empty_pairs(m, width, 128, device)
        for t in pairs:
            t.fill_(float("nan"))
        gdn_recurrent.recurrent_gated_delta_rule(q, k, v, g, beta, got_state, slots_t, rows_per_seq=rows,
                                                 gated_norm=norm, pending=_copy(pend), mma_pairs=pairs)
        assert torch.equal(got_state, k_state), max_blocks
        for got_t, want_t in zip(pairs, want):
            assert torch.equal(got_t, want_t), max_blocks
    pad = [i for i, s_ in enumerate(slots) if s_ < 0]
    assert not pairs[0][pad].any() and not pairs[1][pad].any()
    # the dispatching entry (the reference composition on the CPU) keeps the same contract
    plain = gdn.gated_delta_rule_decode(q, k, v, g, beta, state.clone(), slots_t, rows_per_seq=rows,
                                        gated_norm=norm, pending=_copy(pend))
    pairs = empty_pairs(m, width, 128, device)
    gdn.gated_delta_rule_decode(q, k, v, g, beta, state.clone(), slots_t, rows_per_seq=rows, gated_norm=norm,
                                pending=_copy(pend), mma_pairs=pairs)
    assert all(torch.equal(a, b) for a, b in zip(pairs, prep_pairs(plain.reshape(m, width), 128)))
    for bad in (dict(pair_block=128, gated_norm=norm), dict()):
        with pytest.raises(ValueError):
            gdn_recurrent.recurrent_gated_delta_rule(q, k, v, g, beta, state.clone(), slots_t, rows_per_seq=rows,
                                                     pending=_copy(pend), mma_pairs=pairs, **bad)


def test_steps_equal_prefill(device: torch.device) -> None:
    from homelab_llm.engine.kernels.gdn_chunk import chunk_gated_delta_rule
    from homelab_llm.engine.kernels.gdn_recurrent import recurrent_gated_delta_rule

    gen = torch.Generator().manual_seed(1)
    n = 20
    q, k, v, g, beta, cu, state, slots, init = rule_inputs([n], 2, 4, 16, 16, gen, slots=[2], has_init=[True],
                                                           device=device)
    s_pre = state.clone()
    want = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens([n], device), s_pre, slots, init)
    got = torch.cat([recurrent_gated_delta_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1],
                                                state, slots) for t in range(n)])
    bound = 1e-2 if device.type == "cuda" else 1e-4  # the chunked prefill's dots are tf32 on a GPU
    assert rel_err(got, want) <= bound and rel_err(state, s_pre) <= bound


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP device")
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_decode_full_shape(batch: int) -> None:
    slots = list(range(batch))[::-1]
    slots[batch // 2] = -1
    _check(batch, FULL_RULE, torch.Generator().manual_seed(2), torch.device("cuda"), torch.bfloat16, slots)


def test_gated_norm_past_the_ticket_counters(device: torch.device, monkeypatch) -> None:
    """More (group, head) pairs than the device's ticket counters: the decode runs plain and the
    gated norm as its own kernel, with the same result."""
    from homelab_llm.engine.kernels import gdn_recurrent

    gen = torch.Generator().manual_seed(2)
    q, k, v, g, beta, _, state, slots_t, _ = rule_inputs([1] * 3, hk=1, hv=2, dk=16, dv=16,
                                                         gen=gen, slots=[0, 1, 2], device=device)
    z = torch.randn(v.shape, generator=gen).to(device)
    w = torch.ones(16, device=device)
    want = gdn_recurrent.recurrent_gated_delta_rule(q, k, v, g, beta, state.clone(), slots_t,
                                                    gated_norm=(z, w, 1e-6))
    monkeypatch.setattr(gdn_recurrent, "MAX_BLOCKS", 4)  # 3 groups x 2 heads need 6
    got = gdn_recurrent.recurrent_gated_delta_rule(q, k, v, g, beta, state.clone(), slots_t,
                                                   gated_norm=(z, w, 1e-6))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
