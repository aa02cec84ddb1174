"""Grammar masks computed off the step loop: a worker thread fills the next step's masks while the
engine thread schedules, prepares and runs the forward.

    prefetcher.start(running)   # engine step, once drafts are set and before the forward
    ...                         # the sampler's GrammarState.fill / GrammarView.fill copy the rows

Per constrained sequence the worker computes len(drafts) + 1 rows (the mask after each prefix of
the step's grammar-checked drafts) into a tensor of its own; llguidance drops the GIL while it
fills a mask, so this runs in parallel with the forward (the CPU's torch threads, or the host side
of a GPU step). Correctness never depends on timing: every GrammarState method that touches the
matcher first waits for the worker (`settle`), and a row is used only if the state's version and
drafts still match; otherwise the sampler computes the mask itself, as without prefetching.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from homelab_llm.engine.pending import PLACEHOLDER
from homelab_llm.engine.sequence import Sequence
from homelab_llm.engine.structured.matcher import GrammarState, PrefetchedMasks


def _compute(jobs: list[tuple[GrammarState, tuple[int, ...], torch.Tensor]]) -> None:
    for state, drafts, rows in jobs:
        state.compute_rows(rows, drafts)


class MaskPrefetcher:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled  # off: the sampler computes every mask in place (benchmarks compare)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")

    def start(self, running: list[Sequence]) -> None:
        """Compute the masks of every constrained sequence's next sampled position(s)."""
        if not self.enabled:
            return
        jobs = []
        for seq in running:
            state = seq.grammar
            if state is None or not state.active or seq.is_finished:
                continue
            if seq.token_ids and seq.token_ids[-1] == PLACEHOLDER:
                continue  # its last token is still on the device (async scheduling): the sampler
                # fills this mask once the token is read, while the forward runs

            drafts = tuple(seq.spec_token_ids)
            ahead = state.prefetched
            if ahead is not None and ahead.version == state.version and ahead.drafts == drafts:
                continue  # still valid (the sequence did not run last step)
            state.settle()
            jobs.append((state, drafts, torch.empty((len(drafts) + 1, state.words), dtype=torch.int32)))
        if not jobs:
            return
        done: Future = self._pool.submit(_compute, jobs)
        for state, drafts, rows in jobs:
            state.prefetched = PrefetchedMasks(state.version, drafts, rows, done)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
