"""Per-layer-type page groups: how a model that mixes full and sliding-window attention layers
(Gemma 3: five sliding per full; gpt-oss: alternating) splits its KV memory.

Such a model has two page pools. The full group (the full-attention layers' K/V) holds every
token of every sequence; the sliding group (the sliding layers' K/V, its own tensors and page ids)
only ever needs each running sequence's last `window` tokens plus the chunk being computed, so
pages below the window go back to it as the sequence advances. Each sequence has one page table
per group, both indexed by logical page (token i in entry i // page_size; the sliding table keeps
placeholders for the pages it gave back, which the kernels never read).

The split is static and decided by one rule (here, torch-free, so `plan` and the runner agree):
the sliding group gets `sliding_page_cap` pages — every running sequence's window (a window
starting anywhere in a page spans ceil(W / page) + 1 pages, plus the page its next token opens)
and one step's batch of new tokens — or as many pages as the full group when that is fewer (a
sequence never needs more sliding pages than full ones). The full group takes the rest of the
budget. The prefix cache keeps the windows of cached prefixes in the sliding group only while
there is room: they are the first thing dropped when it runs short (cache/radix.py).

vLLM shares one pool between groups of equal layer counts instead; a static split keeps one page
size per group and the scheduler's contract unchanged, at the price of provisioning the sliding
group for max_num_seqs windows.
"""

from __future__ import annotations

from dataclasses import dataclass

from homelab_llm.engine.model.config import ModelConfig


def sliding_group_window(config: ModelConfig) -> int:
    """The sliding group's window when the model mixes full and sliding attention layers (and
    has no recurrent layers); 0 when every KV layer is of one type."""
    sliding = config.sliding_layers
    if not sliding or sliding == config.full_attention_layers or config.is_hybrid:
        return 0
    return config.sliding_window


def sliding_page_cap(window: int, page_size: int, max_num_seqs: int,
                     max_num_batched_tokens: int) -> int:
    """Pages the sliding group needs at most: each running sequence's window and next page, and
    one step's new tokens (a chunk needs all its pages before its window moves on)."""
    per_seq = -(-window // page_size) + 2
    return max_num_seqs * per_seq + -(-max_num_batched_tokens // page_size)


@dataclass(frozen=True)
class GroupSplit:
    """The two groups' page counts as a function of the full group's: ranks agree on one number
    (the full group's pages) and each derives the sliding group's from it."""
    sliding_cap: int
    full_page_bytes: int
    sliding_page_bytes: int

    def sliding_pages(self, full_pages: int) -> int:
        return min(full_pages, self.sliding_cap)

    def full_pages_for_budget(self, budget: int) -> int:
        """The most full-group pages a budget holds together with their sliding pages."""
        both = self.full_page_bytes + self.sliding_page_bytes
        if budget < self.sliding_cap * both:
            return max(0, budget // both)
        return (budget - self.sliding_cap * self.sliding_page_bytes) // self.full_page_bytes

    def bytes_for(self, full_pages: int) -> int:
        """Bytes of both groups for `full_pages` (full_pages_for_budget's inverse)."""
        return full_pages * self.full_page_bytes + self.sliding_pages(full_pages) * self.sliding_page_bytes


def window_match_length(window_slots: list[int], length: int, window: int) -> int:
    """The longest prefix length m <= length a sliding group can resume from: the next query
    (at position m) sees keys m - window + 1 .. m, so every token in [m - window + 1, m) must
    still have its window slot (>= 0). 0 when none can."""
    best, run = 0, 0  # run: held tokens just before position i
    for i in range(1, length + 1):
        run = run + 1 if window_slots[i - 1] >= 0 else 0
        if run >= min(i, window - 1):
            best = i
    return best
