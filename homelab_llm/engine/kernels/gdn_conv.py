"""Causal depthwise conv1d + SiLU of the Gated DeltaNet layers (reference: gdn_ref.causal_conv1d_*).

Prefill is two launches: the output kernel (a program per block of tokens of one sequence and a
block of channels; positions before the sequence read the slot's saved inputs) and then the state
kernel that writes each slot's last W-1 inputs. Two launches because a sequence's first block
reads the old state while its last block would write the new one. Decode is one launch, each
program reading its slot's W-1 rows before overwriting them, so it is CUDA-graph safe (no host
reads, grid fixed by the row count). A verify step decodes groups of K+1 rows of one sequence in
one program; its inputs become the slot's pending rows, which the next decode's window starts
after (gdn_pending.py: rollback is the host's count of them). Math in fp32; y and the state keep
x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.common import next_pow2
from homelab_llm.engine.kernels.gdn_common import (
    PEND_MASK, PEND_SHIFT, SLOT_MASK, block_grid, check_rows, locate_block,
)
from homelab_llm.engine.kernels.gdn_pending import PendingRows, check_groups
from homelab_llm.engine.kernels.pdl import pdl_args, pdl_enter
from homelab_llm.engine.kernels.tuning import gdn_tiles


@triton.jit
def _conv_prefill_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, state_ptr, cu_ptr, slots_ptr, init_ptr, batch,
    stride_x, stride_y, stride_wc, stride_ws, stride_w, C,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    B_PAD: tl.constexpr,
):
    seq, blk = locate_block(cu_ptr, batch, BLOCK_T, B_PAD)
    if seq >= batch:
        return
    bos = tl.load(cu_ptr + seq)
    length = tl.load(cu_ptr + seq + 1) - bos
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    # first input position that exists: the saved ones (negative positions) only with a history
    # (an integer bound, not a scalar-bool mask, which the interpreter mistypes)
    first = tl.where(tl.load(init_ptr + seq) != 0, 1 - WIDTH, 0)
    pos = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < C
    t_mask = (pos < length)[:, None] & c_mask[None, :]
    rows = (bos + pos).to(tl.int64)
    if slot < 0:  # padding row: zeros out, state untouched
        tl.store(y_ptr + rows[:, None] * stride_y + offs_c[None, :], tl.zeros([BLOCK_T, BLOCK_C], tl.float32).to(
            y_ptr.dtype.element_ty), mask=t_mask)
        return
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(WIDTH):
        src = pos - (WIDTH - 1) + j  # input position this tap reads; < 0 lies in the saved state
        xv = tl.load(x_ptr + (bos + src).to(tl.int64)[:, None] * stride_x + offs_c[None, :],
                     mask=t_mask & (src >= 0)[:, None], other=0.0).to(tl.float32)
        hist = (WIDTH - 1 + src).to(tl.int64)
        sv = tl.load(state_ptr + slot * stride_ws + hist[:, None] * stride_w + offs_c[None, :],
                     mask=t_mask & ((src < 0) & (src >= first))[:, None], other=0.0).to(tl.float32)
        wj = tl.load(w_ptr + offs_c * stride_wc + j, mask=c_mask, other=0.0).to(tl.float32)
        acc += (xv + sv) * wj[None, :]
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(y_ptr + rows[:, None] * stride_y + offs_c[None, :], y.to(y_ptr.dtype.element_ty), mask=t_mask)


@triton.jit
def _conv_state_kernel(
    x_ptr, state_ptr, cu_ptr, slots_ptr, init_ptr, stride_x, stride_ws, stride_w, C,
    WIDTH: tl.constexpr, HIST_PAD: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """state[slot] <- the last W-1 inputs of (old state or zeros) ++ x_seq."""
    seq = tl.program_id(0)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    if slot < 0:
        return
    bos = tl.load(cu_ptr + seq)
    length = tl.load(cu_ptr + seq + 1) - bos
    first = tl.where(tl.load(init_ptr + seq) != 0, 1 - WIDTH, 0)  # as in _conv_prefill_kernel
    r = tl.arange(0, HIST_PAD)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r < WIDTH - 1)[:, None] & (offs_c < C)[None, :]
    src = length - (WIDTH - 1) + r
    xv = tl.load(x_ptr + (bos + src).to(tl.int64)[:, None] * stride_x + offs_c[None, :],
                 mask=mask & (src >= 0)[:, None], other=0.0)
    base = state_ptr + slot * stride_ws + offs_c[None, :]
    old = tl.load(base + (WIDTH - 1 + src).to(tl.int64)[:, None] * stride_w,
                  mask=mask & ((src < 0) & (src >= first))[:, None], other=0.0)
    new = tl.where((src >= 0)[:, None], xv.to(state_ptr.dtype.element_ty), old)
    tl.debug_barrier()  # every lane has read the old rows before any is overwritten
    tl.store(base + r[:, None] * stride_w, new, mask=mask)


@triton.jit
def _history_rows(base, pbase, w, count, stride_w, stride_pr, mask, WIDTH: tl.constexpr, PEND_ROWS: tl.constexpr):
    """History inputs w (< W-1) of a decode window: the last W-1 inputs after the slot's `count`
    pending rows, i.e. its saved row w + count, or pending row w + count - (W-1)."""
    if PEND_ROWS:
        src = w + count + tl.zeros_like(mask.to(tl.int32))  # mask's shape (a scalar-bool mask mistypes)
        saved = tl.load(base + src * stride_w, mask=mask & (src < WIDTH - 1), other=0.0)
        return saved + tl.load(pbase + (src - (WIDTH - 1)) * stride_pr, mask=mask & (src >= WIDTH - 1), other=0.0)
    else:
        return tl.load(base + w * stride_w, mask=mask, other=0.0)


@triton.jit
def _window_rows(base, pbase, x_ptr, first, w, count, stride_w, stride_pr, stride_x, offs_c, mask,
                 WIDTH: tl.constexpr, PEND_ROWS: tl.constexpr):
    """Window inputs w [N] x offs_c: history (_history_rows) for w < W-1, else x row first + w - (W-1)."""
    hist = _history_rows(base[None, :], pbase[None, :], w[:, None], count, stride_w, stride_pr,
                         mask & (w < WIDTH - 1)[:, None], WIDTH, PEND_ROWS)
    xr = (first + w - (WIDTH - 1)).to(tl.int64)
    xv = tl.load(x_ptr + xr[:, None] * stride_x + offs_c[None, :], mask=mask & (w >= WIDTH - 1)[:, None],
                 other=0.0)
    return hist + xv.to(hist.dtype)


@triton.jit
def _conv_decode_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, state_ptr, slots_ptr, px_ptr,
    stride_x, stride_y, stride_wc, stride_ws, stride_w, stride_ps, stride_pr, C,
    WIDTH: tl.constexpr, HIST_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr,
    ROWS: tl.constexpr, PDL: tl.constexpr = False, PEND_ROWS: tl.constexpr = 0, ROWS_PAD: tl.constexpr = 1,
):
    """A group of ROWS tokens of one sequence (1: a decode). Input i of the window (history ++
    the group's x) is history row i for i < W-1 (_history_rows: after the slot's pending rows),
    else x row i - (W-1): the window indices are compile-time constants."""
    pdl_enter(PDL)
    first = tl.program_id(0) * ROWS
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < C
    word = tl.load(slots_ptr + first)
    if word < 0:
        for j in tl.static_range(ROWS):
            tl.store(y_ptr + (first + j) * stride_y + offs_c,
                     tl.zeros([BLOCK_C], tl.float32).to(y_ptr.dtype.element_ty), mask=c_mask)
        return
    if PEND_ROWS:
        slot = (word & SLOT_MASK).to(tl.int64)
        count = (word >> PEND_SHIFT) & PEND_MASK
    else:
        slot = word.to(tl.int64)
        count = 0
    base = state_ptr + slot * stride_ws + offs_c
    pbase = px_ptr + slot * stride_ps + offs_c
    for j in tl.static_range(ROWS):
        acc = tl.zeros([BLOCK_C], tl.float32)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)
        for tap in tl.static_range(WIDTH):
            if j + tap < WIDTH - 1:
                xv = _history_rows(base, pbase, j + tap, count, stride_w, stride_pr, c_mask, WIDTH, PEND_ROWS)
            else:
                xv = tl.load(x_ptr + (first + j + tap - (WIDTH - 1)) * stride_x + offs_c, mask=c_mask, other=0.0)
            acc += xv.to(tl.float32) * tl.load(w_ptr + offs_c * stride_wc + tap, mask=c_mask, other=0.0).to(tl.float32)
        y = acc / (1.0 + tl.exp(-acc))
        live = tl.load(slots_ptr + first + j) >= 0
        tl.store(y_ptr + (first + j) * stride_y + offs_c, tl.where(live, y, 0.0).to(y_ptr.dtype.element_ty),
                 mask=c_mask)
    # One decode row: the slot keeps window inputs 1 .. W-1. A verify group: the slot keeps the
    # history (inputs 0 .. W-2) and the group's inputs become its pending rows. Every lane reads
    # before any writes.
    r = tl.arange(0, HIST_PAD)
    h_mask = (r < WIDTH - 1)[:, None] & c_mask[None, :]
    if ROWS == 1:
        w = r + 1
    else:
        w = r
    new = _window_rows(base, pbase, x_ptr, first, w, count, stride_w, stride_pr, stride_x, offs_c, h_mask,
                       WIDTH, PEND_ROWS)
    if ROWS > 1:
        rr = tl.arange(0, ROWS_PAD)
        x_mask = (rr < ROWS)[:, None] & c_mask[None, :]
        xs = tl.load(x_ptr + (first + rr)[:, None] * stride_x + offs_c[None, :], mask=x_mask, other=0.0)
        tl.debug_barrier()
        tl.store(pbase[None, :] + rr[:, None] * stride_pr, xs.to(px_ptr.dtype.element_ty), mask=x_mask)
    else:
        tl.debug_barrier()
    tl.store(base[None, :] + r[:, None] * stride_w, new.to(state_ptr.dtype.element_ty), mask=h_mask)


def _check(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> None:
    check_rows(x, weight, conv_state)
    if weight.shape[1] < 2:
        raise ValueError("conv width must be >= 2 (the state holds W-1 inputs)")


def conv1d_prefill(x, weight, bias, cu_seqlens, conv_state, state_indices, has_initial_state) -> torch.Tensor:
    _check(x, weight, conv_state)
    num_tokens, channels = x.shape
    width = weight.shape[1]
    y = torch.empty_like(x)
    batch = state_indices.shape[0]
    if batch == 0:
        return y
    tiles = gdn_tiles(x.device)
    n_c = triton.cdiv(channels, tiles.conv_c)
    bias_arg = bias if bias is not None else weight
    if num_tokens:  # (with no tokens the state kernel still resets the slots without history)
        _conv_prefill_kernel[(block_grid(num_tokens, batch, tiles.conv_t), n_c)](
            x, weight, bias_arg, y, conv_state, cu_seqlens, state_indices, has_initial_state, batch,
            x.stride(0), y.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1), channels,
            WIDTH=width, HAS_BIAS=bias is not None, BLOCK_T=tiles.conv_t, BLOCK_C=tiles.conv_c,
            B_PAD=next_pow2(batch), num_warps=tiles.conv_warps)
    _conv_state_kernel[(batch, n_c)](
        x, conv_state, cu_seqlens, state_indices, has_initial_state,
        x.stride(0), conv_state.stride(0), conv_state.stride(1), channels,
        WIDTH=width, HIST_PAD=next_pow2(width - 1), BLOCK_C=tiles.conv_c, num_warps=tiles.conv_warps)
    return y


def conv1d_decode(x, weight, bias, conv_state, state_indices, rows_per_seq: int = 1,
                  pending: PendingRows | None = None) -> torch.Tensor:
    """Rows in groups of rows_per_seq tokens of one sequence (gdn_ref.causal_conv1d_decode_ref);
    pending: the layer's pending rows (gdn_pending.py; required for groups of 2+ rows)."""
    _check(x, weight, conv_state)
    check_groups(rows_per_seq, pending)
    if pending is not None:
        pending.check(conv_state=conv_state)
    rows, channels = x.shape
    y = torch.empty_like(x)
    if rows == 0:
        return y
    tiles = gdn_tiles(x.device)
    width = weight.shape[1]
    px = pending.x if pending is not None else conv_state
    _conv_decode_kernel[(rows // rows_per_seq, triton.cdiv(channels, tiles.conv_c))](
        x, weight, bias if bias is not None else weight, y, conv_state, state_indices, px,
        x.stride(0), y.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1),
        px.stride(0), px.stride(1), channels,
        WIDTH=width, HIST_PAD=next_pow2(width - 1), HAS_BIAS=bias is not None, BLOCK_C=tiles.conv_c,
        ROWS=rows_per_seq, PEND_ROWS=pending.rows if pending is not None else 0,
        ROWS_PAD=next_pow2(rows_per_seq), num_warps=tiles.conv_warps, **pdl_args(x.device))
    return y
