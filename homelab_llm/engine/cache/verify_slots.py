"""Hybrid models' state slots across speculative verify steps: rollback by a count, not by copies.

A verify step of K drafts runs the sequence's last token and its drafts as K+1 decode rows
(plan_rows.py). The Gated DeltaNet kernels leave the state the group started from in the
sequence's own slot and keep the group's rows as pending rank-1 updates (kernels/gdn_pending.py).
After acceptance the sequence has computed its last token and `a` drafts: it keeps a + 1 of
those rows pending, and its next decode applies them as it loads the state, so the state equals
the one of a run that never drafted, with no spare slot, no copy and no recompute.

The host side is two numbers per sequence (Sequence.gdn_pending and gdn_half), carried to the
kernels in the first state word of each decode group (gdn_pending.state_word):
- a step that lays the sequence out as a verify group (plan width K+1) writes this step's rows to
  the half it does not read: afterwards 1 row is pending (the sequence's token), and rollback
  sets a + 1 for the drafts it kept;
- a plain decode row (width 1) applies the pending rows and stores the state after its row:
  nothing is pending afterwards.
A sequence with rows pending always runs its next step as decode rows (step_plan.plan_order),
and a copy out of its slot (a prefix snapshot) applies them on the way (StatePool.copy).
"""

from __future__ import annotations

from homelab_llm.engine.kernels.gdn_pending import state_word
from homelab_llm.engine.sequence import Sequence


def slot_word(seq: Sequence) -> int:
    """The state word of a sequence's running slot: slot, pending rows, the half they are in."""
    return state_word(seq.state_slot, seq.gdn_pending, seq.gdn_half)


def after_decode_rows(seq: Sequence, width: int) -> None:
    """A step ran the sequence as decode rows in groups of `width`: with 2+ rows, its rows are
    pending in the other half (1 of them kept until rollback says more); with 1, none."""
    if width > 1:
        seq.gdn_pending, seq.gdn_half = 1, 1 - seq.gdn_half
    else:
        seq.gdn_pending = 0


def keep_rows(seq: Sequence, row: int) -> None:
    """After a verify: the sequence keeps group rows 0..row (its token and `row` drafts)."""
    seq.gdn_pending = row + 1
