"""Scheduler: continuous batching with chunked prefill and preemption by recompute.

Each step: running decodes first (one token each), then running prefills continue in chunks, then
waiting requests are admitted, all within max_num_batched_tokens and max_num_seqs. When pages run
out, the newest running sequence is preempted: its pages go back (its computed tokens stay in the
prefix cache) and it waits at the front of the queue to be recomputed. Nothing is dropped.

Speculative decoding: a running sequence past its prompt that carries drafts (`seq.spec_token_ids`)
is scheduled with its uncomputed tokens (one, for a decode) + K drafts when the budget and free
pages allow (drafts never evict the prefix
cache nor preempt anyone: they only take pages that leave one free page per running sequence);
else it runs as a plain decode. After verification `rollback` drops what was rejected.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from homelab_llm.engine.cache.kv_manager import KVCacheManager
from homelab_llm.engine.cache.copies import CacheCopies
from homelab_llm.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # drafts included
    spec: list[int] = field(default_factory=list)  # draft tokens verified this step

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens this step computes (recomputed output tokens after preemption excluded)."""
        start = self.seq.num_computed_tokens
        return max(0, min(self.seq.num_prompt_tokens, start + self.num_new_tokens) - start)

    @property
    def samples(self) -> bool:
        """This step computes the sequence's last known token, so it yields the next one."""
        return self.seq.num_computed_tokens + self.num_new_tokens - len(self.spec) == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]
    # KV rows and (hybrid models) state slots to copy before this step's forward.
    copies: CacheCopies = field(default_factory=CacheCopies)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        taken: set[int] = set()

        decodes = [s for s in self.running if s.is_decoding]
        prefills = [s for s in self.running if not s.is_decoding]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            spec = self._drafts_that_fit(seq, budget)
            if spec:
                n = seq.num_uncomputed_tokens + len(spec)
                scheduled.append(ScheduledSeq(seq, n, spec))
                taken.add(id(seq))
                budget -= n
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.kv.ensure_pages(seq, seq.num_computed_tokens + n):
                victim = self._pick_victim(exclude=taken)
                if victim is None or victim is seq:
                    self._preempt(seq, preempted)
                    break
                self._preempt(victim, preempted)
            else:
                scheduled.append(ScheduledSeq(seq, n))
                taken.add(id(seq))
                budget -= n

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.page_table:
                self.kv.match_prefix(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.kv.ensure_pages(seq, seq.num_computed_tokens + n):
                if not self.running and not scheduled:
                    # Alone and still no room: the pool is smaller than this chunk. Shrink the
                    # chunk to what fits rather than wait forever.
                    n = self._largest_chunk_that_fits(seq, n)
                if n == 0 or not self.kv.ensure_pages(seq, seq.num_computed_tokens + n):
                    self.kv.free(seq, cache=False)
                    break
            self.waiting.popleft()
            self.kv.assign_state_slot(seq)
            self.kv.record_admission(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, n))
            taken.add(id(seq))
            budget -= n
        return SchedulerOutput(scheduled, preempted, self.kv.copies.take())

    def _drafts_that_fit(self, seq: Sequence, budget: int) -> list[int]:
        """The drafts this sequence can verify now, after all its uncomputed tokens (one for a
        decode; exactly one on hybrid models, whose verify rows chain from the computed state):
        within the budget and on free pages only."""
        drafts = seq.spec_token_ids
        todo = seq.num_uncomputed_tokens
        if not drafts or seq.num_output_tokens == 0 or todo < 1 or budget <= todo:
            return []
        if seq.state_slot >= 0 and (todo != 1 or seq.num_computed_tokens == 0):
            return []
        drafts = drafts[:budget - todo]
        end = seq.num_computed_tokens + todo + len(drafts)
        if self.kv.spare_pages(seq, end) < len(self.running):
            return []
        ok = self.kv.ensure_pages(seq, end)
        assert ok
        return drafts

    def _largest_chunk_that_fits(self, seq: Sequence, n: int) -> int:
        return max(0, min(n, self.kv.tokens_that_fit(seq) - seq.num_computed_tokens))

    def _pick_victim(self, exclude: set[int]) -> Sequence | None:
        for seq in reversed(self.running):
            if id(seq) not in exclude:
                return seq
        return None

    def _preempt(self, seq: Sequence, preempted: list[Sequence], cache: bool = True) -> None:
        self.running.remove(seq)
        self.kv.free(seq, cache=cache)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        preempted.append(seq)

    def recompute(self, seq: Sequence, cache: bool = False) -> None:
        """Send a running sequence back to the front of the waiting queue, to be computed again
        from its tokens. By default it offers nothing to the prefix cache (its state may be
        half-advanced: LLMEngine's retry of a faulted forward on a hybrid model); cache=True
        offers its computed prefix first, as a preemption for pages does."""
        if seq in self.running:
            self._preempt(seq, [], cache=cache)

    # -- after the forward --------------------------------------------------------------------
    def advance(self, out: SchedulerOutput, decode_widths: list[int] | None = None) -> None:
        """Mark the step's tokens as computed; offer finished prompts to the prefix cache.
        decode_widths: each item's decode-group width in the step's plan (step_plan.plan_order;
        0: a varlen query), which leaves a hybrid sequence's verify rows pending or applied."""
        for i, item in enumerate(out.scheduled):
            seq = item.seq
            if decode_widths and decode_widths[i]:
                self.kv.ran_decode_rows(seq, decode_widths[i])
            before = seq.num_computed_tokens
            seq.num_computed_tokens += item.num_new_tokens - len(item.spec)  # drafts: rollback()
            if before < seq.num_prompt_tokens <= seq.num_computed_tokens:
                self.kv.cache_prompt(seq)
            self.kv.release_outside_window(seq)

    def rollback(self, item: ScheduledSeq, num_accepted: int) -> None:
        """After verifying drafts: the accepted ones have KV (clamped to the tokens the sequence
        kept, should a stop cut them), the rejected ones never existed: their pages beyond the
        sequence's tokens go back. The radix cache only ever sees tokens below num_computed.

        Hybrid models: the verify forward left its rows pending in the sequence's slot
        (cache/verify_slots.py); it keeps those up to the last kept token, so the state equals
        that of a run that never drafted. Runs after advance()."""
        seq, num_drafted = item.seq, len(item.spec)
        start = seq.num_computed_tokens - (item.num_new_tokens - num_drafted)  # before the step
        computed = min(seq.num_computed_tokens + num_accepted, seq.num_tokens)
        if num_drafted:
            self.kv.keep_verified_state(seq, computed - start - 1)
        seq.num_computed_tokens = computed
        self.kv.trim(seq, seq.num_tokens)

    def finish(self, seq: Sequence, cache: bool = True) -> None:
        """Take a sequence out of whichever queue holds it and release its pages (offering its
        computed tokens to the prefix cache unless `cache` is False)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        if seq.page_table or seq.cache_node is not None:
            self.kv.free(seq, cache=cache)
