"""The host side of hybrid verify steps: the plan's row layout (step_plan.build_plan with
verify_width), the spare-slot bookkeeping (cache/verify_slots.py) and the captured graph shapes."""

from __future__ import annotations

import torch

from homelab_llm.engine.cache.state_pool import StateSlots
from homelab_llm.engine.cache.verify_slots import keep_row, release_spares, take_spares
from homelab_llm.engine.cuda_graphs import graph_shapes
from homelab_llm.engine.sampling_params import SamplingParams
from homelab_llm.engine.scheduler import ScheduledSeq
from homelab_llm.engine.sequence import Sequence
from homelab_llm.engine.step_plan import batch_from_plan, build_plan


def _seq(tokens: list[int], computed: int, slot: int, spares: list[int] = ()) -> Sequence:
    seq = Sequence("r", tokens[:2], SamplingParams(), 0.0, 64, token_ids=list(tokens))
    seq.num_computed_tokens = computed
    seq.page_table = [3, 7]
    seq.state_slot = slot
    seq.verify_slots = list(spares)
    return seq


def test_hybrid_verify_rows_come_grouped_and_padded() -> None:
    prefill = _seq(list(range(10, 16)), 2, 4)  # 4 prompt tokens left: varlen, scheduled first
    verify = _seq([1, 2, 3, 4, 5], 4, 0, spares=[8, 9])
    plain = _seq([6, 7, 8], 2, 5)  # a decode without drafts in the same step
    scheduled = [ScheduledSeq(prefill, 4), ScheduledSeq(verify, 3, [40, 41]), ScheduledSeq(plain, 1)]
    header, payload = build_plan(scheduled, page_size=4, verify_width=3)
    assert (header.verify_width, header.decode_rows, header.decode_only) == (3, 6, False)
    batch = batch_from_plan(header, payload, torch.device("cpu"), 4)
    ctx = batch.context
    assert batch.input_ids.tolist() == [5, 40, 41, 8, 0, 0, 12, 13, 14, 15]
    assert batch.positions.tolist()[:6] == [4, 5, 6, 2, 2, 2]
    assert ctx.slot_mapping.tolist()[:6] == [28, 29, 30, 14, -1, -1]  # padding rows write no K/V
    assert ctx.state_indices.tolist() == [0, 8, 9, 5, -1, -1, 4]
    assert ctx.seq_lens.tolist() == [5, 6, 7, 3, 3, 3, 6]
    assert ctx.query_start_loc.tolist() == [0, 1, 2, 3, 4, 5, 6, 10]
    # logits in schedule order: the prefill's last row, the verify's 3 rows, the plain decode's row
    assert batch.logits_indices.tolist() == [9, 0, 1, 2, 3]


def test_without_speculation_the_layout_is_unchanged() -> None:
    a, b = _seq([1, 2, 3], 2, 0), _seq([4, 5, 6], 2, 1)
    header, payload = build_plan([ScheduledSeq(a, 1), ScheduledSeq(b, 1)], page_size=4, verify_width=5)
    assert (header.verify_width, header.decode_rows, header.decode_only) == (1, 0, True)
    assert header.num_tokens == 2


def test_spares_relabel_and_return() -> None:
    slots = StateSlots(6, 0)
    seq = _seq([1, 2, 3], 2, slots.alloc_running())
    assert not take_spares(slots, seq, 3, keep_free=3)  # would starve admissions
    assert take_spares(slots, seq, 3, keep_free=2) and len(seq.verify_slots) == 3
    group = [seq.state_slot] + seq.verify_slots
    keep_row(slots, seq, 2)  # the state after row 2 (two drafts accepted) is kept
    assert seq.state_slot == group[2] and not seq.verify_slots and slots.running_free == 5
    assert take_spares(slots, seq, 2, keep_free=0)
    release_spares(slots, seq)
    assert slots.running_free == 5 and not seq.verify_slots


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
