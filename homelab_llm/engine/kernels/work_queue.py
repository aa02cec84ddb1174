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

The counters live in a zeroed int32 buffer per device (counters), one 128-byte line each: each
launch leaves them at zero (leave_queue: the last program to leave resets its launch's
counters), so CUDA/HIP graphs replay it. (A persistent grid, fewer programs than items each
taking items until none is left, compiled to 167 registers a thread on sm_90 for the MoE queue
against 71 for one item a program: dropped untimed.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.tuning import tiles_for
from homelab_llm.engine.kernels.w4a16_gemv import ticket_buffer

MAX_COUNTERS = 1024
# ints between two counters: each its own 128-byte line, so polling one does not queue the atomics
# on the others behind it in the L2
SPACING = tl.constexpr(32)


def counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters for one launch of n, apart from the GEMVs' tickets (each launch leaves
    them at zero; calls on one stream never overlap); counter i at i * SPACING (counter)."""
    if n > MAX_COUNTERS:
        raise ValueError(f"work queue: {n} counters exceed {MAX_COUNTERS}")
    return ticket_buffer(device, n * SPACING.value, pool="queue")


def pause_code(device: torch.device, ns: int) -> int:
    """wait_count's SLEEP for a pause of about ns nanoseconds on a device: ns on NVIDIA, -1 (256
    clocks) on RDNA, 0 in the interpreter or for ns 0."""
    name = tiles_for(device).name
    if ns <= 0:
        return 0
    return ns if name.startswith("sm") else (-1 if name.startswith("gfx") else 0)


@triton.jit
def counter(queue_ptr, i):
    """Counter i's address."""
    return queue_ptr + i * SPACING


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
def _pause(seen, SLEEP: tl.constexpr):
    """Back off between polls: SLEEP > 0 sleeps about SLEEP ns (NVIDIA nanosleep: up to twice
    that); SLEEP < 0 256 clocks (AMD s_sleep 4); 0 not at all (the interpreter). Returns seen
    (the asm needs an operand)."""
    if SLEEP > 0:
        seen = tl.inline_asm_elementwise("nanosleep.u32 $2;\n mov.b32 $0, $1;", "=r,r,r",
                                         [seen, seen * 0 + SLEEP], dtype=tl.int32, is_pure=False,
                                         pack=1)
    elif SLEEP < 0:
        seen = tl.inline_asm_elementwise("s_sleep 4\n v_mov_b32 $0, $1", "=v,v", [seen],
                                         dtype=tl.int32, is_pure=False, pack=1)
    return seen


@triton.jit
def wait_count(count_ptr, target, SLEEP: tl.constexpr = 0):
    """Wait until the counter at count_ptr reaches target (polling, with _pause(SLEEP) between
    polls: hundreds of programs polling one line otherwise queue every atomic on it); the
    program's loads after this see the writes the counted items published."""
    seen = tl.load(count_ptr, volatile=True)
    while seen < target:
        seen = _pause(seen, SLEEP)
        seen = tl.load(count_ptr, volatile=True)
    tl.atomic_add(count_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def leave_queue(queue_ptr, n_programs, N_COUNTERS: tl.constexpr, COUNTERS_P2: tl.constexpr):
    """The program's last act: counter N_COUNTERS - 1 counts programs out; the last one resets
    counters 0 .. N_COUNTERS - 1 (nothing reads them after its leave). COUNTERS_P2: a power of
    two >= N_COUNTERS."""
    tl.debug_barrier()
    if tl.atomic_add(counter(queue_ptr, N_COUNTERS - 1), 1, sem="acq_rel") == n_programs - 1:
        offs = tl.arange(0, COUNTERS_P2)
        tl.store(queue_ptr + offs * SPACING, tl.zeros_like(offs), mask=offs < N_COUNTERS)
