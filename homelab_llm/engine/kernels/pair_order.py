"""Pair order: a K step's activations laid out as the few-row W4A16 left loop's four nibble-pair
slices (kernels/w4a16_dot.py wleft_steps with X_PAIRS), so each slice is one contiguous load
that goes to the tensor cores as it is.

Inside a step of block_k values (8 r + 4 h + j: word row r, half h, nibble j < 4), value k sits
at j (block_k / 4) + 2 r + h: slice j holds nibble pair (j, j + 4) of every word row, the two
values of a row's pair side by side as the left operand's registers hold them. `pair_order`
reorders rows on the host (one copy kernel); `pair_position` is the same map for a kernel that
writes its output in that order where it makes it (the RMSNorm and the SiLU-and-mul in front
of a linear: kernels/elementwise.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def pair_order(x2: torch.Tensor, block_k: int) -> torch.Tensor:
    """x2 [M, K] with each K step of block_k values in pair order (a new contiguous tensor)."""
    m, k = x2.shape
    return x2.view(m, k // block_k, block_k // 8, 2, 4).permute(0, 1, 4, 2, 3).contiguous().view(m, k)


def rows_in_pair_order(out: torch.Tensor, pair_block: int) -> torch.Tensor:
    """out [T, ...] with each row's values in pair order at pair_block (pair_order's launch; out
    itself for 0), same shape: the reorder for a route whose kernels write k order."""
    if not pair_block:
        return out
    rows = out.reshape(out.shape[0], -1)
    return pair_order(rows, pair_check(rows.shape[1], pair_block)).view(out.shape)


@triton.jit
def pair_position(offs, PAIR_BLOCK: tl.constexpr):
    """Where value k (offs, its index in the row) sits in pair order for K steps of PAIR_BLOCK;
    PAIR_BLOCK 0: k itself."""
    if PAIR_BLOCK == 0:
        return offs
    i = offs % PAIR_BLOCK
    return offs - i + (i % 4) * (PAIR_BLOCK // 4) + (i // 8) * 2 + (i // 4) % 2


def pair_check(n: int, pair_block: int) -> int:
    """pair_block for rows of n values: 0, or a multiple of 8 dividing n (whole K steps)."""
    if pair_block and (pair_block % 8 or n % pair_block):
        raise ValueError(f"pair order needs whole K steps of a multiple of 8 values: {n} by {pair_block}")
    return pair_block
