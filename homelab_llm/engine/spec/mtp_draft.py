"""MTP drafting after a step: the head's pass over the step's tokens, then its chain.

Pass. The MTP head's input at position p is (t_{p+1}, h_p): the target's final hidden state at p
and the token after it. Once a step's tokens are sampled (and drafts accepted or rolled back), for
every sequence the step computed, the pass runs over the step's positions p whose t_{p+1} is now
known: a prefill chunk's positions (the last one's next token is the sampled one, or the next
prompt token), or a verify step's last token and its accepted drafts (rejected rows are dropped:
their hidden states followed tokens that never happened). It writes the head's KV at those
positions, in the sequence's own pages, so every later pass attends over the whole prefix, as the
target's layers do. A position a later step recomputes (after a preemption) is simply passed
again, with the same inputs.

Chain. A sequence whose pass reached its last token (p = num_tokens - 2) and may draft gets draft 1
from the pass's last row (argmax; drafts are point proposals, spec/verify.py), then draft j+1 from
the head run at position num_tokens - 2 + j on (draft j, h'_j). Those chain rows write the head's
KV at positions the next verify step passes again before anything reads them, so they never leave
a wrong entry behind; they need pages up to position num_tokens + K - 3, which are taken only
while one free page per running sequence remains (as the scheduler's drafts); short of pages, the
chain is shorter.

Each head forward is one runner call (Runner.run_mtp): a step plan like any other, plus which
hidden-state rows feed it, run on every tensor-parallel rank. A chain step's input tokens are
the previous forward's argmax rows, taken on the device (Runner.run_mtp): rank 0 reads all the
drafts once, after the last forward.
The pass lays a sequence's kept rows out as decode rows (one-token queries) after a decode or
verify step, so a pass over decode and verify steps only, like every chain step, is decode-only
and replays the head's captured graphs (spec/mtp_graphs.py); a prefill chunk's pass runs eagerly.

Prefix caching: cached pages carry the head's KV of the positions passed before they were cached.
The last position of a match was passed with the cached sequence's next token, and positions a
request computed in its final step were never passed: both only make later drafts worse, never the
output (every draft is verified).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from homelab_llm.engine.cache.kv_manager import KVCacheManager
from homelab_llm.engine.runner_protocol import Runner
from homelab_llm.engine.scheduler import ScheduledSeq
from homelab_llm.engine.sequence import Sequence
from homelab_llm.engine.spec.drafter import room_for_drafts
from homelab_llm.engine.spec.mtp import MtpProposer
from homelab_llm.engine.step_plan import first_rows, plan_from_lists


@dataclass(frozen=True)
class MtpWork:
    """One sequence's rows in a step: positions start.. and hidden rows first_row.., num_rows
    of them (drafts included). Taken before the step advances the sequence."""
    seq: Sequence
    start: int
    first_row: int
    num_rows: int


def collect_work(scheduled: list[ScheduledSeq], verify_width: int) -> list[MtpWork]:
    """The step's rows per sequence, where the step plan lays them out (step_plan.first_rows)."""
    return [MtpWork(item.seq, item.seq.num_computed_tokens, first, item.num_new_tokens)
            for item, first in zip(scheduled, first_rows(scheduled, verify_width))]


