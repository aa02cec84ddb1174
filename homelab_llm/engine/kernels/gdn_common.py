"""What the Gated DeltaNet Triton kernels share: the varlen block table (which sequence and which
block of it each program owns, built on the device so prefill needs no host sync), the in-kernel
L2 normalization of q/k rows, and the row-stride checks of their wrappers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.gdn_ref import L2_EPS


EPS = tl.constexpr(L2_EPS)


@dataclass(frozen=True)
class VarlenBlocks:
    """Program i of a grid of `bound` programs owns block block_idx[i] (of `block` tokens) of
    sequence block_seq[i]; block_seq is -1 for the programs past the last block. `bound` is
    cdiv(T, block) + B, an upper bound known without reading cu_seqlens on the host."""

    block_seq: torch.Tensor  # int32 [bound]
    block_idx: torch.Tensor  # int32 [bound]
    bound: int


def varlen_blocks(cu_seqlens: torch.Tensor, block: int, num_tokens: int) -> VarlenBlocks:
    batch = cu_seqlens.shape[0] - 1
    bound = triton.cdiv(num_tokens, block) + batch
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    ends = torch.cumsum(torch.div(lens + block - 1, block, rounding_mode="floor"), 0)
    idx = torch.arange(bound, device=cu_seqlens.device)
    seq = torch.searchsorted(ends, idx, right=True)
    starts = torch.cat([ends.new_zeros(1), ends])[seq.clamp_max(batch)]
    block_seq = torch.where(seq < batch, seq, -1).to(torch.int32)
    return VarlenBlocks(block_seq, (idx - starts).to(torch.int32), bound)


def check_rows(*tensors: torch.Tensor) -> None:
    """Kernels index rows by (token, head) strides and need the last axis contiguous."""
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"a {tuple(t.shape)} input has a non-contiguous last axis; pass .contiguous()")


@triton.jit
def l2_normalize_rows(x, axis: tl.constexpr):
    """x fp32 with zeros in padded lanes; same eps as gdn_ref.l2_normalize."""
    return x * tl.math.rsqrt(tl.sum(x * x, axis=axis, keep_dims=True) + EPS)


@triton.jit
def inv_norm_rows(x):
    """1 / L2 norm of each row of a [rows, D] tile (zeros in padded lanes), in fp32."""
    xf = x.to(tl.float32)
    return tl.math.rsqrt(tl.sum(xf * xf, axis=1) + EPS)
