"""One-shot all-reduce for small messages over peer-mapped buffers (tensor parallelism on one box).

Every rank owns one registered buffer that all its peers have mapped (CUDA/HIP IPC): two data
halves (double buffering, picked by the call's parity) and a signal area. One call is one kernel:

  1. each program copies its slice of the input into this rank's buffer (current half);
  2. it tells every peer "slice ready" by writing the call's epoch into the peer's signal area
     (system-scope release), then waits until every peer has written that epoch into ours
     (system-scope acquire): a barrier per program, no grid-wide sync;
  3. it reads its slice from every rank's buffer and sums in fp32 in rank order 0..N-1, so every
     rank gets bit-identical results, and writes the output (in place is fine).

Why no second barrier: the next call writes the other half. A rank can only start call k+2 (which
overwrites call k's half) after its call k+1 passed a barrier that every peer reached by finishing
call k; kernels on one stream run in order. That argument needs all programs to take part in every
call, so the grid is fixed for a buffer's lifetime (programs without data still signal and wait).

The epoch lives in device memory (one counter per program, advanced by the kernel itself), so the
kernel can be captured in a CUDA/HIP graph and replayed: nothing on the host changes per call.
Epochs only grow (int64) and the wait is `>=`, so a peer that is already one call ahead is fine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Signal area layout, per rank, in int64 words: flags[program][source rank], then counter[program].


def signal_words(num_programs: int, world_size: int) -> int:
    return num_programs * world_size + num_programs


@triton.jit
def _peer_ptr(table, r, dtype):
    """Rank r's base address from an int64 table, as a pointer the compiler may vectorize through
    (buffers come from cudaMalloc/hipMalloc: 256-byte aligned)."""
    return tl.multiple_of(tl.load(table + r).to(tl.pointer_type(dtype)), 16)


@triton.jit
def _copy_tile(src, dst, idx, limit, MASKED: tl.constexpr):
    if MASKED:
        mask = idx < limit
        tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)
    else:
        tl.store(dst + idx, tl.load(src + idx))


@triton.jit
def _sum_tile(data_ptrs, half, out_ptr, idx, limit, RANK_COUNT: tl.constexpr, BLOCK: tl.constexpr,
              MASKED: tl.constexpr):
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(RANK_COUNT):  # fixed order: every rank rounds the same sum
        src = _peer_ptr(data_ptrs, r, dtype) + half
        if MASKED:
            acc += tl.load(src + idx, mask=idx < limit, other=0.0).to(tl.float32)
        else:
            acc += tl.load(src + idx).to(tl.float32)
    if MASKED:
        tl.store(out_ptr + idx, acc.to(dtype), mask=idx < limit)
    else:
        tl.store(out_ptr + idx, acc.to(dtype))


@triton.jit
def _one_shot_kernel(
    in_ptr, out_ptr, data_ptrs, signal_ptrs, n, chunk, half_elems,
    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    npid = tl.num_programs(0)
    dtype = out_ptr.dtype.element_ty
    own_signal = tl.load(signal_ptrs + RANK).to(tl.pointer_type(tl.int64))
    counter = own_signal + npid * WORLD + pid
    epoch = tl.load(counter) + 1
    half = (epoch % 2) * half_elems
    start = pid.to(tl.int64) * chunk  # chunk is a multiple of BLOCK
    count = tl.maximum(tl.minimum(n - start, chunk), 0)  # elements this program owns
    full = count // BLOCK  # unmasked tiles (vectorized), then at most one masked tail
    offs = tl.arange(0, BLOCK)
    end = start + count

    own = _peer_ptr(data_ptrs, RANK, dtype) + half
    for i in range(0, full):
        _copy_tile(in_ptr, own, start + i * BLOCK + offs, end, MASKED=False)
    if full * BLOCK < count:
        _copy_tile(in_ptr, own, start + full * BLOCK + offs, end, MASKED=True)
    tl.debug_barrier()  # every thread's copy is ordered before the release below

    for r in tl.static_range(WORLD):
        if r != RANK:
            peer_signal = tl.load(signal_ptrs + r).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(peer_signal + pid * WORLD + RANK, epoch, sem="release", scope="sys")
    for r in tl.static_range(WORLD):
        if r != RANK:
            seen = tl.atomic_add(own_signal + pid * WORLD + r, 0, sem="acquire", scope="sys")
            while seen < epoch:
                seen = tl.atomic_add(own_signal + pid * WORLD + r, 0, sem="acquire", scope="sys")
    tl.debug_barrier()  # no thread reads a peer's slice before the acquire above

    for i in range(0, full):
        _sum_tile(data_ptrs, half, out_ptr, start + i * BLOCK + offs, end, WORLD, BLOCK, MASKED=False)
    if full * BLOCK < count:
        _sum_tile(data_ptrs, half, out_ptr, start + full * BLOCK + offs, end, WORLD, BLOCK, MASKED=True)
    tl.store(counter, epoch)


def one_shot_all_reduce(x: torch.Tensor, out: torch.Tensor, data_ptrs: torch.Tensor,
                        signal_ptrs: torch.Tensor, half_elems: int, rank: int, world_size: int,
                        num_programs: int, block: int = 2048, num_warps: int = 8) -> torch.Tensor:
    """Sum `x` over ranks into `out` (may be `x`). `data_ptrs`/`signal_ptrs` are int64 device
    tensors with every rank's data and signal base address; `half_elems` is one data half's size
    in elements of x's dtype. Every rank must call this with the same size and num_programs."""
    n = x.numel()
    if n > half_elems:
        raise ValueError(f"message of {n} elements exceeds the buffer half of {half_elems}")
    if not (x.is_contiguous() and out.is_contiguous()):
        raise ValueError("one-shot all-reduce needs contiguous tensors")
    chunk = triton.cdiv(triton.cdiv(n, num_programs), block) * block
    _one_shot_kernel[(num_programs,)](
        x, out, data_ptrs, signal_ptrs, n, chunk, half_elems,
        RANK=rank, WORLD=world_size, BLOCK=block, num_warps=num_warps)
    return out


def all_reduce_ref(parts: list[torch.Tensor]) -> torch.Tensor:
    """Torch reference: fp32 sum in rank order, rounded once to the input dtype."""
    acc = torch.zeros_like(parts[0], dtype=torch.float32)
    for p in parts:
        acc += p.float()
    return acc.to(parts[0].dtype)
