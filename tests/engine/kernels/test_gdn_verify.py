"""Verify-step decoding of the Gated DeltaNet kernels: groups of R = K+1 rows of one sequence
(rows_per_seq), the state after every row written to that row's slot.

- The references: a group of R rows equals R one-token decodes run one after another, and the
  slot of row j holds the state after j+1 of them (rule: fp32 1e-5 relative, see gdn_inputs.rel_err;
  conv: exact, the state is copied inputs).
- The Triton kernels (TRITON_INTERPRET on the CPU) against the references on fresh random inputs,
  with a padding group (slot -1) and padding rows past a short draft: fp32 rule 1e-5 relative,
  bf16 1e-2 (output rounding; the state stays fp32) and the state 1e-5; conv fp32 1e-5 absolute,
  bf16 1e-2, its state exactly.
"""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels import gdn_ref
from tests.engine.kernels.gdn_inputs import FULL_CONV_CHANNELS, FULL_RULE, rel_err, rule_inputs

# Two groups of R = 4 rows plus a padding group: group 0 verifies 3 drafts (slots 5, 0, 6, 2),
# group 1 only 1 (rows 2-3 are padding), group 2 is CUDA-graph padding.
SLOTS = [5, 0, 6, 2, 3, 7, -1, -1, -1, -1, -1, -1]
ROWS = 4


def _rule(dims: dict, gen: torch.Generator, dtype: torch.dtype, device: torch.device, slots=SLOTS):
    q, k, v, g, beta, _, state, idx, _ = rule_inputs([1] * len(slots), **dims, gen=gen, slots=slots,
                                                     dtype=dtype, device=device)
    return q, k, v, g, beta, torch.cat([state, state[:6] * 0.5]), idx  # room for slots up to 7


