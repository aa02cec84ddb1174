"""K splits that spread the few-row W4A16 tensor-core kernel evenly over the SMs.

The few-row kernel (w4a16_dot.py) used to split K in powers of two toward "tiles.split_k
programs per SM": on an H200 a 27B gate_up at 4 rows ran 272 programs, half a wave of the 528
the SM limits allow (Nsight Compute: 0.52 waves, 21% of the DRAM bandwidth). The split count is
any integer, chosen by a cost model over the residency of the compiled kernel (registers, shared
memory, warps per SM). The kernel is bound by its SM's issue rate (Nsight Compute, H100, 27B
gate_up at 8 rows: 0.68 instructions a cycle a scheduler issued, 1.9 warps eligible), so an SM
given c programs takes about c x (steps a program + overhead), and one given fewer than about
two thirds of what it holds is no faster (too few warps to keep issuing):

    cost(s) = max(ceil(blocks x s' / SMs), busy) x (steps per program(s) + overhead)

where s' is the split count once every split covers whole K steps. The fewest splits within 5%
of the least cost win (less reduction traffic). A partial last wave costs its share: the model
before this one charged it a whole wave (ceil(programs / resident) waves), which pushed splits
to fill whole waves and lost 1-9% a step (BENCHMARKS 44.2: H100, one step's linears at 3-16
rows, 8B 3.01-3.05 -> 2.72-2.82 ms, 27B 8.23-8.40 -> 7.90-8.10; engine batch 8, graph time, 8B
3.67 -> 3.45 ms, 27B 11.20 -> 10.93). Residency comes from the compiled kernel (`JITFunction.
warmup`, then its binary loaded for the register count: host only, no launch) and is cached per
kernel specialization; the interpreter and backends that do not report it get None, and
callers keep their power-of-two rule.

Not for the GEMVs: the packed-half GEMV ran slower with whole waves of long programs (1 row
6.52 -> 9.15 ms) than with its power-of-two split into more, shorter ones (a GEMV's program
keeps few loads in flight, so more programs over time beat a clean last wave).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import triton
from triton.runtime.errors import OutOfResources

from homelab_llm.engine.kernels.tuning import interpreting

_RESIDENT: dict[tuple, int | None] = {}


def programs_per_sm(n_regs: int, shared: int, num_warps: int, props) -> int:
    """Programs of one kernel an SM holds at once, from its registers per thread, shared memory
    per program and warps, and the SM's limits (torch device properties)."""
    threads = 32 * num_warps
    limits = [props.max_threads_per_multi_processor // threads, 32]
    if n_regs:
        # registers are allocated per warp in units of 256
        per_warp = math.ceil(n_regs * 32 / 256) * 256
        limits.append(props.regs_per_multiprocessor // (per_warp * num_warps))
    if shared:
        limits.append(props.shared_memory_per_multiprocessor // (shared + 1024))  # + driver reserve
    return max(1, min(limits))


def kernel_registers(compiled) -> int:
    """Registers a thread of a compiled Triton kernel, 0 where the backend does not say. Triton
    learns them when it loads the binary (the first launch, or reading `run`), so a kernel fresh
    from warmup() has no n_regs yet: reading `run` loads it here (host only, no launch). Without
    this the residency counted shared memory alone (BENCHMARKS 44.2: 10 programs an SM assumed
    for the few-row kernel where its 80 registers fit 6, so splits left a partial second wave)."""
    if getattr(compiled, "n_regs", None) is None:
        try:
            compiled.run  # noqa: B018 - the property loads the binary and sets n_regs
        except (AttributeError, RuntimeError, OutOfResources):  # the launch itself reports
            return 0
    return getattr(compiled, "n_regs", 0) or 0


def resident_per_sm(kernel, key: tuple, device: torch.device, args: tuple, meta: dict) -> int | None:
    """Programs of `kernel` (a triton.jit function) one SM holds at once, for the launch
    `kernel[grid](*args, **meta)`; key: what specializes it (constexprs, dtypes). None where the
    backend does not say (interpreter, HIP)."""
    if device.type != "cuda" or interpreting() or torch.version.hip:
        return None
    full = (kernel.fn.__name__, device.index) + key
    if full not in _RESIDENT:
        try:
            compiled = kernel.warmup(*args, grid=(1,), **meta)
            props = torch.cuda.get_device_properties(device)
            _RESIDENT[full] = programs_per_sm(kernel_registers(compiled), compiled.metadata.shared,
                                              meta.get("num_warps", 4), props)
        except (AttributeError, TypeError):
            _RESIDENT[full] = None
    return _RESIDENT[full]


def balance_split(n_blocks: int, k_steps: int, sms: int, per_sm: int, min_steps: int = 1,
                  overhead: float = 2.0, slack: float = 0.05) -> int:
    """The fewest K splits whose busiest SM costs within `slack` of the least, for a kernel whose
    SM throughput is its issue rate: an SM given c programs takes c x (steps a program +
    overhead), and one given fewer than (2 per_sm + 2) // 3 is no faster than with that many
    (too few warps to keep its schedulers issuing). per_sm: programs an SM holds
    (programs_per_sm)."""
    busy = max(1, (2 * per_sm + 2) // 3)
    costs = {}
    for s in range(1, max(1, k_steps // max(1, min_steps)) + 1):
        per = triton.cdiv(k_steps, s)
        actual = triton.cdiv(k_steps, per)  # a larger s can land on the same split
        costs[actual] = max(triton.cdiv(n_blocks * actual, sms), busy) * (per + overhead)
    best = min(costs.values())
    return min(s for s, c in costs.items() if c <= best * (1 + slack))


_STAGES: dict[tuple, int] = {}


def launch_fitting_stages(launch: Callable[[int], None], key: tuple, stages: int) -> None:
    """launch(num_stages) with the most pipeline stages, up to `stages`, that the device's shared
    memory holds. Tile tables are tuned for 16-bit data; 32-bit KV (or a bigger head) can ask more
    shared memory than an SM has, and Triton raises OutOfResources before anything is enqueued,
    so one stage fewer is tried; the count that fits is remembered per key (what specializes
    the kernel)."""
    s = _STAGES.get(key, stages)
    while True:
        try:
            launch(s)
            break
        except OutOfResources:
            if s <= 1:
                raise
            s -= 1
    _STAGES[key] = s
