"""Run small CPU ops on the calling thread only.

torch splits any op above its grain size (or with a few independent work items, like SDPA's
heads) over the intra-op thread pool. For the small ops of a decode step the pool's fork/join
costs more than the work: ~27 us instead of a few on an idle 2-core box, and milliseconds once
the box is busy, because each region waits until the pool's other thread gets a core again
(measured: SmolLM2 decode at 2 threads went from ~10 to 60-200 ms per step of small-op time under
a load of 3). `single_thread()` narrows the pool to one thread for a block and restores it; the
big matmuls outside keep the whole pool. The setting is process-global: blocks stay short.
"""

from __future__ import annotations

import torch


class single_thread:  # noqa: N801 - used as a context manager, like torch.no_grad
    """with single_thread(): ... runs torch ops in the block on one intra-op thread."""

    __slots__ = ("threads",)

    def __enter__(self) -> None:
        self.threads = torch.get_num_threads()
        if self.threads > 1:
            torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        if self.threads > 1:
            torch.set_num_threads(self.threads)
