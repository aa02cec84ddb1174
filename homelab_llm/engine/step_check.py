"""Host-side bounds of a step, checked before its words reach a kernel.

Kernels index the RoPE table by position and the KV cache by slot and page id without bounds
checks (a read past either is an illegal address on the GPU, or silent corruption). Admission
already keeps prompt + max_tokens within max_model_len, and max_model_len within the table; this
is the last line: the plan's largest sequence length, slot and page id are compared with the
table and the pool (three reductions over host tensors), and only when one is out of range are
the scheduled sequences scanned to name the one at fault (a SequenceFault: it fails alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from homelab_llm.engine.faults import SequenceFault
from homelab_llm.engine.step_plan import PlanHeader


@dataclass(frozen=True)
class StepBounds:
    max_positions: int  # rows of the RoPE table: positions 0..max_positions-1
    num_pages: int  # pages in the KV pool: ids 0..num_pages-1
    page_size: int


def check_plan(header: PlanHeader, payload: torch.Tensor, bounds: StepBounds, scheduled) -> None:
    """Raise SequenceFault for the first scheduled sequence whose positions or pages fall outside
    `bounds`. `scheduled`: the ScheduledSeq items the plan was built from, in plan order."""
    t, b, max_pages = header.num_tokens, header.num_seqs, header.max_pages
    max_seq_len = header.max_seq_len
    if t == 0:
        return
    slots = payload[2 * t:3 * t]
    slots = slots[slots != -1]  # -1: a padding row of a hybrid verify group writes no K/V
    table_start = 3 * t + (b + 1) + b
    table = payload[table_start:table_start + b * max_pages]
    slots_ok = slots.numel() == 0 or (
        int(slots.min()) >= 0 and int(slots.max()) < bounds.num_pages * bounds.page_size)
    pages_ok = table.numel() == 0 or (int(table.min()) >= 0 and int(table.max()) < bounds.num_pages)
    if max_seq_len <= bounds.max_positions and slots_ok and pages_ok:
        return
    for item in scheduled:
        fault = sequence_fault(item.seq, item.num_new_tokens, bounds)
        if fault is not None:
            raise SequenceFault(item.seq.request_id, fault)
    raise SequenceFault("?", f"the step's plan is out of bounds (max length {max_seq_len}, "
                             f"{bounds.max_positions} positions, {bounds.num_pages} pages)")


def sequence_fault(seq, num_new_tokens: int, bounds: StepBounds) -> str | None:
    """Why this sequence's next `num_new_tokens` cannot run, or None."""
    last = seq.num_computed_tokens + num_new_tokens - 1
    if last >= bounds.max_positions:
        return (f"position {last} is past the RoPE table ({bounds.max_positions} positions); "
                f"the request cannot continue")
    bad = [p for p in seq.page_table if not 0 <= p < bounds.num_pages]
    if bad:
        return f"KV page {bad[0]} is outside the pool ({bounds.num_pages} pages)"
    if len(seq.page_table) * bounds.page_size <= last:
        return f"position {last} has no KV page ({len(seq.page_table)} pages allocated)"
    return None
