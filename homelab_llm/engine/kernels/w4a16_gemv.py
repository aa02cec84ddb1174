"""W4A16 for decode (M <= 8 rows): a GEMV that reads each packed word once.

The GEMM kernel (w4a16.py) expands every word to eight K rows before `tl.dot`, which pads M to 16
and loads each word eight times. At batch 1 the step is bound by reading 0.5 byte per weight, so
this kernel instead keeps a [ROWS, BLOCK_N] tile of packed words in registers and walks the eight
nibbles of each word with a static loop:

  nibble -> float without shifts or a conversion instruction: (word & 0xF << 4j) | 0x4B000000
  read as fp32 is 2^23 + q * 2^4j (exact for j <= 4; nibbles 5..7 after one shift by 20), so a
  nibble costs one AND-OR, one subtraction and one FMA, with x pre-scaled by 2^-4j (exact);
  inner[m, r, n] += q * x[m, 8r + j]
  acc += inner * scale[g, n] + sum_j x[m, 8r + j] * bias[g, n]

since W[k, n] = q * scale + bias within a group (BLOCK_K = 8 * ROWS never spans two groups).
Skinny outputs split K across programs; the last program of each column block to finish (an
atomic ticket per block) sums the fp32 partials in split order, so the result does not depend on
scheduling and no second kernel runs. The tickets reset themselves, so the kernel replays inside
CUDA/HIP graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.tuning import device_sms, tiles_for
from homelab_llm.engine.kernels.w4a16_pack import W4Weight


MAX_BLOCKS = 1 << 16  # ticket counters per device: N up to 2M columns at the smallest block_n
_tickets: dict[tuple[torch.device, str], torch.Tensor] = {}


def ticket_buffer(device: torch.device, n_blocks: int, pool: str = "gemv") -> torch.Tensor:
    """Zeroed int32 counters, one per column block, shared by every GEMV on the device (calls on
    one stream never overlap, and each call leaves them at zero). Allocated once and never
    replaced: captured graphs keep its address. pool: another set for counters that must not
    share with the GEMVs' (work_queue.py's, whose launches run GEMV programs)."""
    if n_blocks > MAX_BLOCKS:
        raise ValueError(f"W4A16 GEMV: {n_blocks} column blocks exceed {MAX_BLOCKS}")
    buf = _tickets.get((device, pool))
    if buf is None:
        buf = _tickets[(device, pool)] = torch.zeros(MAX_BLOCKS, dtype=torch.int32, device=device)
    return buf


@triton.jit
def nibble_f32(word, j: tl.constexpr):
    """Nibble j of `word` (already shifted right by 20 for j >= 5) times 2^(4 * (j % 5)), as fp32,
    with one AND-OR: the nibble lands in the low mantissa bits of 2^23, which is then subtracted."""
    bits = (word & (0xF << (4 * j if j < 5 else 4 * (j - 5)))) | 0x4B000000
    return bits.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def unscale_pow2(x, j: tl.constexpr):
    """x * 2^-(4 * (j % 5)): undoes nibble_f32's power of two, exactly."""
    return x * (1.0 / (1 << (4 * j if j < 5 else 4 * (j - 5))))


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr, qw_ptr, scales_ptr, biases_ptr, out_ptr, ws_ptr, ticket_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_qw, stride_sg, stride_om,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
    SPLIT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    BLOCK_K: tl.constexpr = ROWS * 8
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, ROWS)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if BLOCK_M == 1:
        acc1 = tl.zeros([ROWS, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, ROWS, BLOCK_N], tl.float32)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    tile = qw_ptr + rows[:, None].to(tl.int64) * stride_qw + offs_n[None, :]
    for k0 in range(k_start, k_end, BLOCK_K):
        word_rows = k0 // 8 + rows
        packed = tl.load(tile + (k0 // 8) * stride_qw, mask=n_mask[None, :], other=0)
        high = packed >> 20  # nibbles 5..7 moved to where the AND-OR trick can reach them
        group = k0 // GROUP_SIZE
        s = tl.load(scales_ptr + group * stride_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        b = tl.load(biases_ptr + group * stride_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if BLOCK_M == 1:
            inner1 = tl.zeros([ROWS, BLOCK_N], tl.float32)
            x_sum1 = tl.zeros([ROWS], tl.float32)
        else:
            inner = tl.zeros([BLOCK_M, ROWS, BLOCK_N], tl.float32)
            x_sum = tl.zeros([BLOCK_M, ROWS], tl.float32)
        for j in tl.static_range(8):
            if j < 5:
                w = nibble_f32(packed, j)
            else:
                w = nibble_f32(high, j)
            if BLOCK_M == 1:
                xj1 = tl.load(x_ptr + word_rows * 8 + j).to(tl.float32)
                inner1 += w * unscale_pow2(xj1, j)[:, None]
                x_sum1 += xj1
            else:
                xj = tl.load(x_rows + (word_rows * 8 + j)[None, :], mask=m_mask[:, None], other=0.0)
                xj = xj.to(tl.float32)
                inner += w[None, :, :] * unscale_pow2(xj, j)[:, :, None]
                x_sum += xj
        if BLOCK_M == 1:
            acc1 += inner1 * s[None, :] + x_sum1[:, None] * b[None, :]
        else:
            acc += inner * s[None, None, :] + x_sum[:, :, None] * b[None, None, :]
    if BLOCK_M == 1:
        part = tl.sum(acc1, axis=0)[None, :]
    else:
        part = tl.sum(acc, axis=1)  # [BLOCK_M, BLOCK_N]
    store_or_reduce(part, out_ptr, ws_ptr, ticket_ptr + pid_n, pid_k, offs_m, offs_n, M, N, stride_om,
                    SPLIT=SPLIT)


@triton.jit
def store_or_reduce(part, out_ptr, ws_ptr, ticket_ptr, pid_k, offs_m, offs_n, M, N, stride_om,
                    SPLIT, CHUNK_VALUES: tl.constexpr = 8192, CHUNK_SLOTS: tl.constexpr = 8):
    """Epilogue shared by the W4A16 kernels: part [BLOCK_M, BLOCK_N] fp32 goes straight to `out`
    (SPLIT 1), or to split pid_k's slot of the fp32 workspace [SPLIT, M, N]; the last program of
    this output tile to take its ticket sums the slots and resets the ticket, so the launch
    replays inside CUDA/HIP graphs. SPLIT may be a constexpr or a runtime value (one compiled
    kernel for every split count).

    The sum loads the slots CHUNK at a time (all in flight together, summed in a fixed tree, the
    chunks in split order: deterministic): one slot a loop trip waited out an L2 round trip per
    split, ~1 us of an 8B 1-row GEMV split 32-64 ways (docs/BENCHMARKS.md 13.3). CHUNK keeps a
    chunk within CHUNK_VALUES values of registers and CHUNK_SLOTS slots (8K and 8 by default;
    the packed-half GEMV passes 16K and 16, BENCHMARKS 33.3). Tiles of more than 2 rows (the few-row kernels) sum
    one slot a trip: chunked, the Qwen3.6-27B W4A16 step at 8 rows took 28.3 ms instead of 15.1
    and a 3-row verify 25.4 instead of 13.3 (bisected to this epilogue, docs/BENCHMARKS.md 16.2;
    the sm_90 compiles' registers barely differ, so the cost is not residency)."""
    out_offs = offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + out_offs, part.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        ticket = split_slot(part, ws_ptr, ticket_ptr, pid_k, offs_m, offs_n, M, N)
        if ticket == SPLIT - 1:
            total = split_total(part, ws_ptr, offs_m, offs_n, M, N, SPLIT, CHUNK_VALUES, CHUNK_SLOTS)
            tl.store(out_ptr + out_offs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(ticket_ptr, 0)


@triton.jit
def split_slot(part, ws_ptr, ticket_ptr, pid_k, offs_m, offs_n, M, N):
    """store_or_reduce's first half: part [BLOCK_M, BLOCK_N] fp32 to split pid_k's slot of the
    workspace [SPLIT, M, N], then the tile's ticket taken; the program that draws SPLIT - 1 is
    the tile's last and sums the slots (split_total), then resets the ticket to 0."""
    ws_offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(ws_ptr + pid_k * M * N + ws_offs, part, mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])
    tl.debug_barrier()  # every thread's partial is written before the ticket is taken
    return tl.atomic_add(ticket_ptr, 1, sem="acq_rel")


@triton.jit
def split_total(part, ws_ptr, offs_m, offs_n, M, N, SPLIT, CHUNK_VALUES: tl.constexpr = 8192,
                CHUNK_SLOTS: tl.constexpr = 8):
    """The sum of a tile's SPLIT slots (part: any of them, for the shape), chunked as
    store_or_reduce says, in split order: the same total whichever program sums them."""
    ws_offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    ELEMS: tl.constexpr = part.shape[0] * part.shape[1]
    CHUNK: tl.constexpr = 1 if part.shape[0] > 2 else max(1, min(CHUNK_SLOTS, CHUNK_VALUES // ELEMS))
    slots = tl.arange(0, CHUNK)[:, None, None]
    total = tl.zeros(part.shape, tl.float32)
    for s0 in range(0, SPLIT, CHUNK):
        s_idx = s0 + slots
        tile = tl.load(ws_ptr + s_idx * M * N + ws_offs[None, :, :],
                       mask=(s_idx < SPLIT) & out_mask[None, :, :], other=0.0, cache_modifier=".cg")
        total += tl.sum(tile, axis=0)
    return total


def pick_split(n_blocks: int, k: int, block_k: int, device: torch.device, waves: int = 32) -> int:
    """Split K (for n_blocks output tiles) until there are about `waves` programs per SM (a decode
    GEMV is bound by bytes in flight: many small programs beat few long ones; measured on an H200,
    benchmarks/w4a16_sweep), never below 4 K-steps per split."""
    sms = device_sms(device)
    split = 1
    while n_blocks * split * 2 <= waves * sms and k // (split * 2) >= 4 * block_k:
        split *= 2
    return split


def w4a16_gemv(x2: torch.Tensor, w: W4Weight, out: torch.Tensor, block_n: int | None = None,
               rows: int | None = None, split: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """out[M, N] = x2[M, K] @ W for a few rows (tuning.W4A16_ROUTES says how many); x2 is
    already permuted and row-contiguous."""
    m, k = x2.shape
    n = w.out_features
    t = tiles_for(x2.device).gemv_rows
    block_n = block_n or t.block_n
    rows = min(rows or t.block_k // 8, w.group_size // 8)
    block_k = rows * 8
    n_blocks = triton.cdiv(n, block_n)
    split = split or pick_split(n_blocks, k, block_k, x2.device)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    ws = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x2.device)
    tickets = ticket_buffer(x2.device, n_blocks)
    block_m = 1 << max(0, (m - 1).bit_length())
    _w4a16_gemv_kernel[(n_blocks, split)](
        x2, w.qweight, w.scales, w.biases, out, ws, tickets,
        m, n, k, k_per_split,
        x2.stride(0), w.qweight.stride(0), w.scales.stride(0), out.stride(0),
        GROUP_SIZE=w.group_size, BLOCK_M=block_m, BLOCK_N=block_n, ROWS=rows, SPLIT=split,
        num_warps=num_warps or t.num_warps, num_stages=t.num_stages,
    )
    return out
