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

On a model that mixes full and sliding layers (Gemma 3, gpt-oss), the sliding layers have their
own page group (cache/page_groups.py, cache/sliding_group.py): every sequence gets pages in both,
and the sliding group's pages below the window go back after every step, prompt included. The
prefix cache stores both groups' slots (-1 where a sliding page was already given back, or lies
before the window at the inserted end), a sequence is offered to it when it stops running, and a
match is shortened to the longest prefix whose window the sliding group still holds.
"""

from __future__ import annotations

from homelab_llm.engine.cache.page_groups import window_match_length
from homelab_llm.engine.cache.page_pool import PagePool
from homelab_llm.engine.cache.radix import PrefixMatch, RadixCache
from homelab_llm.engine.cache.copies import CacheCopies
from homelab_llm.engine.cache.sliding_group import SlidingGroup, copies_in, table_from_plan
from homelab_llm.engine.cache.state_pool import StateSlots
from homelab_llm.engine.cache.verify_slots import after_decode_rows, keep_rows, slot_word
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
                 state_slots: StateSlots | None = None, release_window: int = 0,
                 sliding_window: int = 0) -> None:
        self.pool = pool
        self.release_window = release_window
        # Mixed models: the sliding layers' page group (the pool carries its pool).
        self.sliding = SlidingGroup(pool.sliding, sliding_window) if pool.sliding is not None else None
        assert self.sliding is None or (sliding_window > 0 and state_slots is None)
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
        if self.sliding is not None:
            self._match_with_window(seq, match)
            return
        if match.length == 0:
            return
        # Lock first: making room for copies must not evict the very pages we match.
        self.radix.lock(match.node)
        plan = self.radix.pages_for_match(match)
        n_copies = copies_in(plan)
        if n_copies and not self._reserve(n_copies):
            # No room for the copies: keep only the pages that can be shared as they are.
            while plan and isinstance(plan[-1], list):
                plan.pop()
            if not plan or any(isinstance(entry, list) for entry in plan):
                self.radix.unlock(match.node)
                return
            n_copies = 0
        page_table = table_from_plan(self.pool, plan, self.copies.kv)
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

    def _match_with_window(self, seq: Sequence, match: PrefixMatch) -> None:
        """Mixed models: resume from the longest part of `match` whose window the sliding group
        still holds, with both groups' pages (shared, or copied when partly matched); no match
        at all when the copies find no room."""
        assert self.radix is not None and self.sliding is not None
        length = window_match_length(match.window_slots, match.length, self.sliding.window)
        if length == 0:
            return
        node = match.node if length == match.length else self.radix.node_at(seq.token_ids[:length])
        assert node is not None
        self.radix.lock(node)
        plan = self.radix.pages_for_match(PrefixMatch(length, match.slots, node))
        first, window_plan = self.sliding.match_plan(match.window_slots, length)
        if not self._reserve(copies_in(plan), copies_in(window_plan)):
            self.radix.unlock(node)
            return
        seq.page_table = table_from_plan(self.pool, plan, self.copies.kv)
        self.sliding.adopt(seq, first, window_plan, self.copies.sliding_kv)
        seq.num_computed_tokens = length
        seq.cache_node = node

    def assign_state_slot(self, seq: Sequence) -> None:
        """Hybrid models: a running state slot for a sequence about to run (idempotent)."""
        if self.state_slots is not None and seq.state_slot < 0:
            seq.state_slot = self.state_slots.alloc_running()

    def ran_decode_rows(self, seq: Sequence, width: int) -> None:
        """Hybrid models: a step ran the sequence as decode rows in groups of `width` (2+: a
        verify group, its rows left pending; cache/verify_slots.py)."""
        if self.state_slots is not None and seq.state_slot >= 0:
            after_decode_rows(seq, width)

    def keep_verified_state(self, seq: Sequence, row: int) -> None:
        """Hybrid models, after a verify step: the sequence keeps group rows 0..row (the last
        token it keeps) pending in its slot (cache/verify_slots.py)."""
        if self.state_slots is not None and seq.state_slot >= 0:
            keep_rows(seq, row)

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

    def _reserve(self, n_pages: int, n_sliding: int = 0) -> bool:
        """Free pages in each group (the prefix cache gives up what it must); False if not."""
        if self.pool.num_free < n_pages and self.radix is not None:
            self.radix.evict(n_pages)
        if self.sliding is None:
            return self.pool.num_free >= n_pages
        if self.sliding.pool.num_free < n_sliding and self.radix is not None:
            self.radix.drop_windows(n_sliding)
        return self.pool.num_free >= n_pages and self.sliding.pool.num_free >= n_sliding

    def ensure_pages(self, seq: Sequence, num_tokens: int) -> bool:
        """Make room for the sequence's first `num_tokens` tokens; False if the pool is full."""
        need = self.pages_needed(seq, num_tokens)
        need_sliding = self.sliding.pages_needed(seq, num_tokens) if self.sliding else 0
        if need == 0 and need_sliding == 0:
            return True
        if not self._reserve(need, need_sliding):
            return False
        seq.page_table.extend(self.pool.alloc(need))
        if self.sliding is not None:
            self.sliding.extend(seq, num_tokens)
        return True

    def spare_pages(self, seq: Sequence, num_tokens: int) -> int:
        """Free pages left in the tighter group once `seq` has room for num_tokens tokens
        (without evicting anything)."""
        spare = self.pool.num_free - self.pages_needed(seq, num_tokens)
        if self.sliding is not None:
            spare = min(spare, self.sliding.pool.num_free - self.sliding.pages_needed(seq, num_tokens))
        return spare

    @property
    def free_pages(self) -> int:
        """Free pages in the tighter group."""
        if self.sliding is None:
            return self.pool.num_free
        return min(self.pool.num_free, self.sliding.pool.num_free)

    def tokens_that_fit(self, seq: Sequence) -> int:
        """How many tokens `seq` could have pages for with every free page (no eviction)."""
        fit = (len(seq.page_table) + self.pool.num_free) * self.page_size
        return min(fit, self.sliding.tokens_that_fit(seq)) if self.sliding is not None else fit

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the pages past the first `num_tokens` tokens (rejected draft slots)."""
        keep = _ceil_div(num_tokens, self.page_size)
        if len(seq.page_table) > keep:
            self.pool.decref(seq.page_table[keep:])
            del seq.page_table[keep:]
        if self.sliding is not None:
            self.sliding.trim(seq, num_tokens)

    def can_fit(self, num_pages: int) -> bool:
        evictable = self.radix.evictable_pages() if self.radix is not None else 0
        return self.pool.num_free + evictable >= num_pages

    # -- release ------------------------------------------------------------------------------
    def cache_prompt(self, seq: Sequence) -> None:
        """The prompt is computed: offer it to the prefix cache. Mixed models wait until the
        sequence stops running (finish, preemption): a window cached now would hold a second
        window per running sequence in a sliding group sized for one, and push out the windows
        that waiting conversations resume from."""
        if self.sliding is None:
            self.cache_sequence(seq)

    def cache_sequence(self, seq: Sequence) -> None:
        """Offer the computed tokens to the prefix cache (prompt done, finish, or preemption)."""
        if self.radix is None or seq.num_computed_tokens == 0 or seq.released_pages:
            return  # with released pages the prompt is cached already (release_outside_window)
        n = seq.num_computed_tokens
        ps = self.page_size
        slots = [seq.page_table[i // ps] * ps + i % ps for i in range(n)]
        window = self.sliding.window_slots(seq, n) if self.sliding is not None else None
        self.radix.insert(seq.token_ids[:n], slots, window)
        if self.state_slots is not None and seq.state_slot >= 0 and len(seq.token_ids) >= n:
            # The running slot holds the state after exactly these n tokens (with its pending
            # rows, which the copy applies): keep a copy there.
            node = self.radix.node_at(seq.token_ids[:n])
            snapshot = self.radix.attach_snapshot(node) if node is not None else None
            if snapshot is not None:
                self.copies.state.add(slot_word(seq), snapshot)

    def free(self, seq: Sequence, cache: bool = True) -> None:
        if cache:
            self.cache_sequence(seq)
        if seq.cache_node is not None and self.radix is not None:
            self.radix.unlock(seq.cache_node)
        seq.cache_node = None
        self.pool.decref(seq.page_table[seq.released_pages:])
        if self.sliding is not None:
            self.sliding.free(seq)
        seq.page_table = []
        seq.released_pages = 0
        seq.num_computed_tokens = 0
        if seq.state_slot >= 0 and self.state_slots is not None:
            self.state_slots.free_running(seq.state_slot)
            seq.state_slot = -1
        seq.gdn_pending = 0

    def release_outside_window(self, seq: Sequence) -> None:
        """Return the pages no later query of `seq` can see (see the module docstring). The next
        query sits at num_computed_tokens and sees keys > num_computed_tokens - window.
        Mixed models: the sliding group's pages, at once (the prefix cache takes what is left)."""
        if self.sliding is not None:
            self.sliding.release(seq)
        if not self.release_window:
            return
        if self.radix is not None and seq.num_computed_tokens < seq.num_prompt_tokens:
            return  # the prompt goes to the prefix cache whole first
        oldest = max(0, seq.num_computed_tokens - self.release_window + 1)
        upto = min(oldest // self.page_size, len(seq.page_table))
        if upto > seq.released_pages:
            self.pool.decref(seq.page_table[seq.released_pages:upto])
            seq.released_pages = upto

    def sliding_status(self) -> dict[str, int]:
        """/v1/status `kv` keys of the sliding page group ({} without one)."""
        if self.sliding is None:
            return {}
        pool = self.sliding.pool
        return {"sliding_group_window": self.sliding.window, "sliding_pages": pool.num_pages,
                "sliding_pages_used": pool.num_used,
                "sliding_bytes_per_token": pool.layout.bytes_per_token()}

    @property
    def tokens_used(self) -> int:
        return self.pool.num_used * self.page_size
