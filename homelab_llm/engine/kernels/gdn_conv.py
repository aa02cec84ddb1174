"""Causal depthwise conv1d + SiLU of the Gated DeltaNet layers (reference: gdn_ref.causal_conv1d_*).

Prefill is two launches: the output kernel (a program per block of tokens of one sequence and a
block of channels; positions before the sequence read the slot's saved inputs) and then the state
kernel that writes each slot's last W-1 inputs. Two launches because a sequence's first block
reads the old state while its last block would write the new one. Decode is one launch, each
program reading its slot's W-1 rows before overwriting them, so it is CUDA-graph safe (no host
reads, grid fixed by the row count). A verify step decodes groups of K+1 rows of one sequence in
one program and writes the state after each row to that row's slot (speculative rollback picks
the slot of the last accepted row). Math in fp32; y and the state keep x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.common import next_pow2
from homelab_llm.engine.kernels.gdn_common import block_grid, check_rows, locate_block
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
def _conv_decode_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, state_ptr, slots_ptr,
    stride_x, stride_y, stride_wc, stride_ws, stride_w, C,
    WIDTH: tl.constexpr, HIST_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr,
    ROWS: tl.constexpr, PDL: tl.constexpr = False,
):
    """A group of ROWS tokens of one sequence (1: a decode). Input i of the window (history ++
    the group's x) is saved row i for i < W-1, else x row i - (W-1): the indices are compile-time
    constants, so each tap reads the right source directly."""
    pdl_enter(PDL)
    first = tl.program_id(0) * ROWS
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < C
    slot = tl.load(slots_ptr + first).to(tl.int64)
    if slot < 0:
        for j in tl.static_range(ROWS):
            tl.store(y_ptr + (first + j) * stride_y + offs_c,
                     tl.zeros([BLOCK_C], tl.float32).to(y_ptr.dtype.element_ty), mask=c_mask)
        return
    base = state_ptr + slot * stride_ws + offs_c
    for j in tl.static_range(ROWS):
        acc = tl.zeros([BLOCK_C], tl.float32)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)
        for tap in tl.static_range(WIDTH):
            if j + tap < WIDTH - 1:
                xv = tl.load(base + (j + tap) * stride_w, mask=c_mask, other=0.0)
            else:
                xv = tl.load(x_ptr + (first + j + tap - (WIDTH - 1)) * stride_x + offs_c, mask=c_mask, other=0.0)
            acc += xv.to(tl.float32) * tl.load(w_ptr + offs_c * stride_wc + tap, mask=c_mask, other=0.0).to(tl.float32)
        y = acc / (1.0 + tl.exp(-acc))
        live = tl.load(slots_ptr + first + j) >= 0
        tl.store(y_ptr + (first + j) * stride_y + offs_c, tl.where(live, y, 0.0).to(y_ptr.dtype.element_ty),
                 mask=c_mask)
    # The state after row j is window inputs j+1 .. j+W-1. Row 0 overwrites the saved rows every
    # other row reads, so it goes last, behind a barrier.
    r = tl.arange(0, HIST_PAD)
    h_mask = (r < WIDTH - 1)[:, None] & c_mask[None, :]
    for back in tl.static_range(ROWS):
        j = ROWS - 1 - back
        src = j + 1 + r  # window index of state row r
        hist = tl.load(base[None, :] + src[:, None] * stride_w, mask=h_mask & (src < WIDTH - 1)[:, None], other=0.0)
        xr = (first + src - (WIDTH - 1)).to(tl.int64)
        xv = tl.load(x_ptr + xr[:, None] * stride_x + offs_c[None, :], mask=h_mask & (src >= WIDTH - 1)[:, None],
                     other=0.0)
        new = tl.where((src >= WIDTH - 1)[:, None], xv.to(state_ptr.dtype.element_ty), hist)
        dst = tl.load(slots_ptr + first + j).to(tl.int64)
        if j == 0:
            tl.debug_barrier()  # every lane has read the saved rows before they are overwritten
        if dst >= 0:
            tl.store(state_ptr + dst * stride_ws + r[:, None] * stride_w + offs_c[None, :], new, mask=h_mask)


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


def conv1d_decode(x, weight, bias, conv_state, state_indices, rows_per_seq: int = 1) -> torch.Tensor:
    """Rows in groups of rows_per_seq tokens of one sequence (gdn_ref.causal_conv1d_decode_ref)."""
    _check(x, weight, conv_state)
    rows, channels = x.shape
    y = torch.empty_like(x)
    if rows == 0:
        return y
    tiles = gdn_tiles(x.device)
    width = weight.shape[1]
    _conv_decode_kernel[(rows // rows_per_seq, triton.cdiv(channels, tiles.conv_c))](
        x, weight, bias if bias is not None else weight, y, conv_state, state_indices,
        x.stride(0), y.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1), channels,
        WIDTH=width, HIST_PAD=next_pow2(width - 1), HAS_BIAS=bias is not None, BLOCK_C=tiles.conv_c,
        ROWS=rows_per_seq, num_warps=tiles.conv_warps, **pdl_args(x.device))
    return y
