"""KVCacheManager: gives sequences pages, shares prefixes through the radix cache, takes pages back.

The scheduler decides who runs; this decides where their K/V live. On hybrid models (Gated
DeltaNet layers) it also gives each running sequence a state slot, restores a matched prefix's
state from the radix cache's snapshot and snapshots the state whenever tokens are cached; those
copies (KV rows of a partially matched page, state slots) queue in `copies` for the next step's
plan (cache/copies.py): every rank runs them before that step's forward.

On a model whose every KV layer is sliding-window (`release_window` > 0: Mistral, Qwen2 with
max_window_layers 0), pages wholly below the oldest key any later query can see go back to the
pool as the sequence grows (release_outside_window). With the prefix cache on, only once the
prompt has been offered to it, so the radix tree only ever holds whole prefixes: a match is
always backed by every page of its window.
"""

from __future__ import annotations

from homelab_llm.engine.cache.page_pool import PagePool
from homelab_llm.engine.cache.radix import RadixCache
from homelab_llm.engine.cache.copies import CacheCopies
from homelab_llm.engine.cache.state_pool import StateSlots
from homelab_llm.engine.cache.verify_slots import keep_row, release_spares, take_spares
from homelab_llm.engine.model.config import ModelConfig
from homelab_llm.engine.sequence import Sequence


