"""The rows of one step, as host lists, before step_plan packs them into int64 words.

A scheduled sequence enters a step in one of two shapes:
- varlen: one query of n tokens (a prefill chunk, or a decode on the plain path), its state slot
  (hybrid models) per sequence;
- decode rows: its last token and K drafts as K+1 one-token "sequences" over one page table, row
  j seeing the first start+j+1 tokens (every row's K/V is stored before any row attends), so a
  verify stays decode-only and runs in a captured graph. The rows come padded to a group of
  `width` = K+1 (decode attention takes a group in one program, kernels/decode_attention.py
  rows_per_seq); on hybrid models they carry a state word each: row 0 the sequence's slot with
  its pending verify rows (cache/verify_slots.py), the others the slot again, which the GDN
  layers chain (kernels/gdn.py). Padding rows write no K/V, no state, give no logits.

On a model with a sliding page group (cache/page_groups.py), every row also has the sliding
group's KV slot and page table (`sliding`: (slots, table) per call; padding rows write nowhere).

Logits rows are kept per scheduled item: a verify step puts its decode groups first (one
decode-kernel call for them) while the sampler reads rows in schedule order.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PlanRows:
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # KV slot per row, -1: write nowhere
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    state_slots: list[int] = field(default_factory=list)
    has_initial: list[int] = field(default_factory=list)
    sliding_slots: list[int] = field(default_factory=list)  # the sliding group's, when it exists
    sliding_tables: list[list[int]] = field(default_factory=list)

    def add_varlen(self, ids: list[int], start: int, kv_slots: list[int], table: list[int],
                   num_logits: int, state_slot: int,
                   sliding: tuple[list[int], list[int]] | None = None) -> list[int]:
        """One query of len(ids) tokens from position `start`; returns its last num_logits rows."""
        n = len(ids)
        if sliding is not None:
            self.sliding_slots += sliding[0]
            self.sliding_tables.append(sliding[1])
        self.ids += ids
        self.positions += range(start, start + n)
        self.slots += kv_slots
        self.query_lens.append(n)
        self.seq_lens.append(start + n)
        self.tables.append(table)
        self.state_slots.append(state_slot)
        self.has_initial.append(int(start > 0))
        return list(range(len(self.ids) - num_logits, len(self.ids)))

    def add_decode_rows(self, ids: list[int], start: int, kv_slots: list[int], table: list[int],
                        state_slots: list[int], width: int = 0,
                        sliding: tuple[list[int], list[int]] | None = None) -> list[int]:
        """len(ids) decode rows from position `start`, padded to `width` rows; returns the real
        rows (each one samples)."""
        n = len(ids)
        pad = max(0, width - n)
        if sliding is not None:
            self.sliding_slots += sliding[0] + [-1] * pad
            self.sliding_tables += [sliding[1]] * (n + pad)
        first = len(self.ids)
        self.ids += ids + [0] * pad
        self.positions += list(range(start, start + n)) + [start] * pad
        self.slots += kv_slots + [-1] * pad
        self.query_lens += [1] * (n + pad)
        self.seq_lens += list(range(start + 1, start + n + 1)) + [start + 1] * pad
        self.tables += [table] * (n + pad)
        self.state_slots += state_slots + [-1] * pad
        self.has_initial += [1] * (n + pad)
        return list(range(first, first + n))
