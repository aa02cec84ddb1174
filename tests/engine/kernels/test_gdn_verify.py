"""Verify-step decoding of the Gated DeltaNet kernels: groups of R = K+1 rows of one sequence
(rows_per_seq) whose rows stay pending in the layer's areas (kernels/gdn_pending.py) until the
next decode of the slot applies as many of them as the host kept.

- The trajectory: sequences that verify random drafts, keep a random number of them, and now and
  then decode one plain row, output for every kept row what one-token decodes of the same stream
  output, and after their last step (pending rows applied) hold the same states: rule fp32 1e-5
  relative (see gdn_inputs.rel_err), conv outputs 1e-6 and its state exactly (copied inputs). The
  references, and the Triton kernels (TRITON_INTERPRET on the CPU) the same way.
- The Triton kernels against the references on fresh random states, pending areas and state
  words (random pending counts and halves), with a padding group and padding rows: fp32 rule
  1e-5 relative, bf16 outputs 1e-2 (output rounding; the state stays fp32), every state and area
  1e-5; conv fp32 1e-5 absolute, bf16 1e-2, its state and pending inputs exactly.
"""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels import gdn_ref
from homelab_llm.engine.kernels.gdn_pending import PendingRows, replay_slot, split_word, state_word
from tests.engine.kernels.gdn_inputs import (
    FULL_CONV_CHANNELS, FULL_RULE, pending_inputs, pending_words, rel_err, rule_inputs,
)

ROWS = 4
DIMS = dict(hk=2, hv=4, dk=8, dv=16)


def _ref_rule(q, k, v, g, beta, state, idx, rows_per_seq, pending):
    return gdn_ref.gated_delta_rule_decode_ref(q, k, v, g, beta, state, idx, None, rows_per_seq, pending)


def _ref_conv(x, weight, conv_state, idx, rows_per_seq, pending):
    return gdn_ref.causal_conv1d_decode_ref(x, weight, None, conv_state, idx, rows_per_seq, pending)


def _triton_rule(q, k, v, g, beta, state, idx, rows_per_seq, pending):
    from homelab_llm.engine.kernels.gdn_recurrent import recurrent_gated_delta_rule

    return recurrent_gated_delta_rule(q, k, v, g, beta, state, idx, rows_per_seq=rows_per_seq, pending=pending)


def _triton_conv(x, weight, conv_state, idx, rows_per_seq, pending):
    from homelab_llm.engine.kernels.gdn_conv import conv1d_decode

    return conv1d_decode(x, weight, None, conv_state, idx, rows_per_seq, pending)


class _Streams:
    """Three sequences' token inputs, the plain one-token decode of each (outputs and the state
    after every token), and a state pool with their slots."""

    def __init__(self, seed: int, length: int = 40, channels: int = 12, width: int = 4) -> None:
        gen = torch.Generator().manual_seed(seed)
        hk, hv, dk, dv = DIMS["hk"], DIMS["hv"], DIMS["dk"], DIMS["dv"]
        n = 3
        self.slots = [2, 0, 3]
        self.q = torch.randn(n, length, hk, dk, generator=gen)
        self.k = torch.randn(n, length, hk, dk, generator=gen)
        self.v = torch.randn(n, length, hv, dv, generator=gen)
        self.g = -(torch.rand(n, length, hv, generator=gen) * 2 + 0.02)
        self.beta = torch.rand(n, length, hv, generator=gen)
        self.x = torch.randn(n, length, channels, generator=gen)
        self.weight = torch.randn(channels, width, generator=gen)
        self.state = torch.randn(5, hv, dk, dv, generator=gen) * 0.5
        self.conv = torch.randn(5, width - 1, channels, generator=gen)
        self.o, self.y, self.states, self.convs = [], [], [], []
        for s, slot in enumerate(self.slots):
            st, cv, one = self.state.clone(), self.conv.clone(), torch.tensor([slot], dtype=torch.int32)
            outs, ys, sts, cvs = [], [], [st[slot].clone()], [cv[slot].clone()]
            for t in range(length):
                at = slice(t, t + 1)
                outs.append(_ref_rule(self.q[s, at], self.k[s, at], self.v[s, at], self.g[s, at],
                                      self.beta[s, at], st, one, 1, None)[0])
                ys.append(_ref_conv(self.x[s, at], self.weight, cv, one, 1, None)[0])
                sts.append(st[slot].clone())
                cvs.append(cv[slot].clone())
            self.o.append(outs)
            self.y.append(ys)
            self.states.append(sts)
            self.convs.append(cvs)

    def rows(self, s: int, start: int, n: int) -> tuple[torch.Tensor, ...]:
        at = slice(start, start + n)
        return self.q[s, at], self.k[s, at], self.v[s, at], self.g[s, at], self.beta[s, at], self.x[s, at]


