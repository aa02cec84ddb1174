"""What the Gated DeltaNet Triton kernels share: which sequence and which block of it a varlen
program owns (found in the kernel from cu_seqlens, so prefill needs no host sync and no extra
launch), the in-kernel L2 norms of q/k rows, the decay/beta gating of one (token, head), the
dot-operand casts of the chunk kernels and the
row-stride checks of their wrappers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels import gdn_pending
from homelab_llm.engine.kernels.gdn_ref import L2_EPS


EPS = tl.constexpr(L2_EPS)
# a decode row's state word (gdn_pending.state_word)
SLOT_MASK = tl.constexpr(gdn_pending.SLOT_MASK)
PEND_SHIFT = tl.constexpr(gdn_pending.PEND_SHIFT)
PEND_MASK = tl.constexpr(gdn_pending.PEND_MASK)
HALF_SHIFT = tl.constexpr(gdn_pending.HALF_SHIFT)


def block_grid(num_tokens: int, batch: int, block: int) -> int:
    """Programs to launch so that every `block`-token block of every sequence has one:
    cdiv(T, block) + B bounds the block count without reading cu_seqlens on the host."""
    return triton.cdiv(num_tokens, block) + batch


@triton.jit
def locate_block(cu_ptr, batch, BLOCK: tl.constexpr, B_PAD: tl.constexpr):
    """(sequence, block index within it) of this program (axis 0 of a block_grid launch), from
    cu_seqlens alone; the sequence is >= batch for the programs past the last block. Sequences
    of length 0 own no block."""
    i = tl.program_id(0)
    offs = tl.arange(0, B_PAD)
    blocks = _seq_blocks(cu_ptr, batch, BLOCK, B_PAD)
    ends = tl.cumsum(blocks, axis=0)  # blocks of sequences 0..s
    seq = tl.sum(((ends <= i) & (offs < batch)).to(tl.int32), axis=0)
    return seq, i - blocks_before(cu_ptr, seq, batch, BLOCK, B_PAD)


@triton.jit
def block_rows(cu_ptr, seq, blk, BLOCK: tl.constexpr):
    """(first token, end of the sequence, [BLOCK] row mask, [BLOCK] int64 rows) of a located block."""
    t0 = tl.load(cu_ptr + seq) + blk * BLOCK
    eos = tl.load(cu_ptr + seq + 1)
    offs = t0 + tl.arange(0, BLOCK)
    return t0, eos, offs < eos, offs.to(tl.int64)


@triton.jit
def _seq_blocks(cu_ptr, batch, BLOCK: tl.constexpr, B_PAD: tl.constexpr):
    """[B_PAD] block count of each sequence (0 past the batch)."""
    offs = tl.arange(0, B_PAD)
    live = offs < batch
    starts = tl.load(cu_ptr + offs, mask=live, other=0)
    lens = tl.load(cu_ptr + offs + 1, mask=live, other=0) - starts
    return (lens + BLOCK - 1) // BLOCK


@triton.jit
def blocks_before(cu_ptr, seq, batch, BLOCK: tl.constexpr, B_PAD: tl.constexpr):
    """Blocks of the sequences before `seq`: the block_grid index of seq's first block."""
    offs = tl.arange(0, B_PAD)
    return tl.sum(tl.where(offs < seq, _seq_blocks(cu_ptr, batch, BLOCK, B_PAD), 0), axis=0)


def check_rows(*tensors: torch.Tensor) -> None:
    """Kernels index rows by (token, head) strides and need the last axis contiguous."""
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"a {tuple(t.shape)} input has a non-contiguous last axis; pass .contiguous()")


@triton.jit
def gate_values(a, b, a_log, dt_bias):
    """(g, beta) fp32 from raw a, b and the head's A_log, dt_bias (gdn_ref.gdn_gating_ref):
    g = -exp(A_log) * softplus(a + dt_bias), softplus as torch's (x itself above 20); beta =
    sigmoid(b), which callers round to b's dtype as the reference does."""
    x = a.to(tl.float32) + dt_bias.to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = -tl.exp(a_log.to(tl.float32)) * softplus
    return g, 1.0 / (1.0 + tl.exp(-b.to(tl.float32)))


@triton.jit
def l2_normalize_rows(x, axis: tl.constexpr):
    """x fp32 with zeros in padded lanes; same eps as gdn_ref.l2_normalize."""
    return x * tl.math.rsqrt(tl.sum(x * x, axis=axis, keep_dims=True) + EPS)


@triton.jit
def inv_norm_rows(x):
    """1 / L2 norm of each row of a [rows, D] tile (zeros in padded lanes), in fp32."""
    xf = x.to(tl.float32)
    return tl.math.rsqrt(tl.sum(xf * xf, axis=1) + EPS)


@triton.jit
def dot_operand(x, like_ptr, DOT_F32: tl.constexpr):
    """x in the dtype the dot products take: like_ptr's (fp32 in the interpreter)."""
    if DOT_F32:
        return x.to(tl.float32)
    return x.to(like_ptr.dtype.element_ty)


@triton.jit
def dot_mm(a, b, like_ptr, DOT_F32: tl.constexpr):
    """a @ b with operands cast by dot_operand, fp32 accumulation."""
    return tl.dot(dot_operand(a, like_ptr, DOT_F32), dot_operand(b, like_ptr, DOT_F32))


@triton.jit
def load_start_state(state_ptr, init_ptr, seq, slot, h, offs_k, offs_v, DK: tl.constexpr, DV: tl.constexpr,
                     stride_ss, stride_sh, stride_sk):
    """(pointers, mask, fp32 tile) of the [Dk, BLOCK_V] state slice of (slot, head h) at a prefill's
    start: its stored value when the sequence has history, else zeros."""
    s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    s_mask = (offs_k < DK)[:, None] & (offs_v < DV)[None, :]
    # no history: read no rows (an integer bound; the interpreter mistypes scalar-bool masks)
    init_rows = tl.where(tl.load(init_ptr + seq) != 0, DK, 0)
    return s_ptrs, s_mask, tl.load(s_ptrs, mask=s_mask & (offs_k < init_rows)[:, None], other=0.0)
