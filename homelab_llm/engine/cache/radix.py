"""Token-granular radix prefix cache over the page pool.

Each edge holds a run of token ids and, per token, the KV slot (page * page_size + offset) where
that token's K/V live. A match can end at any token, not only at a page boundary: the caller shares
the fully matched pages and copies the rows of a partially matched one (see `pages_for_match`).

Ownership: a node holds one reference on every distinct page among its slots. Splitting a node
whose halves share a page adds a reference, so the pool's counts always equal holders. Eviction
removes unlocked leaves in least-recently-used order; a page still listed by a running sequence
keeps that sequence's reference and is never freed under it.

Hybrid models (Gated DeltaNet layers) also need the recurrent state at the point a match ends:
a node may hold a state snapshot slot (cache/state_pool.py) taken after its last token, and a
hybrid match stops at the deepest node that has one. Snapshots live in a bounded pool: when it is
full, the least recently used snapshot of an unlocked node goes (the node keeps its KV); a node
that is evicted frees its snapshot with it.

Models with a sliding page group (cache/page_groups.py): each token also has a slot in the
sliding group's pool (`window_slots`), or -1 where the sequence had already given that page back
when the tokens were inserted. A node holds one reference on every distinct sliding page among
its held window slots. A match is usable only where the window before its end is held (the
caller shortens it, page_groups.window_match_length); when the sliding pool runs short, nodes
drop their window slots first (`drop_windows`), keeping their full-group KV for matches that end
further on.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from homelab_llm.engine.cache.page_pool import PagePool
from homelab_llm.engine.cache.state_pool import StateSlots


@dataclass(eq=False)
class RadixNode:
    key: list[int]
    slots: list[int]
    parent: "RadixNode | None"
    children: dict[int, "RadixNode"] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    snapshot: int | None = None  # state slot holding the GDN state after this node's last token
    window_slots: list[int] = field(default_factory=list)  # sliding group slots (-1: not held)


@dataclass
class PrefixMatch:
    length: int  # matched tokens
    slots: list[int]  # KV slot of each matched token
    node: RadixNode  # deepest node of the match (the match ends exactly at its end)
    window_slots: list[int] = field(default_factory=list)  # sliding group slot of each token


def _common_prefix(a: list[int], b: list[int], start_b: int) -> int:
    n = min(len(a), len(b) - start_b)
    i = 0
    while i < n and a[i] == b[start_b + i]:
        i += 1
    return i


class RadixCache:
    def __init__(self, pool: PagePool, snapshots: StateSlots | None = None) -> None:
        self.pool = pool
        self.sliding = pool.sliding  # the sliding page group's pool, on mixed models
        self.snapshots = snapshots  # set on hybrid models: matches must end at a snapshot
        self.snapshot_hits = 0
        self.page_size = pool.page_size
        self.root = RadixNode(key=[], slots=[], parent=None, lock_ref=1)
        self._clock = 0
        self.cached_tokens = 0

    # -- helpers ------------------------------------------------------------------------------
    def _pages(self, slots: list[int]) -> list[int]:
        return sorted({s // self.page_size for s in slots if s >= 0})

    def _touch(self, node: RadixNode) -> None:
        self._clock += 1
        node.last_access = self._clock

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut `node` after its first k tokens; returns the new upper node."""
        assert 0 < k < len(node.key) and node.parent is not None
        upper = RadixNode(key=node.key[:k], slots=node.slots[:k], parent=node.parent,
                          lock_ref=node.lock_ref, last_access=node.last_access,
                          window_slots=node.window_slots[:k])
        node.parent.children[upper.key[0]] = upper
        node.key, node.slots = node.key[k:], node.slots[k:]
        node.window_slots = node.window_slots[k:]
        node.parent = upper
        upper.children[node.key[0]] = node
        shared = set(self._pages(upper.slots)) & set(self._pages(node.slots))
        self.pool.incref(sorted(shared))
        if self.sliding is not None:
            shared = set(self._pages(upper.window_slots)) & set(self._pages(node.window_slots))
            self.sliding.incref(sorted(shared))
        return upper

    # -- queries ------------------------------------------------------------------------------
    def match_prefix(self, tokens: list[int]) -> PrefixMatch:
        """The longest cached prefix of `tokens`; with snapshots (hybrid models), the longest one
        that ends at a node holding a state snapshot."""
        node, i, slots, window = self.root, 0, [], []
        best = PrefixMatch(length=0, slots=[], node=self.root)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            k = _common_prefix(child.key, tokens, i)
            if k < len(child.key):
                child = self._split(child, k)
            self._touch(child)
            slots.extend(child.slots)
            window.extend(child.window_slots)
            node, i = child, i + k
            if self.snapshots is None or node.snapshot is not None:
                best = PrefixMatch(length=i, slots=list(slots), node=node, window_slots=list(window))
        return best

    def node_at(self, tokens: list[int]) -> RadixNode | None:
        """The node that ends exactly after `tokens` (split to make one), if they are cached."""
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                return None
            k = _common_prefix(child.key, tokens, i)
            if k < len(child.key):
                if i + k < len(tokens):
                    return None
                child = self._split(child, k)
            node, i = child, i + k
        return None if node is self.root else node

    # -- state snapshots (hybrid models) ------------------------------------------------------
    def attach_snapshot(self, node: RadixNode) -> int | None:
        """A snapshot slot for `node` (None if it has one already or none can be freed); the
        caller copies the state into it."""
        assert self.snapshots is not None
        if node.snapshot is not None:
            self._touch(node)
            return None
        slot = self.snapshots.alloc_snapshot()
        if slot is None and self._drop_lru_snapshot():
            slot = self.snapshots.alloc_snapshot()
        node.snapshot = slot
        return slot

    def _drop_lru_snapshot(self) -> bool:
        held = [n for n in self.nodes() if n.snapshot is not None and n.lock_ref == 0]
        if not held:
            return False
        self._free_snapshot(min(held, key=lambda n: n.last_access))
        return True

    def _free_snapshot(self, node: RadixNode) -> None:
        if node.snapshot is not None and self.snapshots is not None:
            self.snapshots.free_snapshot(node.snapshot)
        node.snapshot = None

    def insert(self, tokens: list[int], slots: list[int], window_slots: list[int] | None = None) -> int:
        """Store tokens with their slots (and, with a sliding group, their window slots); the
        part already present keeps its slots. Returns the number of newly cached tokens."""
        assert len(tokens) == len(slots)
        assert (window_slots is not None) == (self.sliding is not None)
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf = RadixNode(key=tokens[i:], slots=slots[i:], parent=node,
                                 window_slots=window_slots[i:] if window_slots is not None else [])
                node.children[tokens[i]] = leaf
                self.pool.incref(self._pages(leaf.slots))
                if self.sliding is not None:
                    self.sliding.incref(self._pages(leaf.window_slots))
                self._touch(leaf)
                added = len(tokens) - i
                self.cached_tokens += added
                return added
            k = _common_prefix(child.key, tokens, i)
            if k < len(child.key):
                child = self._split(child, k)
            self._touch(child)
            node, i = child, i + k
        return 0

    def lock(self, node: RadixNode) -> None:
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not None:
            assert node.lock_ref > 0
            node.lock_ref -= 1
            node = node.parent

    def evict(self, target_free_pages: int) -> int:
        """Drop unlocked leaves, oldest first, until the pool has `target_free_pages` free or
        nothing more can go. Returns the number of tokens evicted."""
        if self.pool.num_free >= target_free_pages:
            return 0
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        evicted = 0
        while heap and self.pool.num_free < target_free_pages:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self.pool.decref(self._pages(leaf.slots))
            self._drop_window(leaf)
            self._free_snapshot(leaf)
            evicted += len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self.cached_tokens -= evicted
        return evicted

    def drop_windows(self, target_free_pages: int) -> None:
        """Sliding group short: nodes give back their window slots until its pool has
        `target_free_pages` free or no node holds any. Locked nodes go first: a running sequence
        resumed from there already (it keeps its own references to the pages it still reads,
        and its window returns to the cache when it stops); then the others, least recently
        used first, so waiting conversations keep the windows they resume from."""
        assert self.sliding is not None
        if self.sliding.num_free >= target_free_pages:
            return
        # held slots end a node (an insertion keeps the window before its end): look from there
        held = [n for n in self.nodes() if any(s >= 0 for s in reversed(n.window_slots))]
        for node in sorted(held, key=lambda n: (n.lock_ref == 0, n.last_access)):
            self._drop_window(node)
            if self.sliding.num_free >= target_free_pages:
                return

    def _drop_window(self, node: RadixNode) -> None:
        if self.sliding is not None:
            self.sliding.decref(self._pages(node.window_slots))
            node.window_slots = [-1] * len(node.key)

    def _leaves(self) -> list[RadixNode]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n is not self.root:
                out.append(n)
        return out

    def nodes(self) -> list[RadixNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def evictable_pages(self) -> int:
        """An upper bound on pages eviction could free right now (for admission decisions)."""
        return sum(len(self._pages(n.slots)) for n in self.nodes() if n.lock_ref == 0)

    # -- turning a match into a page table ----------------------------------------------------
    def pages_for_match(self, match: PrefixMatch) -> list[int | list[int]]:
        """One entry per logical page the match touches (see `page_plan`)."""
        return page_plan(match.slots[:match.length], self.page_size)


def page_plan(slots: list[int], page_size: int, first_page: int = 0) -> list[int | list[int]]:
    """One entry per logical page of `slots` from `first_page` on: a page id to share as it is,
    or the list of slots whose rows must be copied into a fresh page (a partially matched page,
    one whose rows came from different sequences' pages, or one with rows not held: -1, which
    are not copied)."""
    ps = page_size
    plan: list[int | list[int]] = []
    for j in range(first_page * ps, len(slots), ps):
        rows = slots[j:j + ps]
        page = rows[0] // ps
        if len(rows) == ps and rows[0] >= 0 and all(r // ps == page and r >= 0 for r in rows):
            plan.append(page)
        else:
            plan.append(rows)
    return plan
