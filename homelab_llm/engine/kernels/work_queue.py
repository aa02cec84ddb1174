"""A grid's programs as an ordered work queue: several dependent kernels in one launch.

A decode step's small kernels each pay a grid boundary: the next grid starts only once the last
program of this one has finished and its writes are flushed, and then its programs wait a memory
round trip for their first bytes (BENCHMARKS 60.5: ~4.5 us a GEMV beyond its bytes on the
30B-A3B at batch 1). In one launch the same work can run as items of a queue instead: each
program takes the next item number from a counter (take_item), so items are handed out in order
to programs that are already running; an item whose inputs come from earlier items waits on their
count (wait_count) after it has requested what it can read already (its weights), and an item
that finishes counts itself done (count_done).

Why it cannot deadlock, whatever the GPU's residency: an item waits only on items of lower
numbers, which were taken by programs that were running when they took them and keep running
until they finish (the lowest unfinished item waits on nothing unfinished). The TRITON_INTERPRET
interpreter runs programs one after another, so there every wait is already met.

Memory order: an item's threads write, meet at a barrier, then one release add publishes the
writes; a waiting item polls with volatile loads, then takes one acquire read (the L1 is not
coherent: the acquire orders the loads after it) and a barrier before its threads read.

The counters live in a zeroed int32 buffer per device (counters): each launch leaves them at zero
(leave_queue: the last program to leave resets its launch's counters), so CUDA/HIP graphs replay it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.w4a16_gemv import ticket_buffer

MAX_COUNTERS = 1024


def counters(device: torch.device, n: int) -> torch.Tensor:
    """n zeroed int32 counters for one launch, apart from the GEMVs' tickets (each launch leaves
    them at zero; calls on one stream never overlap)."""
    if n > MAX_COUNTERS:
        raise ValueError(f"work queue: {n} counters exceed {MAX_COUNTERS}")
    return ticket_buffer(device, n, pool="queue")


@triton.jit
def take_item(queue_ptr):
    """This program's item number: counter 0's value before its increment (hand-out order)."""
    return tl.atomic_add(queue_ptr, 1, sem="relaxed")


@triton.jit
def count_done(count_ptr):
    """Publish this item's writes: every thread has written (barrier), then one release add."""
    tl.debug_barrier()
    tl.atomic_add(count_ptr, 1, sem="release")


@triton.jit
def wait_count(count_ptr, target):
    """Wait until the counter at count_ptr reaches target; the program's loads after this see
    the writes the counted items published."""
    seen = tl.load(count_ptr, volatile=True)
    while seen < target:
        seen = tl.load(count_ptr, volatile=True)
    tl.atomic_add(count_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def leave_queue(queue_ptr, n_items, N_COUNTERS: tl.constexpr, COUNTERS_P2: tl.constexpr):
    """The program's last act: counter N_COUNTERS - 1 counts programs out; the last one resets
    counters 0 .. N_COUNTERS - 1 (nothing reads them after its leave). COUNTERS_P2: a power of
    two >= N_COUNTERS."""
    tl.debug_barrier()
    if tl.atomic_add(queue_ptr + N_COUNTERS - 1, 1, sem="acq_rel") == n_items - 1:
        offs = tl.arange(0, COUNTERS_P2)
        tl.store(queue_ptr + offs, tl.zeros_like(offs), mask=offs < N_COUNTERS)
