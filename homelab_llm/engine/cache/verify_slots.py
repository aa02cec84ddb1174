"""Hybrid models' state slots for speculative verify steps: rollback by relabelling, not copying.

A verify step of K drafts runs the sequence's last token and its drafts as K+1 decode rows
(plan_rows.py). The Gated DeltaNet kernels start from the sequence's own slot and write the
state after row j into slot j of the group [own slot, spare 1, ..., spare K] (kernels/gdn.py,
rows_per_seq). After acceptance the sequence has computed its last token and `a` drafts: the
state it needs is the one after row a, already sitting in slot a of the group. That slot becomes
the sequence's own and the other K go back to the pool: no state copy, no recompute, and the state
equals the one of a run that never drafted.

Spares come from the running slots: the pool holds max_num_seqs running slots plus
`spare_slots.spare_slot_count` more, and a sequence only takes spares while enough free slots remain for every
sequence the scheduler may still admit (so admission never runs out). Spares are held for one
step only; at most `spare_slots.MAX_VERIFYING_SEQS` sequences' worth are in the pool (fewer with
--speculative-config's disable_by_batch_size), since every slot holds one state per GDN layer
(Qwen3.6-27B: 144 MiB): past that many speculating sequences the rest decode plainly in the
same step.
"""

from __future__ import annotations

from homelab_llm.engine.cache.state_pool import StateSlots
from homelab_llm.engine.sequence import Sequence


def take_spares(slots: StateSlots, seq: Sequence, k: int, keep_free: int) -> bool:
    """Give `seq` k spare slots for this step's verify, unless fewer than keep_free free slots
    would remain (the admissions still possible). False: it decodes plainly this step."""
    need = k - len(seq.verify_slots)
    if need <= 0:
        return True
    if slots.running_free - need < keep_free:
        return False
    seq.verify_slots += [slots.alloc_running() for _ in range(need)]
    return True


def keep_row(slots: StateSlots, seq: Sequence, row: int) -> None:
    """After a verify: the state after group row `row` becomes the sequence's own (row 0: its
    slot already); every other slot of the group goes back to the pool."""
    group = [seq.state_slot] + seq.verify_slots
    seq.state_slot = group[row]
    for slot in group[:row] + group[row + 1:]:
        slots.free_running(slot)
    seq.verify_slots = []


def release_spares(slots: StateSlots, seq: Sequence) -> None:
    """A sequence leaving the running set returns any spare it still holds."""
    for slot in seq.verify_slots:
        slots.free_running(slot)
    seq.verify_slots = []
