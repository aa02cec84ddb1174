"""Per-program timestamps of a decode kernel inside a replayed CUDA graph (NVIDIA, benchmarks only).

Why: a batch-1 decode step is a chain of ~200 kernels of 5-25 us, replayed from a graph, where
Nsight Compute serializes the launches and the profiler gives one duration a kernel. What a
kernel change has to move is often inside that duration or between two of them: the launch and
flush between grids, how the programs spread over the SMs, the prologue, the K loop, the split-K
reduction. docs/BENCHMARKS.md 32.1 found this way why a GEMV launched early under PDL loses.

A traced kernel takes `TRACE: tl.constexpr` and a `trace_ptr` ([programs, SLOTS] int64): each
program reads `clock_ns` when it starts and stores, after its PDL wait (stores before it are
what tests/engine/kernels/test_pdl.py forbids), its SM and that time, then one stamp at each
point the kernel marks (`stamp`). With TRACE off the kernel compiles as without it.

Host side: `enable(device)` allocates one zeroed pool before any capture (a slice launches
nothing; a `torch.zeros` a call inside the capture would add a fill kernel between every two
grids, which is the first thing the trace would then measure), `buffer(rows, label)` hands a call
its slice and records it (label() only then), `calls()` the recorded (label, slice) pairs in launch order. Only PTX
builds stamp (`%globaltimer`: ns, 32 ns steps on the H200; `%smid`); elsewhere `buffer` gives
None, so callers launch untraced.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

SLOTS = 8  # [SM, start, after the wait, up to 5 marks]; unused marks stay 0
START, WAITED = 1, 2  # slot of the start time and of the time past the PDL wait
_SLOTS_C, _START_C, _WAITED_C = tl.constexpr(SLOTS), tl.constexpr(START), tl.constexpr(WAITED)
POOL_ROWS = 1 << 21  # programs the pool holds: ~2,000 GEMV calls of ~1,000 programs


@dataclass
class TracedCall:
    label: str  # e.g. "h2 n=6144 k=4096 norm"
    stamps: torch.Tensor  # [programs, SLOTS] int64 on the device


_pool: dict = {"buf": None, "next": 0, "calls": []}


def enable(device: torch.device, rows: int = POOL_ROWS) -> None:
    """Allocate the zeroed pool on `device` (before any graph capture) and start recording."""
    _pool.update(buf=torch.zeros((rows, SLOTS), dtype=torch.int64, device=device), next=0, calls=[])


def disable() -> None:
    _pool.update(buf=None, next=0, calls=[])


def buffer(rows: int, label: Callable[[], str], ptx: bool) -> torch.Tensor | None:
    """A [rows, SLOTS] slice of the pool for one traced launch, or None when tracing is off or the
    launch is not a PTX build; label() names the launch (called only when traced, so an untraced
    launch pays for no formatting). Raises once the pool is used up (the trace would alias)."""
    buf = _pool["buf"]
    if buf is None or not ptx:
        return None
    start = _pool["next"]
    if start + rows > buf.shape[0]:
        raise RuntimeError(f"program_trace: pool of {buf.shape[0]} programs used up; enable() with more")
    _pool["next"] = start + rows
    view = buf[start:start + rows]
    _pool["calls"].append(TracedCall(label(), view))
    return view


def calls() -> list[TracedCall]:
    """Every traced launch since enable(), in launch order (a graph's replays rewrite theirs)."""
    return list(_pool["calls"])


@triton.jit
def clock_ns(anchor):
    """The global timer (ns) as an int64 scalar; `anchor` is any int32 scalar (the asm needs an
    operand) and orders the read after its computation."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [anchor], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def trace_clock(anchor, TRACE: tl.constexpr):
    """clock_ns() when tracing (a program's first statement: its start), else 0."""
    t = tl.full([], 0, tl.int64)
    if TRACE:
        t = clock_ns(anchor)
    return t


@triton.jit
def trace_begin(trace_ptr, start, TRACE: tl.constexpr):
    """After the PDL wait: the program's row of the trace gets its SM, `start` (clock_ns at the
    program's first instruction) and now. Returns the row's pointer."""
    pid = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    row = trace_ptr + pid.to(tl.int64) * _SLOTS_C
    if TRACE:
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [pid], dtype=tl.int32,
                                       is_pure=False, pack=1)
        tl.store(row, sm.to(tl.int64))
        tl.store(row + _START_C, start)
        tl.store(row + _WAITED_C, clock_ns(pid))
    return row


@triton.jit
def stamp(row, slot: tl.constexpr, TRACE: tl.constexpr):
    """Store the time now into `slot` (3..7) of the program's row."""
    if TRACE:
        tl.store(row + slot, clock_ns(tl.program_id(0)))
