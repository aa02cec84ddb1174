"""The host side of hybrid verify steps: the plan's row layout (step_plan.build_plan with
verify_width), the pending-row bookkeeping (cache/verify_slots.py) and the captured graph shapes."""

from __future__ import annotations

import torch

from homelab_llm.engine.cache.verify_slots import after_decode_rows, keep_rows
from homelab_llm.engine.cuda_graphs import graph_shapes
from homelab_llm.engine.sampling_params import SamplingParams
from homelab_llm.engine.scheduler import ScheduledSeq
from homelab_llm.engine.sequence import Sequence
from homelab_llm.engine.kernels.gdn_pending import state_word
from homelab_llm.engine.step_plan import batch_from_plan, build_plan, first_rows


def _seq(tokens: list[int], computed: int, slot: int, pending: int = 0, half: int = 0) -> Sequence:
    seq = Sequence("r", tokens[:2], SamplingParams(), 0.0, 64, token_ids=list(tokens))
    seq.num_computed_tokens = computed
    seq.page_table = [3, 7]
    seq.state_slot = slot
    seq.gdn_pending, seq.gdn_half = pending, half
    return seq


def test_hybrid_verify_rows_come_grouped_and_padded() -> None:
    prefill = _seq(list(range(10, 16)), 2, 4)  # 4 prompt tokens left: varlen, scheduled first
    verify = _seq([1, 2, 3, 4, 5], 4, 0, pending=2, half=1)
    plain = _seq([6, 7, 8], 2, 5)  # a decode without drafts in the same step
    scheduled = [ScheduledSeq(prefill, 4), ScheduledSeq(verify, 3, [40, 41]), ScheduledSeq(plain, 1)]
    header, payload = build_plan(scheduled, page_size=4, verify_width=3)
    assert (header.verify_width, header.decode_rows, header.decode_only) == (3, 6, False)
    batch = batch_from_plan(header, payload, torch.device("cpu"), 4)
    ctx = batch.context
    assert batch.input_ids.tolist() == [5, 40, 41, 8, 0, 0, 12, 13, 14, 15]
    assert batch.positions.tolist()[:6] == [4, 5, 6, 2, 2, 2]
    assert ctx.slot_mapping.tolist()[:6] == [28, 29, 30, 14, -1, -1]  # padding rows write no K/V
    # each group's first word: the slot with its pending rows; the other live rows: the slot
    assert ctx.state_indices.tolist() == [state_word(0, 2, 1), 0, 0, 5, -1, -1, 4]
    assert ctx.seq_lens.tolist() == [5, 6, 7, 3, 3, 3, 6]
    assert ctx.query_start_loc.tolist() == [0, 1, 2, 3, 4, 5, 6, 10]
    # logits in schedule order: the prefill's last row, the verify's 3 rows, the plain decode's row
    assert batch.logits_indices.tolist() == [9, 0, 1, 2, 3]


def test_without_speculation_the_layout_is_unchanged() -> None:
    a, b = _seq([1, 2, 3], 2, 0), _seq([4, 5, 6], 2, 1)
    header, payload = build_plan([ScheduledSeq(a, 1), ScheduledSeq(b, 1)], page_size=4, verify_width=5)
    assert (header.verify_width, header.decode_rows, header.decode_only) == (1, 0, True)
    assert header.num_tokens == 2


def test_pending_rows_decode_as_groups_of_one() -> None:
    """Without drafts in the step, a sequence with pending verify rows still runs as a decode
    row (its word carries them; the varlen kernels cannot apply them), before the varlen
    queries; one without pending rows stays varlen; first_rows agrees with the layout."""
    prefill = _seq(list(range(10, 16)), 2, 4)
    pending = _seq([1, 2, 3, 4, 5], 4, 0, pending=3)
    plain = _seq([6, 7, 8], 2, 5)
    scheduled = [ScheduledSeq(prefill, 4), ScheduledSeq(pending, 1), ScheduledSeq(plain, 1)]
    header, payload = build_plan(scheduled, page_size=4, verify_width=3)
    assert (header.verify_width, header.decode_rows, header.decode_only) == (1, 1, False)
    ctx = batch_from_plan(header, payload, torch.device("cpu"), 4).context
    assert ctx.state_indices.tolist() == [state_word(0, 3, 0), 4, 5]
    assert first_rows(scheduled, 3) == [1, 0, 5]