def _trajectory(rule, conv, seed: int, device: torch.device, steps: int = 9) -> None:
    """The streams' plain decodes on the CPU (reference); the verify steps on `device`."""
    data = _Streams(seed)
    gen = torch.Generator().manual_seed(seed + 100)
    pend = PendingRows.allocate(5, ROWS, DIMS["hk"], DIMS["dk"], DIMS["hv"], DIMS["dv"], data.x.shape[-1],
                                torch.float32, device)
    state, conv_state, weight = data.state.to(device), data.conv.to(device), data.weight.to(device)
    pos, count, half = [0, 0, 0], [0, 0, 0], [0, 0, 0]
    for step in range(steps):
        width = 1 if step % 3 == 2 else ROWS  # every third step decodes one plain row
        words, parts, drafts = [], [], []
        for s, slot in enumerate(data.slots):
            n = 0 if width == 1 else int(torch.randint(0, ROWS, (1,), generator=gen))
            drafts.append(n)
            words += [state_word(slot, count[s], half[s])] + [slot if j <= n else -1 for j in range(1, width)]
            parts.append(data.rows(s, pos[s], width))
        words += [-1] * width  # a CUDA-graph padding group
        parts.append(data.rows(0, 0, width))
        q, k, v, g, beta, x = (torch.cat(t).to(device) for t in zip(*parts))
        idx = torch.tensor(words, dtype=torch.int32, device=device)
        o = rule(q, k, v, g, beta, state, idx, width, pend).cpu()
        y = conv(x, weight, conv_state, idx, width, pend).cpu()
        assert torch.count_nonzero(o[-width:]) == 0 and torch.count_nonzero(y[-width:]) == 0
        for s in range(len(data.slots)):
            kept = int(torch.randint(0, drafts[s] + 1, (1,), generator=gen))
            for j in range(width):
                r = s * width + j
                if j > drafts[s]:
                    assert torch.count_nonzero(o[r]) == 0 and torch.count_nonzero(y[r]) == 0
                elif j <= kept:
                    assert rel_err(o[r], data.o[s][pos[s] + j]) <= 1e-5, (step, s, j)
                    torch.testing.assert_close(y[r], data.y[s][pos[s] + j], atol=1e-6, rtol=1e-6)
            count[s], half[s] = (kept + 1, 1 - half[s]) if width > 1 else (0, half[s])
            pos[s] += kept + 1
    for s, slot in enumerate(data.slots):
        conv, ssm = replay_slot(conv_state, state, pend, state_word(slot, count[s], half[s]))
        assert rel_err(ssm.cpu(), data.states[s][pos[s]]) <= 1e-5
        assert torch.equal(conv.cpu(), data.convs[s][pos[s]])


def test_reference_trajectory_equals_plain_steps() -> None:
    _trajectory(_ref_rule, _ref_conv, seed=0, device=torch.device("cpu"))


def test_kernel_trajectory_equals_plain_steps(device: torch.device) -> None:
    _trajectory(_triton_rule, _triton_conv, seed=1, device=device, steps=6)


