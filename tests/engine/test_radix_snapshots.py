"""Radix tree with Gated DeltaNet state snapshots (hybrid models): matches end at a snapshot,
snapshots stay with the node that ends where they were taken (splits included), the bounded pool
evicts the least recently used unlocked one, and a node that goes frees its snapshot."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from homelab_llm.engine.cache.page_pool import KVLayout, PagePool
from homelab_llm.engine.cache.radix import RadixCache
from homelab_llm.engine.cache.state_pool import StateSlots

PAGE = 4


def make(num_pages: int = 64, snapshots: int = 3) -> RadixCache:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, page_size=PAGE, dtype=torch.float32)
    pool = PagePool(layout, num_pages, torch.device("cpu"))
    return RadixCache(pool, StateSlots(num_running=2, num_snapshots=snapshots))


def insert(radix: RadixCache, tokens: list[int]) -> int | None:
    """Cache tokens on fresh pages and snapshot their end, as kv_manager.cache_sequence does."""
    pages = radix.pool.alloc(-(-len(tokens) // PAGE))
    radix.insert(tokens, [pages[i // PAGE] * PAGE + i % PAGE for i in range(len(tokens))])
    radix.pool.decref(pages)  # the tree holds its own references now
    return radix.attach_snapshot(radix.node_at(tokens))


def test_match_stops_at_the_deepest_snapshot_and_splits_keep_it():
    radix = make()
    assert insert(radix, [1, 2, 3, 4, 5, 6]) is not None
    assert radix.match_prefix([1, 2, 3, 4, 5, 6, 7]).length == 6
    assert radix.match_prefix([1, 2, 3, 4, 9]).length == 0, "no snapshot at 4 tokens"
    # Inserting a branch splits the node at 4 tokens: the snapshot stays at the 6-token end.
    assert insert(radix, [1, 2, 3, 4, 8]) is not None
    assert radix.match_prefix([1, 2, 3, 4, 5, 6]).length == 6
    assert radix.match_prefix([1, 2, 3, 4, 8, 1]).length == 5
    assert insert(radix, [1, 2, 3, 4]) is not None  # a snapshot at the split point itself
    assert radix.match_prefix([1, 2, 3, 4, 9]).length == 4


def test_full_pool_drops_the_lru_unlocked_snapshot():
    radix = make(snapshots=2)
    insert(radix, [1, 1, 1])
    insert(radix, [2, 2, 2])
    locked = radix.match_prefix([1, 1, 1, 0])
    radix.lock(locked.node)  # [1,1,1] is older but in use
    insert(radix, [3, 3, 3])
    assert radix.match_prefix([2, 2, 2, 0]).length == 0, "the LRU unlocked snapshot went"
    assert radix.match_prefix([1, 1, 1, 0]).length == 3 and radix.match_prefix([3, 3, 3, 0]).length == 3
    assert radix.snapshots.snapshots_held == 2


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(1, 3), min_size=1, max_size=9)),
                max_size=30))
def test_random_inserts_and_evictions_keep_snapshot_counts(ops):
    radix = make(num_pages=40, snapshots=3)
    for evict, tokens in ops:
        if evict:
            radix.evict(radix.pool.num_pages)
        elif radix.pool.num_free >= 3:
            insert(radix, tokens)
        held = [n for n in radix.nodes() if n.snapshot is not None]
        assert len(held) == radix.snapshots.snapshots_held <= 3
        assert len({n.snapshot for n in held}) == len(held), "two nodes share a snapshot slot"
        match = radix.match_prefix(tokens)
        assert match.length == 0 or match.node.snapshot is not None
    radix.evict(radix.pool.num_pages)
    assert radix.snapshots.snapshots_held == 0 and radix.pool.num_free == radix.pool.num_pages