def test_pending_counts_follow_the_steps() -> None:
    seq = _seq([1, 2, 3], 2, 1)
    after_decode_rows(seq, 4)  # a verify group: its rows pending in the other half
    assert (seq.gdn_pending, seq.gdn_half) == (1, 1)
    keep_rows(seq, 2)  # two drafts accepted: the token and both drafts stay pending
    assert (seq.gdn_pending, seq.gdn_half) == (3, 1)
    after_decode_rows(seq, 4)
    assert (seq.gdn_pending, seq.gdn_half) == (1, 0)
    after_decode_rows(seq, 1)  # a plain decode row applies them
    assert (seq.gdn_pending, seq.gdn_half) == (0, 0)


def test_graph_shapes() -> None:
    assert graph_shapes(8, 1) == [(1, 1), (2, 1), (4, 1), (8, 1)]
    shapes = graph_shapes(4, 5)
    assert (4, 1) in shapes and (20, 5) in shapes and (5, 5) in shapes and (2, 2) not in shapes


def test_dense_verify_rows_are_grouped_too() -> None:
    a, b = _seq([1, 2, 3], 2, -1), _seq([4, 5, 6, 7], 3, -1)
    header, payload = build_plan([ScheduledSeq(a, 3, [9, 9]), ScheduledSeq(b, 1)], page_size=4, verify_width=3)
    assert (header.verify_width, header.decode_rows, header.decode_only, header.num_tokens) == (3, 6, True, 6)
    batch = batch_from_plan(header, payload, torch.device("cpu"), 4)
    assert batch.context.seq_lens.tolist() == [3, 4, 5, 4, 4, 4]
    assert batch.context.state_indices.tolist() == [-1] * 6
    assert batch.logits_indices.tolist() == [0, 1, 2, 3]


def test_a_copy_out_of_a_slot_applies_its_pending_rows() -> None:
    """StatePool.copy from a state word with pending rows writes the replayed state (conv and
    recurrent) to the target, leaves the source as it was (so a re-run copy is the same), and
    the pool's bytes are the layout's: states for every slot, pending areas for running ones."""
    from homelab_llm.engine.cache.state_layout import StateLayout
    from homelab_llm.engine.cache.state_pool import StatePool
    from homelab_llm.engine.kernels.gdn_pending import replay_slot

    layout = StateLayout(1, (0, 2), 1, 2, (3, 8), "float32", (2, 4, 4), "float32")
    pool = StatePool(layout, 5, torch.device("cpu"), torch.float32, pending_rows=3, num_running=2)
    assert pool.memory_bytes == 5 * layout.bytes_per_sequence + 2 * layout.pending_bytes_per_sequence(3)
    gen = torch.Generator().manual_seed(0)
    for t in pool.conv_states + pool.ssm_states + [a for p in pool.pending for a in (p.d, p.k, p.u, p.x)]:
        t.copy_(torch.rand(t.shape, generator=gen))
    before = [t.clone() for t in pool.conv_states + pool.ssm_states]
    word = state_word(1, 2, 1)
    want = [replay_slot(c, s, p, word) for c, s, p in zip(pool.conv_states, pool.ssm_states, pool.pending)]
    for _ in range(2):
        pool.copy([word, 0], [3, 4])
        for (conv, ssm), c, s in zip(want, pool.conv_states, pool.ssm_states):
            assert torch.equal(c[3], conv) and torch.equal(s[3], ssm)
            assert not torch.equal(c[3], c[1])  # the pending rows made a difference
            assert torch.equal(c[4], c[0]) and torch.equal(s[4], s[0])  # no pending rows: a plain copy
        assert all(torch.equal(a[i], b[i]) for a, b in zip(pool.conv_states + pool.ssm_states, before)
                   for i in (0, 1, 2))
