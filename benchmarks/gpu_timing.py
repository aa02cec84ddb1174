"""Kernel timing for the decode-kernel sweeps (w4a16_sweep.py, int8kv_decode.py): CUDA graphs
that cycle through enough copies of the data to overflow the L2, so a replay reads from HBM the
way a decode step does, and the device-to-device copy rate of the same bytes as the ceiling.

Convention: the copy rate is bytes read + written per second; a kernel's rate is the bytes it
reads per second; a read-only kernel at the copy's bandwidth scores 100%.
"""

from __future__ import annotations

from typing import Callable

import torch

L2_FLUSH_BYTES = 256 << 20  # data cycled per graph: well past the H200's 50 MB L2


def copies_for(nbytes: int, cap: int = 64) -> int:
    """Copies of an nbytes working set that, cycled through, overflow the L2."""
    return max(2, min(cap, -(-L2_FLUSH_BYTES // max(1, nbytes))))


def graph_ms(step: Callable[[int], object], copies: int, iters: int = 3) -> float:
    """Milliseconds per call: one CUDA graph runs `step(i)` for every copy i; replays timed
    (median of `iters`)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):  # warm up (compiles) outside the capture
            step(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            step(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / copies)
    return sorted(times)[len(times) // 2]


def copy_rate_gbs(dev: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy of nbytes (cycled past the L2 when small): bytes read + written per
    second, in GB/s. Small copies include the same launch/ramp costs a kernel of that size pays."""
    n = max(1 << 16, nbytes // 16 * 16)
    copies = copies_for(2 * n)
    src = [torch.empty(n, dtype=torch.uint8, device=dev) for _ in range(copies)]
    dst = [torch.empty_like(s) for s in src]
    ms = graph_ms(lambda i: dst[i].copy_(src[i]), copies)
    return 2 * n / ms / 1e6


def precompile(task: Callable[..., None], args: list[tuple], jobs: int) -> float:
    """Run `task(*a)` for every a in worker processes first, so Triton's compiles (most of a
    sweep's time: each tile variant and specialisation is its own kernel) happen in parallel and
    the timing pass finds them in the on-disk cache. `task` must be a module-level function that
    calls each variant once. Returns the seconds it took; jobs <= 1 skips it."""
    import concurrent.futures as cf
    import multiprocessing as mp
    import time

    if jobs <= 1 or not args:
        return 0.0
    start = time.perf_counter()
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
        for fut in [pool.submit(task, *a) for a in args]:
            exc = fut.exception()
            if exc is not None:  # the timing pass reports the failing variant itself
                print(f"  precompile {task.__name__}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    return time.perf_counter() - start


def default_jobs() -> int:
    import os

    return max(1, min(8, (os.cpu_count() or 2) - 1))