def _pending_case(rows: int, dims: dict, channels: int, gen: torch.Generator, dtype: torch.dtype,
                  device: torch.device):
    """Inputs of one step: two live groups (the second with one draft fewer than the width), a
    padding group; slots 5 and 0 of 8, random pending counts and halves."""
    short = [0] * (rows - 1) + [-1] if rows > 1 else [0]
    slots = [5] * rows + short + [-1] * rows
    q, k, v, g, beta, _, state, _, _ = rule_inputs([1] * len(slots), **dims, gen=gen, slots=slots,
                                                   dtype=dtype, device=device)
    state = torch.cat([state, state * 0.5])[:8]
    pend = pending_inputs(8, max(rows, 3), dims["hk"], dims["hv"], dims["dk"], dims["dv"], channels, gen,
                          dtype, device)
    words = pending_words(slots, rows, pend.rows, gen)
    x = torch.randn(len(slots), channels, generator=gen).to(device, dtype)
    return q, k, v, g, beta, state, pend, torch.tensor(words, dtype=torch.int32, device=device), x


def _clone(p: PendingRows) -> PendingRows:
    return PendingRows(p.d.clone(), p.k.clone(), p.u.clone(), p.x.clone())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_kernels_match_reference(dtype: torch.dtype, rows: int, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(10 + rows)
    for dims, channels, width in ((dict(hk=2, hv=6, dk=16, dv=32), 40, 4), (dict(hk=1, hv=2, dk=24, dv=40), 24, 2)):
        q, k, v, g, beta, state, pend, idx, x = _pending_case(rows, dims, channels, gen, dtype, device)
        want_state, want_pend = state.clone(), _clone(pend)
        want = gdn_ref.gated_delta_rule_decode_ref(q, k, v, g, beta, want_state, idx, None, rows, want_pend)
        got = _triton_rule(q, k, v, g, beta, state, idx, rows, pend)
        assert rel_err(got, want) <= (1e-5 if dtype == torch.float32 else 1e-2)
        for a, b in ((state, want_state), (pend.d, want_pend.d), (pend.k, want_pend.k), (pend.u, want_pend.u)):
            assert rel_err(a, b) <= 1e-5
        weight = torch.randn(channels, width, generator=gen).to(device, dtype)
        conv_state = torch.randn(8, width - 1, channels, generator=gen).to(device, dtype)
        want_conv, want_x = conv_state.clone(), pend.x.clone()
        want_pend.x = want_x
        y_want = gdn_ref.causal_conv1d_decode_ref(x, weight, None, want_conv, idx, rows, want_pend)
        y = _triton_conv(x, weight, conv_state, idx, rows, pend)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(y, y_want, **tol)
        assert torch.equal(conv_state, want_conv) and torch.equal(pend.x, want_x)


def test_state_words() -> None:
    from homelab_llm.engine.kernels.gdn_pending import MAX_PENDING
    from homelab_llm.engine.spec.config import MAX_SPECULATIVE_TOKENS

    assert MAX_SPECULATIVE_TOKENS + 1 <= MAX_PENDING  # every verify group's rows fit a word's count
    word = state_word(1234, 5, 1)
    assert split_word(word) == (1234, 5, 1) and word > 0 and state_word(-1, 3, 1) == -1
    for bad in ((1 << 24, 0, 0), (0, 32, 0), (0, 0, 2)):
        with pytest.raises(ValueError, match="state word"):
            state_word(*bad)


def test_verify_groups_need_pending_rows() -> None:
    from homelab_llm.engine.kernels import gdn

    x = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="pending rows"):
        gdn.causal_conv1d_decode(x, torch.zeros(8, 4), None, torch.zeros(2, 3, 8),
                                 torch.zeros(4, dtype=torch.int32), rows_per_seq=2)
    pend = pending_inputs(2, 1, 1, 1, 4, 4, 8, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="exceeds the 1 pending rows"):
        gdn.causal_conv1d_decode(x, torch.zeros(8, 4), None, torch.zeros(2, 3, 8),
                                 torch.zeros(4, dtype=torch.int32), rows_per_seq=2, pending=pend)
    q, k, v, g, beta, _, state, _, _ = rule_inputs([1] * 4, gen=torch.Generator().manual_seed(1), **DIMS)
    with pytest.raises(ValueError, match="do not fit"):
        from homelab_llm.engine.kernels.gdn_recurrent import recurrent_gated_delta_rule

        recurrent_gated_delta_rule(q, k, v, g, beta, state, torch.zeros(4, dtype=torch.int32),
                                   rows_per_seq=1, pending=pend)


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


