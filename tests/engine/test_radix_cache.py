"""Property tests for the radix prefix cache and the KV manager around it.

The fake KV stores each token's id at its slot, so every check can read back what a sequence or a
cache node points at and compare it with the tokens it claims to hold.
"""

from __future__ import annotations

from collections import Counter

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from homelab_llm.engine.cache.kv_manager import KVCacheManager
from homelab_llm.engine.cache.page_pool import KVLayout, PagePool
from homelab_llm.engine.cache.radix import RadixCache
from homelab_llm.engine.sampling_params import SamplingParams
from homelab_llm.engine.sequence import Sequence

PAGE = 4


def make_manager(num_pages: int) -> KVCacheManager:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, page_size=PAGE, dtype=torch.float32)
    return KVCacheManager(PagePool(layout, num_pages, torch.device("cpu")), enable_prefix_caching=True)


def write_kv(kv: KVCacheManager, seq: Sequence, upto: int) -> None:
    """Pretend the model computed tokens [num_computed, upto): store each token id at its slot."""
    flat = kv.pool.k_caches[0].view(-1)
    for i in range(seq.num_computed_tokens, upto):
        flat[seq.page_table[i // PAGE] * PAGE + i % PAGE] = float(seq.token_ids[i])
    seq.num_computed_tokens = upto


def match(kv: KVCacheManager, seq: Sequence) -> None:
    """Admission's prefix match, then the KV copies it queued (the runner runs them before the
    next forward)."""
    kv.match_prefix(seq)
    copies = kv.copies.take()
    kv.pool.copy_slots(copies.kv.src, copies.kv.dst)


def slot_values(kv: KVCacheManager, slots: list[int]) -> list[int]:
    flat = kv.pool.k_caches[0].view(-1)
    return [int(flat[s]) for s in slots]


def check_invariants(kv: KVCacheManager, live: list[Sequence]) -> None:
    pool, radix = kv.pool, kv.radix
    assert radix is not None
    holders: Counter[int] = Counter()
    for node in radix.nodes():
        assert len(node.key) == len(node.slots) > 0
        assert slot_values(kv, node.slots) == node.key, "a cache node points at overwritten rows"
        holders.update({s // PAGE for s in node.slots})
    for seq in live:
        holders.update(seq.page_table)
        n = seq.num_computed_tokens
        slots = [seq.page_table[i // PAGE] * PAGE + i % PAGE for i in range(n)]
        assert slot_values(kv, slots) == seq.token_ids[:n], "a sequence lost its KV"
    free = set(pool._free)
    assert len(free) == len(pool._free), "a page is on the free list twice"
    for page in range(pool.num_pages):
        assert pool.ref_counts[page] == holders[page], f"page {page} refcount"
        assert (page in free) == (holders[page] == 0)
    assert radix.cached_tokens == sum(len(n.key) for n in radix.nodes())


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.integers(1, 3), min_size=1, max_size=18)),
        st.tuples(st.just("finish"), st.integers(0, 7)),
        st.tuples(st.just("grow"), st.integers(0, 7)),
        st.tuples(st.just("evict"), st.integers(0, 12)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_random_operations_keep_counts_consistent(operations) -> None:
    kv = make_manager(num_pages=12)
    live: list[Sequence] = []
    for i, (op, arg) in enumerate(operations):
        if op == "add":
            seq = Sequence(f"r{i}", list(arg), SamplingParams(), 0.0, max_tokens=4)
            match(kv, seq)
            matched = seq.num_computed_tokens
            assert matched <= len(arg) - 1
            if kv.ensure_pages(seq, len(arg)):
                write_kv(kv, seq, len(arg))
                kv.cache_sequence(seq)
                live.append(seq)
            else:
                kv.free(seq, cache=False)
        elif op == "finish" and live:
            kv.free(live.pop(arg % len(live)), cache=True)
        elif op == "grow" and live:
            seq = live[arg % len(live)]
            seq.token_ids.append(1 + arg % 3)
            if kv.ensure_pages(seq, seq.num_tokens):
                write_kv(kv, seq, seq.num_tokens)
            else:
                seq.token_ids.pop()
        elif op == "evict":
            kv.radix.evict(arg)
        check_invariants(kv, live)
    for seq in live:
        kv.free(seq)
    kv.radix.evict(kv.pool.num_pages)
    assert kv.pool.num_free == kv.pool.num_pages, "pages leaked once everything is released"


def test_match_is_token_granular_and_copies_the_partial_page() -> None:
    kv = make_manager(num_pages=16)
    first = Sequence("a", list(range(1, 12)), SamplingParams(), 0.0, max_tokens=4)  # 11 tokens
    match(kv, first)
    kv.record_admission(first)
    kv.record_admission(first)  # counted once
    assert kv.ensure_pages(first, first.num_tokens)
    write_kv(kv, first, first.num_tokens)
    kv.cache_sequence(first)

    # Shares 10 tokens: pages 0-1 full (8 tokens) + 2 tokens of page 2.
    second = Sequence("b", list(range(1, 11)) + [99, 98], SamplingParams(), 0.0, max_tokens=4)
    match(kv, second)
    kv.record_admission(second)
    assert second.num_computed_tokens == 10 and second.num_cached_tokens == 10
    assert second.page_table[:2] == first.page_table[:2], "full pages are shared, not copied"
    assert second.page_table[2] != first.page_table[2], "the partial page is a private copy"
    assert kv.ensure_pages(second, second.num_tokens)
    write_kv(kv, second, second.num_tokens)
    check_invariants(kv, [first, second])
    assert kv.prefix_hit_tokens == 10 and kv.prefix_query_tokens == 11 + 12


def test_match_leaves_one_token_to_compute() -> None:
    kv = make_manager(num_pages=8)
    seq = Sequence("a", [5, 6, 7, 8], SamplingParams(), 0.0, max_tokens=4)
    match(kv, seq)
    kv.ensure_pages(seq, 4)
    write_kv(kv, seq, 4)
    kv.free(seq)
    again = Sequence("b", [5, 6, 7, 8], SamplingParams(), 0.0, max_tokens=4)
    match(kv, again)
    assert again.num_computed_tokens == 3


def test_eviction_spares_locked_paths_and_pages_in_use() -> None:
    kv = make_manager(num_pages=6)
    radix: RadixCache = kv.radix
    a = Sequence("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(), 0.0, max_tokens=4)
    match(kv, a)
    kv.ensure_pages(a, a.num_tokens)
    write_kv(kv, a, a.num_tokens)
    kv.free(a)  # cached, unlocked
    b = Sequence("b", [1, 2, 3, 4, 5, 6, 7, 8, 1], SamplingParams(), 0.0, max_tokens=4)
    match(kv, b)  # locks the 8-token path
    kv.ensure_pages(b, b.num_tokens)
    write_kv(kv, b, b.num_tokens)
    radix.evict(kv.pool.num_pages)  # asks for everything
    check_invariants(kv, [b])
    assert radix.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).length == 8, "a locked path was evicted"