def release_window(config: ModelConfig, state_slots: StateSlots | None) -> int:
    """The window below which a sequence's pages may be released: the model's, when every KV
    layer slides (a single full-attention layer needs every page); else 0."""
    sliding = config.sliding_layers
    if not sliding or sliding != config.full_attention_layers or state_slots is not None:
        return 0
    return config.sliding_window


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, pool: PagePool, enable_prefix_caching: bool,
                 state_slots: StateSlots | None = None, release_window: int = 0) -> None:
        self.pool = pool
        self.release_window = release_window
        self.page_size = pool.page_size
        self.state_slots = state_slots
        self.copies = CacheCopies()
        snapshots = state_slots if state_slots is not None and state_slots.num_snapshots else None
        caching = enable_prefix_caching and (state_slots is None or snapshots is not None)
        self.radix = RadixCache(pool, snapshots) if caching else None
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    # -- admission ----------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> None:
        """Give a fresh sequence the cached KV of its longest cached prefix.

        At least one token is always left to compute, so the step that finishes the prompt has
        logits to sample from. Pages fully matched are shared; partial ones are copied."""
        assert not seq.page_table and seq.num_computed_tokens == 0
        if self.radix is None:
            return
        match = self.radix.match_prefix(seq.token_ids[:-1])
        if match.length == 0:
            return
        # Lock first: making room for copies must not evict the very pages we match.
        self.radix.lock(match.node)
        plan = self.radix.pages_for_match(match)
        n_copies = sum(1 for entry in plan if isinstance(entry, list))
        if n_copies and not self._reserve(n_copies):
            # No room for the copies: keep only the pages that can be shared as they are.
            while plan and isinstance(plan[-1], list):
                plan.pop()
            if not plan or any(isinstance(entry, list) for entry in plan):
                self.radix.unlock(match.node)
                return
            n_copies = 0
        fresh = self.pool.alloc(n_copies) if n_copies else []
        page_table: list[int] = []
        for entry in plan:
            if isinstance(entry, list):
                page = fresh.pop()
                base = len(page_table) * self.page_size
                dst = [page * self.page_size + (base + i) % self.page_size
                       for i in range(len(entry))]
                self.copies.kv.extend(entry, dst)
                page_table.append(page)
            else:
                self.pool.incref([entry])
                page_table.append(entry)
        matched = min(match.length, len(page_table) * self.page_size)
        if self.state_slots is not None and matched < match.length:
            # The state snapshot sits at the match end only: a shorter KV prefix is no use.
            self.pool.decref(page_table)
            self.radix.unlock(match.node)
            return
        seq.page_table = page_table
        seq.num_computed_tokens = matched
        seq.cache_node = match.node
        if self.state_slots is not None:
            self.assign_state_slot(seq)
            self.copies.state.add(match.node.snapshot, seq.state_slot)
            self.radix.snapshot_hits += 1

    def assign_state_slot(self, seq: Sequence) -> None:
        """Hybrid models: a running state slot for a sequence about to run (idempotent)."""
        if self.state_slots is not None and seq.state_slot < 0:
            seq.state_slot = self.state_slots.alloc_running()

    def take_verify_slots(self, seq: Sequence, k: int, keep_free: int) -> bool:
        """Hybrid models, before a verify step of k drafts: the spare state slots its rows write
        into (cache/verify_slots.py), unless that would leave fewer than keep_free free running
        slots. Always True on other models."""
        if self.state_slots is None or seq.state_slot < 0:
            return True
        return take_spares(self.state_slots, seq, k, keep_free)

    def keep_verified_state(self, seq: Sequence, row: int) -> None:
        """Hybrid models, after a verify step: the state after group row `row` (the last token
        the sequence keeps) becomes its own; the other slots of the group are freed."""
        if self.state_slots is not None and seq.state_slot >= 0:
            keep_row(self.state_slots, seq, row)

    def record_admission(self, seq: Sequence) -> None:
        """Count a request's prefix lookup once, when it is first admitted (not on retries of a
        failed admission, nor on recompute after preemption)."""
        if seq.num_preemptions or seq.admitted:
            return
        seq.admitted = True
        seq.num_cached_tokens = seq.num_computed_tokens
        self.prefix_query_tokens += seq.num_prompt_tokens
        self.prefix_hit_tokens += seq.num_computed_tokens

    # -- growth -------------------------------------------------------------------------------
    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, _ceil_div(num_tokens, self.page_size) - len(seq.page_table))

    def _reserve(self, n_pages: int) -> bool:
        if self.pool.num_free < n_pages and self.radix is not None:
            self.radix.evict(n_pages)
        return self.pool.num_free >= n_pages

    def ensure_pages(self, seq: Sequence, num_tokens: int) -> bool:
        """Make room for the sequence's first `num_tokens` tokens; False if the pool is full."""
        need = self.pages_needed(seq, num_tokens)
        if need == 0:
            return True
        if not self._reserve(need):
            return False
        seq.page_table.extend(self.pool.alloc(need))
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the pages past the first `num_tokens` tokens (rejected draft slots)."""
        keep = _ceil_div(num_tokens, self.page_size)
        if len(seq.page_table) > keep:
            self.pool.decref(seq.page_table[keep:])
            del seq.page_table[keep:]

    def can_fit(self, num_pages: int) -> bool:
        evictable = self.radix.evictable_pages() if self.radix is not None else 0
        return self.pool.num_free + evictable >= num_pages

    # -- release ------------------------------------------------------------------------------
    def cache_sequence(self, seq: Sequence) -> None:
        """Offer the computed tokens to the prefix cache (prompt done, finish, or preemption)."""
        if self.radix is None or seq.num_computed_tokens == 0 or seq.released_pages:
            return  # with released pages the prompt is cached already (release_outside_window)
        n = seq.num_computed_tokens
        ps = self.page_size
        slots = [seq.page_table[i // ps] * ps + i % ps for i in range(n)]
        self.radix.insert(seq.token_ids[:n], slots)
        if self.state_slots is not None and seq.state_slot >= 0 and len(seq.token_ids) >= n:
            # The running slot holds the state after exactly these n tokens: keep a copy there.
            node = self.radix.node_at(seq.token_ids[:n])
            snapshot = self.radix.attach_snapshot(node) if node is not None else None
            if snapshot is not None:
                self.copies.state.add(seq.state_slot, snapshot)

    def free(self, seq: Sequence, cache: bool = True) -> None:
        if cache:
            self.cache_sequence(seq)
        if seq.cache_node is not None and self.radix is not None:
            self.radix.unlock(seq.cache_node)
        seq.cache_node = None
        self.pool.decref(seq.page_table[seq.released_pages:])
        seq.page_table = []
        seq.released_pages = 0
        seq.num_computed_tokens = 0
        if seq.state_slot >= 0 and self.state_slots is not None:
            self.state_slots.free_running(seq.state_slot)
            seq.state_slot = -1
        if seq.verify_slots and self.state_slots is not None:
            release_spares(self.state_slots, seq)

    def release_outside_window(self, seq: Sequence) -> None:
        """Return the pages no later query of `seq` can see (see the module docstring). The next
        query sits at num_computed_tokens and sees keys > num_computed_tokens - window."""
        if not self.release_window:
            return
        if self.radix is not None and seq.num_computed_tokens < seq.num_prompt_tokens:
            return  # the prompt goes to the prefix cache whole first
        oldest = max(0, seq.num_computed_tokens - self.release_window + 1)
        upto = min(oldest // self.page_size, len(seq.page_table))
        if upto > seq.released_pages:
            self.pool.decref(seq.page_table[seq.released_pages:upto])
            seq.released_pages = upto

    @property
    def tokens_used(self) -> int:
        return self.pool.num_used * self.page_size