def test_gdn_tiles_switch(monkeypatch) -> None:
    """HOMELAB_LLM_GDN_TILES changes this device's GdnTiles fields (A/B runs without a patched
    tree): the verify tiles of 5+ sequences here; a bad field or value names the fields."""
    from homelab_llm.engine.kernels import tuning

    cpu = torch.device("cpu")
    monkeypatch.setenv(tuning.GDN_TILES_ENV, "verify_wide_block_v=8, verify_wide_warps=1")
    assert tuning.gdn_step_tiles(cpu, 8, 5) == (8, 1)
    assert tuning.gdn_step_tiles(cpu, 8, 1) == (tuning.GDN_TABLE["interpret"].decode_block_v,
                                                tuning.GDN_TABLE["interpret"].decode_warps)
    for bad in ("verify_wide=8", "decode_warps=two"):
        monkeypatch.setenv(tuning.GDN_TILES_ENV, bad)
        with pytest.raises(ValueError, match="verify_wide_block_v"):
            tuning.gdn_tiles(cpu)


def test_group_size_must_divide_the_rows() -> None:
    from homelab_llm.engine.kernels import gdn

    x = torch.zeros(6, 8)
    with pytest.raises(ValueError, match="rows_per_seq=4"):
        gdn.causal_conv1d_decode(x, torch.zeros(8, 4), None, torch.zeros(2, 3, 8),
                                 torch.zeros(6, dtype=torch.int32), rows_per_seq=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP device")
def test_verify_full_shape() -> None:
    """The 27B's shape at 8 sequences x 5 rows, 1 and 3 sequences (the verify tiles) and a plain
    decode step with pending rows, bf16, against the references (bounds as above)."""
    cuda = torch.device("cuda")
    gen = torch.Generator().manual_seed(5)
    for rows, groups in ((5, 8), (5, 1), (5, 3), (1, 8)):
        slots = [s if j == 0 or (s + j) % 4 else -1 for s in range(groups) for j in range(rows)]
        q, k, v, g, beta, _, state, _, _ = rule_inputs([1] * len(slots), **FULL_RULE, gen=gen, slots=slots,
                                                       dtype=torch.bfloat16, device=cuda)
        state = torch.cat([state] * 4)[:groups + 1]
        pend = pending_inputs(groups + 1, 5, FULL_RULE["hk"], FULL_RULE["hv"], FULL_RULE["dk"], FULL_RULE["dv"],
                              FULL_CONV_CHANNELS, gen, torch.bfloat16, cuda)
        idx = torch.tensor(pending_words(slots, rows, 5, gen), dtype=torch.int32, device=cuda)
        want_state, want_pend = state.clone(), _clone(pend)
        want = gdn_ref.gated_delta_rule_decode_ref(q, k, v, g, beta, want_state, idx, None, rows, want_pend)
        got = _triton_rule(q, k, v, g, beta, state, idx, rows, pend)
        assert rel_err(got, want) <= 1e-2
        for a, b in ((state, want_state), (pend.d, want_pend.d), (pend.k, want_pend.k), (pend.u, want_pend.u)):
            assert rel_err(a, b) <= 1e-5
        x = torch.randn(len(slots), FULL_CONV_CHANNELS, generator=gen).to(cuda, torch.bfloat16)
        weight = torch.randn(FULL_CONV_CHANNELS, 4, generator=gen).to(cuda, torch.bfloat16)
        conv_state = torch.randn(groups + 1, 3, FULL_CONV_CHANNELS, generator=gen).to(cuda, torch.bfloat16)
        want_conv = conv_state.clone()
        y_want = gdn_ref.causal_conv1d_decode_ref(x, weight, None, want_conv, idx, rows, want_pend)
        y = _triton_conv(x, weight, conv_state, idx, rows, pend)
        torch.testing.assert_close(y, y_want, atol=1e-2, rtol=1e-2)
        assert torch.equal(conv_state, want_conv) and torch.equal(pend.x, want_pend.x)
