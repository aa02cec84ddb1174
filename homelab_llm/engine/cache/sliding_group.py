"""The sliding page group of a model that mixes full and sliding attention (cache/page_groups.py):
each sequence's `sliding_table` in the sliding layers' own pool, grown with its page table and
given back below the window as the sequence advances.

Invariants: `seq.sliding_table` has as many entries as `seq.page_table` (both indexed by logical
page); its first `seq.sliding_released` entries are placeholders (0) the sequence holds no
reference on, and they lie wholly below the oldest key the sequence's next query can see. Every
other entry is one reference the sequence holds in the sliding pool.
"""

from __future__ import annotations

from homelab_llm.engine.cache.copies import SlotCopies
from homelab_llm.engine.cache.page_pool import PagePool
from homelab_llm.engine.cache.radix import page_plan
from homelab_llm.engine.sequence import Sequence


def table_from_plan(pool: PagePool, plan: list[int | list[int]], copies: SlotCopies) -> list[int]:
    """Page-table entries for a prefix match's page plan (radix.page_plan): shared pages get a
    reference, every other entry a fresh page (the caller reserved them) whose held rows are
    queued for copying. Entries start on page boundaries, so row i lands at offset i."""
    ps = pool.page_size
    fresh = pool.alloc(sum(1 for entry in plan if isinstance(entry, list)))
    table: list[int] = []
    for entry in plan:
        if isinstance(entry, list):
            page = fresh.pop()
            held = [(src, page * ps + i) for i, src in enumerate(entry) if src >= 0]
            copies.extend([s for s, _ in held], [d for _, d in held])
            table.append(page)
        else:
            pool.incref([entry])
            table.append(entry)
    return table


def copies_in(plan: list[int | list[int]]) -> int:
    """Fresh pages a page plan needs (its entries that are copied, not shared)."""
    return sum(1 for entry in plan if isinstance(entry, list))


class SlidingGroup:
    def __init__(self, pool: PagePool, window: int) -> None:
        self.pool = pool
        self.window = window
        self.page_size = pool.page_size

    def first_page(self, num_computed: int) -> int:
        """The first logical page the query at position num_computed can see."""
        return max(0, num_computed - self.window + 1) // self.page_size

    # -- admission ----------------------------------------------------------------------------
    def match_plan(self, window_slots: list[int], length: int) -> tuple[int, list[int | list[int]]]:
        """(pages below the window, the page plan of the rest) to resume at `length` tokens."""
        first = self.first_page(length)
        return first, page_plan(window_slots[:length], self.page_size, first)

    def adopt(self, seq: Sequence, first: int, plan: list[int | list[int]], copies: SlotCopies) -> None:
        seq.sliding_table = [0] * first + table_from_plan(self.pool, plan, copies)
        seq.sliding_released = first

    # -- growth -------------------------------------------------------------------------------
    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(seq.sliding_table))

    def extend(self, seq: Sequence, num_tokens: int) -> None:
        """Pages for the first `num_tokens` tokens (the caller reserved them)."""
        seq.sliding_table.extend(self.pool.alloc(self.pages_needed(seq, num_tokens)))

    def tokens_that_fit(self, seq: Sequence) -> int:
        return (len(seq.sliding_table) + self.pool.num_free) * self.page_size

    def window_slots(self, seq: Sequence, n: int) -> list[int]:
        """What the prefix cache keeps of the first n tokens: the sliding slots of the window
        before n (a match ending there resumes from them), -1 for every other token. Keeping
        more would pin the sliding pages of a whole prefill chunk in a group sized for windows."""
        ps = self.page_size
        start = max(0, n - self.window + 1)
        return [-1 if i < start or i // ps < seq.sliding_released
                else seq.sliding_table[i // ps] * ps + i % ps for i in range(n)]

    # -- release ------------------------------------------------------------------------------
    def release(self, seq: Sequence) -> None:
        """Give back the pages no later query of `seq` can see."""
        upto = min(self.first_page(seq.num_computed_tokens), len(seq.sliding_table))
        if upto > seq.sliding_released:
            self.pool.decref(seq.sliding_table[seq.sliding_released:upto])
            seq.sliding_table[seq.sliding_released:upto] = [0] * (upto - seq.sliding_released)
            seq.sliding_released = upto

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the pages past the first `num_tokens` tokens (rejected draft slots)."""
        keep = max(-(-num_tokens // self.page_size), seq.sliding_released)
        if len(seq.sliding_table) > keep:
            self.pool.decref(seq.sliding_table[keep:])
            del seq.sliding_table[keep:]

    def free(self, seq: Sequence) -> None:
        self.pool.decref(seq.sliding_table[seq.sliding_released:])
        seq.sliding_table = []
        seq.sliding_released = 0
