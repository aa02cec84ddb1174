"""Cache copies a step must run before its forward, on every rank: KV rows (a partially matched
prefix page copied into a sequence's own page; on a model with a sliding page group,
cache/page_groups.py, that group's rows separately) and Gated DeltaNet state slots (prefix
snapshots saved and restored on hybrid models).

Rank 0's cache manager queues them while it schedules; they travel in the step plan as int64
words, so every tensor-parallel rank applies the same copies, in queue order (a later copy may
read what an earlier one wrote), right before the forward that reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SlotCopies:
    """Pairs src[i] -> dst[i] of one kind of slot, in the order they must run."""

    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)

    def add(self, src: int, dst: int) -> None:
        self.src.append(src)
        self.dst.append(dst)

    def extend(self, src: list[int], dst: list[int]) -> None:
        self.src.extend(src)
        self.dst.extend(dst)

    def __bool__(self) -> bool:
        return bool(self.src)


@dataclass
class CacheCopies:
    kv: SlotCopies = field(default_factory=SlotCopies)  # KV slots: page * page_size + offset
    state: SlotCopies = field(default_factory=SlotCopies)  # state pool slots
    sliding_kv: SlotCopies = field(default_factory=SlotCopies)  # the sliding group's KV slots

    def take(self) -> CacheCopies:
        """What is queued now; the queue starts empty again."""
        out = CacheCopies(self.kv, self.state, self.sliding_kv)
        self.kv, self.state, self.sliding_kv = SlotCopies(), SlotCopies(), SlotCopies()
        return out

    def words(self) -> list[int]:
        """[n_kv, kv src.., kv dst.., n_state, state src.., state dst.., n_sliding, ...]"""
        out: list[int] = []
        for copies in (self.kv, self.state, self.sliding_kv):
            out += [len(copies.src)] + copies.src + copies.dst
        return out

    @classmethod
    def from_words(cls, words: list[int]) -> CacheCopies:
        parts, at = [], 0
        for _ in range(3):
            n = words[at]
            parts.append(SlotCopies(words[at + 1:at + 1 + n], words[at + 1 + n:at + 1 + 2 * n]))
            at += 1 + 2 * n
        return cls(*parts)
