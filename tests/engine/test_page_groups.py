"""The page-group rules on their own (cache/page_groups.py) and the radix cache's window slots:
the budget split and its inverse, the window-held match length against a brute-force rule, and
reference counts in the sliding pool through insert, split, drop and evict."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from homelab_llm.engine.cache.page_groups import GroupSplit, sliding_page_cap, window_match_length
from homelab_llm.engine.cache.page_pool import KVLayout, PagePool
from homelab_llm.engine.cache.radix import RadixCache


@given(cap=st.integers(1, 500), full=st.integers(1, 4096), sliding=st.integers(1, 4096),
       pages=st.integers(0, 2000))
def test_split_round_trips_and_never_gives_sliding_more_than_full(cap, full, sliding, pages) -> None:
    split = GroupSplit(cap, full, sliding)
    assert split.full_pages_for_budget(split.bytes_for(pages)) == pages
    assert split.sliding_pages(pages) == min(pages, cap)
    # one byte short of the next page's share buys nothing more
    assert split.full_pages_for_budget(split.bytes_for(pages + 1) - 1) == pages


def test_sliding_page_cap_counts_windows_and_one_step() -> None:
    assert sliding_page_cap(1024, 16, 8, 2048) == 8 * (64 + 2) + 128
    assert sliding_page_cap(128, 16, 1, 100) == 8 + 2 + 7


def _brute(held: list[bool], length: int, window: int) -> int:
    ok = [m for m in range(length + 1) if all(held[max(0, m - window + 1):m])]
    return max(ok)


@settings(max_examples=200)
@given(held=st.lists(st.booleans(), min_size=0, max_size=40), window=st.integers(1, 12), data=st.data())
def test_window_match_length_is_the_longest_held_window(held, window, data) -> None:
    length = data.draw(st.integers(0, len(held)))
    slots = [i if h else -1 for i, h in enumerate(held)]
    assert window_match_length(slots, length, window) == _brute(held, length, window)


def _pools(pages: int = 16, page: int = 4) -> PagePool:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, page_size=page, dtype=torch.float32)
    pool = PagePool(layout, pages, torch.device("cpu"))
    pool.sliding = PagePool(layout, pages, torch.device("cpu"))
    return pool


def test_window_slots_references_through_split_drop_and_evict() -> None:
    pool = _pools()
    sliding = pool.sliding
    radix = RadixCache(pool)
    full_pages, window_pages = pool.alloc(3), sliding.alloc(3)
    tokens = list(range(100, 112))
    slots = [full_pages[i // 4] * 4 + i % 4 for i in range(12)]
    window = [-1] * 6 + [window_pages[i // 4] * 4 + i % 4 for i in range(6, 12)]
    radix.insert(tokens, slots, window)
    # the radix holds the two sliding pages with a held slot, not the first one
    assert [sliding.ref_counts[p] for p in window_pages] == [1, 2, 2]
    sliding.decref(window_pages)  # the sequence lets go
    pool.decref(full_pages)
    assert sliding.num_free == 16 - 2
    match = radix.match_prefix(tokens[:7] + [1])  # splits the node inside page 1
    assert match.length == 7 and match.window_slots[6] >= 0 and match.window_slots[5] == -1
    assert sliding.ref_counts[window_pages[1]] == 2  # both halves hold page 1
    radix.drop_windows(16)
    assert sliding.num_free == 16 and all(n.window_slots == [-1] * len(n.key) for n in radix.nodes())
    assert pool.num_free == 16 - 3  # the full group's KV stays cached
    radix.evict(pool.num_pages)
    assert pool.num_free == 16 and sliding.num_free == 16