@dataclass
class _Rows:
    """The lists of one MTP forward's plan (step_plan.plan_from_lists)."""
    ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    tables: list[list[int]]
    logits_rows: list[int]

    @classmethod
    def empty(cls) -> _Rows:
        return cls([], [], [], [], [], [], [])

    def add(self, seq: Sequence, ids: list[int], start: int, page_size: int, split: bool = False) -> None:
        """Tokens `ids` at positions start..: one query, or with `split` one one-token query per
        token (decode rows: row j sees positions up to start + j, as the one query's row j would)."""
        end = start + len(ids)
        self.ids.extend(ids)
        self.positions.extend(range(start, end))
        pt = seq.page_table
        self.slots.extend(pt[p // page_size] * page_size + p % page_size for p in range(start, end))
        if split:
            self.query_lens.extend([1] * len(ids))
            self.seq_lens.extend(range(start + 1, end + 1))
            self.tables.extend([pt] * len(ids))
        else:
            self.query_lens.append(len(ids))
            self.seq_lens.append(end)
            self.tables.append(pt)


class MtpDrafter:
    """Runs the MTP head after each step (through the runner: on every tensor-parallel rank)
    and stores the drafts."""

    def __init__(self, runner: Runner, proposer: MtpProposer, kv: KVCacheManager,
                 max_model_len: int) -> None:
        self.runner = runner
        self.proposer = proposer
        self.kv = kv
        self.max_model_len = max_model_len
        self.page_size = kv.page_size

    def reserve_chain(self, seq: Sequence, num_running: int) -> int:
        """Drafts to make for `seq`: what the drafter will take, cut to the pages that fit; the
        pages its chain rows write are taken here (the next verify step needs them anyway)."""
        k = 0 if seq.grammar is not None else room_for_drafts(seq, self.proposer.k, self.max_model_len)
        while k > 1:
            end = seq.num_tokens - 2 + k  # chain rows reach position num_tokens + k - 3
            need = self.kv.pages_needed(seq, end)
            if need == 0 or (self.kv.pool.num_free - need >= num_running and self.kv.ensure_pages(seq, end)):
                break
            k -= 1
        return k

    def draft(self, work: list[MtpWork], num_running: int) -> None:
        """The pass over `work` (the last forward's sequences) and the chains it starts."""
        rows, hidden_rows = _Rows.empty(), []
        chains: list[tuple[Sequence, int]] = []
        for w in work:
            seq = w.seq
            kept = min(w.num_rows, seq.num_tokens - 1 - w.start) if not seq.is_finished else 0
            if kept <= 0:
                continue
            rows.add(seq, seq.token_ids[w.start + 1:w.start + 1 + kept], w.start, self.page_size,
                     split=pass_as_decode_rows(kept, self.proposer.k))
            hidden_rows.extend(range(w.first_row, w.first_row + kept))
            if w.start + kept == seq.num_tokens - 1 and seq.num_output_tokens > 0:
                k = self.reserve_chain(seq, num_running)
                if k:
                    rows.logits_rows.append(len(rows.ids) - 1)
                    chains.append((seq, k))
        if not rows.ids:
            return
        outputs = [self._run(rows, hidden_rows, step=0)]  # draft 1 of every chain
        for step in range(1, max((k for _, k in chains), default=0)):
            active = [i for i, (_, k) in enumerate(chains) if k > step]
            rows = _Rows.empty()
            for i in active:
                seq = chains[i][0]
                # the input token is draft `step`: the runner takes it from the previous output
                rows.add(seq, [0], seq.num_tokens - 2 + step, self.page_size)
            rows.logits_rows.extend(range(len(active)))
            outputs.append(self._run(rows, _positions_in(active, chains, step), step))
        if chains:
            for (seq, _), tokens in zip(chains, _chain_drafts(outputs, chains)):
                self.proposer.store(seq.request_id, seq.num_tokens, tokens)

    def _run(self, rows: _Rows, hidden_rows: list[int], step: int) -> torch.Tensor:
        """One head forward: the argmax token of each logits row (on the device)."""
        plan = plan_from_lists(rows.ids, rows.positions, rows.slots, rows.query_lens, rows.seq_lens,
                               rows.tables, rows.logits_rows)
        return self.runner.run_mtp(plan, hidden_rows, step)


def _chain_drafts(outputs: list[torch.Tensor], chains: list[tuple[Sequence, int]]) -> list[list[int]]:
    """Each chain's drafts from the head forwards' argmax rows (forward s holds the chains still
    running at step s, in order), read to the host at once: the only sync of the drafting."""
    host = torch.cat(outputs).tolist()
    drafts: list[list[int]] = [[] for _ in chains]
    at = 0
    for step in range(len(outputs)):
        for i in (i for i, (_, k) in enumerate(chains) if k > step):
            drafts[i].append(host[at])
            at += 1
    return drafts


def pass_as_decode_rows(kept: int, k: int) -> bool:
    """Whether a sequence's pass rows go in as decode rows (one-token queries) rather than one
    query: after a decode or verify step (at most K+1 kept rows). A pass of decode rows only is
    decode-only, so the head's captured graphs (spec/mtp_graphs.py) replay it; a prefill chunk
    stays one query (decode rows would read its prefix once per row)."""
    return kept <= k + 1


def _positions_in(active: list[int], chains: list[tuple[Sequence, int]], step: int) -> list[int]:
    """Rows of the previous head forward's output (the chains still running at step - 1) that
    hold the chains still running now."""
    previous = [i for i, (_, k) in enumerate(chains) if k > step - 1]
    where = {i: row for row, i in enumerate(previous)}
    return [where[i] for i in active]