def test_reference_group_equals_steps() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta, state, idx = _rule(dict(hk=2, hv=4, dk=8, dv=16), gen, torch.float32, "cpu")
    grouped = state.clone()
    out = gdn_ref.gated_delta_rule_decode_ref(q, k, v, g, beta, grouped, idx, rows_per_seq=ROWS)
    for group in range(len(SLOTS) // ROWS):
        rows = SLOTS[group * ROWS:(group + 1) * ROWS]
        if rows[0] < 0:
            assert torch.count_nonzero(out[group * ROWS:(group + 1) * ROWS]) == 0
            continue
        walk = state.clone()
        one = torch.tensor([rows[0]], dtype=torch.int32)
        for j, slot in enumerate(rows):
            r = group * ROWS + j
            step = gdn_ref.gated_delta_rule_decode_ref(q[r:r + 1], k[r:r + 1], v[r:r + 1], g[r:r + 1],
                                                       beta[r:r + 1], walk, one)
            if slot < 0:
                assert torch.count_nonzero(out[r]) == 0
                continue
            assert rel_err(out[r:r + 1], step) <= 1e-5
            assert rel_err(grouped[slot], walk[rows[0]]) <= 1e-5


def test_conv_reference_group_equals_steps() -> None:
    gen = torch.Generator().manual_seed(1)
    channels, width = 12, 4
    x = torch.randn(len(SLOTS), channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    state = torch.randn(8, width - 1, channels, generator=gen)
    grouped = state.clone()
    y = gdn_ref.causal_conv1d_decode_ref(x, weight, None, grouped, torch.tensor(SLOTS, dtype=torch.int32),
                                         rows_per_seq=ROWS)
    for group in range(2):
        rows = SLOTS[group * ROWS:(group + 1) * ROWS]
        walk = state.clone()
        one = torch.tensor([rows[0]], dtype=torch.int32)
        for j, slot in enumerate(rows):
            r = group * ROWS + j
            step = gdn_ref.causal_conv1d_decode_ref(x[r:r + 1], weight, None, walk, one)
            if slot >= 0:
                torch.testing.assert_close(y[r:r + 1], step, atol=1e-6, rtol=1e-6)
                assert torch.equal(grouped[slot], walk[rows[0]])
    assert torch.count_nonzero(y[8:]) == 0 and torch.count_nonzero(y[6:8]) == 0


def _check_rule(dims, gen, dtype, device, slots=SLOTS, rows=ROWS) -> None:
    from homelab_llm.engine.kernels.gdn_recurrent import recurrent_gated_delta_rule

    q, k, v, g, beta, state, idx = _rule(dims, gen, dtype, device, slots)
    want_state = state.clone()
    want = gdn_ref.gated_delta_rule_decode_ref(q, k, v, g, beta, want_state, idx, rows_per_seq=rows)
    got = recurrent_gated_delta_rule(q, k, v, g, beta, state, idx, rows_per_seq=rows)
    bound = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(got, want) <= bound and rel_err(state, want_state) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recurrent_verify_matches_reference(dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(2)
    _check_rule(dict(hk=2, hv=6, dk=16, dv=32), gen, dtype, device)
    _check_rule(dict(hk=1, hv=2, dk=24, dv=40), gen, dtype, device, slots=[3, 1], rows=2)


def _check_conv(channels, width, gen, dtype, device, with_bias, slots=SLOTS, rows=ROWS) -> None:
    from homelab_llm.engine.kernels.gdn_conv import conv1d_decode

    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    x = torch.randn(len(slots), channels, generator=gen).to(device, dtype)
    weight = torch.randn(channels, width, generator=gen).to(device, dtype)
    bias = torch.randn(channels, generator=gen).to(device, dtype) if with_bias else None
    state = torch.randn(max(slots) + 2, width - 1, channels, generator=gen).to(device, dtype)
    idx = torch.tensor(slots, dtype=torch.int32, device=device)
    want_state = state.clone()
    want = gdn_ref.causal_conv1d_decode_ref(x, weight, bias, want_state, idx, rows_per_seq=rows)
    got = conv1d_decode(x, weight, bias, state, idx, rows_per_seq=rows)
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(state, want_state)


@pytest.mark.parametrize("dtype,with_bias,width", [(torch.float32, False, 4), (torch.float32, True, 3),
                                                   (torch.bfloat16, False, 4), (torch.float32, False, 2)])
def test_conv_verify_matches_reference(dtype, with_bias, width, device: torch.device) -> None:
    _check_conv(40, width, torch.Generator().manual_seed(3), dtype, device, with_bias)
    # more rows than the history: later rows' states come from x alone
    _check_conv(24, width, torch.Generator().manual_seed(4), dtype, device, with_bias,
                slots=[0, 4, 5, 6, 7, 8], rows=6)


def test_one_sequences_verify_takes_the_verify_tiles(monkeypatch) -> None:
    """GdnTiles.verify_*: a verify step of at most verify_groups sequences takes the narrower
    one-warp tiles, more sequences the verify_wide tiles, plain decode steps the decode tiles;
    an arch without them (0) keeps the decode tiles."""
    import dataclasses

    from homelab_llm.engine.kernels import tuning

    cpu = torch.device("cpu")
    t = tuning.gdn_tiles(cpu)
    verify, decode = (t.verify_block_v, t.verify_warps), (t.decode_block_v, t.decode_warps)
    assert t.verify_groups == 1 and verify != decode
    assert tuning.gdn_step_tiles(cpu, 1, 5) == verify and tuning.gdn_step_tiles(cpu, 1, 2) == verify
    wide = (t.verify_wide_block_v, t.verify_wide_warps)
    assert wide not in (verify, decode)
    assert tuning.gdn_step_tiles(cpu, 2, 5) == wide and tuning.gdn_step_tiles(cpu, 8, 2) == wide
    assert tuning.gdn_step_tiles(cpu, 1, 1) == decode and tuning.gdn_step_tiles(cpu, 8, 1) == decode
    monkeypatch.setitem(tuning.GDN_TABLE, "interpret",
                        dataclasses.replace(t, verify_groups=0, verify_wide_block_v=0))
    assert tuning.gdn_step_tiles(cpu, 1, 5) == decode and tuning.gdn_step_tiles(cpu, 8, 5) == decode


def test_group_size_must_divide_the_rows() -> None:
    from homelab_llm.engine.kernels import gdn

    x = torch.zeros(6, 8)
    with pytest.raises(ValueError, match="rows_per_seq=4"):
        gdn.causal_conv1d_decode(x, torch.zeros(8, 4), None, torch.zeros(2, 3, 8),
                                 torch.zeros(6, dtype=torch.int32), rows_per_seq=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP device")
def test_verify_full_shape() -> None:
    gen = torch.Generator().manual_seed(5)
    slots = list(range(40))
    slots[7] = slots[23] = -1
    _check_rule(FULL_RULE, gen, torch.bfloat16, torch.device("cuda"), slots=slots, rows=5)
    for groups in (1, 3):  # few sequences: the table's verify tiles (GdnTiles.verify_*)
        _check_rule(FULL_RULE, gen, torch.bfloat16, torch.device("cuda"), slots=slots[:5 * groups], rows=5)
    _check_conv(FULL_CONV_CHANNELS, 4, gen, torch.bfloat16, torch.device("cuda"), False, slots=slots, rows=5)
