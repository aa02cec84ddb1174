"""W4A16 matmul: activations in bf16/fp16, weights in our packed int4 layout (see w4a16_pack.py).

The table tuning.W4A16_ROUTES picks the kernel by row count: a GEMV (w4a16_rows.py for 1-16
rows, the packed-half w4a16_h2.py for 1-8, or the older one-row w4a16_gemv.py), the few-row
tensor-core kernel (w4a16_dot.py) for decode batches, for prefill chunks the weight dequantized once into the BLAS GEMM
(w4a16_deq.py), and the GEMM kernel here where that does not apply: each
program loads a [BLOCK_K / 8, BLOCK_N] tile of words, dequantizes it in registers
(w4a16_words.k_rows_f32) and feeds tl.dot. BLOCK_K never exceeds the group
size, so a tile needs one row of scales/biases. Skinny shapes split K across programs
(`split_k`) into an fp32 workspace that is summed afterwards: deterministic, unlike atomics.
Decode at batch 1 is bound by reading the weights, 0.5 byte per parameter plus scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.common import dot_in_fp32
from homelab_llm.engine.kernels.tuning import GemmTiles, device_sms, gemm_tiles, w4a16_route
from homelab_llm.engine.kernels.w4a16_deq import fits_scratch, w4a16_deq_matmul
from homelab_llm.engine.kernels.w4a16_dot import w4a16_dot
from homelab_llm.engine.kernels.w4a16_gemv import w4a16_gemv
from homelab_llm.engine.kernels.w4a16_h2 import MAX_ROWS as H2_MAX_ROWS, w4a16_h2
from homelab_llm.engine.kernels.w4a16_mma import mma_fits, w4a16_mma
from homelab_llm.engine.kernels.w4a16_pack import W4Weight
from homelab_llm.engine.kernels.w4a16_rows import w4a16_rows
from homelab_llm.engine.kernels.w4a16_words import k_rows_f32, load_k_words


@triton.jit
def _w4a16_kernel(
    x_ptr, qw_ptr, scales_ptr, biases_ptr, out_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_qw, stride_sg, stride_os, stride_om,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None], other=0.0)
        # Eight consecutive k share a word: the tile's BLOCK_K // 8 word rows, loaded once
        q = k_rows_f32(load_k_words(qw_ptr, k0, stride_qw, offs_n, n_mask, BLOCK_K))
        group = k0 // GROUP_SIZE
        s = tl.load(scales_ptr + group * stride_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        b = tl.load(biases_ptr + group * stride_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        w = q * s[None, :] + b[None, :]
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), w)
        else:
            acc += tl.dot(x, w.to(x.dtype))
    out = out_ptr + pid_k * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _pick_split_k(tiles: GemmTiles, m: int, n: int, k: int, block_k: int, device: torch.device) -> int:
    """Split K only when the output tiles alone leave most of the device idle."""
    tiles_mn = triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n)
    split = tiles.split_k
    while split > 1 and (tiles_mn * split > 4 * device_sms(device) or k // split < 4 * block_k):
        split //= 2
    return max(1, split)


def w4a16_matmul(x: torch.Tensor, w: W4Weight, tiles: GemmTiles | None = None,
                 split_k: int | None = None) -> torch.Tensor:
    """x [..., K] (bf16/fp16) @ W -> [..., N] in x's dtype."""
    k, n = w.in_features, w.out_features
    if x.shape[-1] != k:
        raise ValueError(f"activation has {x.shape[-1]} features, weight expects {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if w.perm is not None:
        x2 = x2[:, w.perm]
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n)
    route = "gemm" if tiles is not None else w4a16_route(m, x.device)
    if route == "rows":
        return w4a16_rows(x2, w, out, split=split_k).view(*lead, n)
    if route == "mma":
        if mma_fits(m, w):
            return w4a16_mma(x2, w, out).view(*lead, n)
        route = "h2" if m <= H2_MAX_ROWS else "dotL"  # another group size: the kernels that take it
    if route == "h2":
        return w4a16_h2(x2, w, out, split=split_k).view(*lead, n)
    if route == "gemv":
        return w4a16_gemv(x2, w, out, split=split_k).view(*lead, n)
    if route in ("dot", "dotL"):
        return w4a16_dot(x2, w, out, split=split_k, w_left=route == "dotL").view(*lead, n)
    if route == "deq" and fits_scratch(w, x2.dtype):
        return w4a16_deq_matmul(x2, w, out).view(*lead, n)
    tiles = tiles or gemm_tiles(m, x.device)
    block_k = min(tiles.block_k, w.group_size)
    split = split_k or _pick_split_k(tiles, m, n, k, block_k, x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    target = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), split)
    _w4a16_kernel[grid](
        x2, w.qweight, w.scales, w.biases, target,
        m, n, k, k_per_split,
        x2.stride(0), w.qweight.stride(0), w.scales.stride(0),
        target.stride(0) if split > 1 else 0, target.stride(-2),
        GROUP_SIZE=w.group_size, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=block_k,
        DOT_F32=dot_in_fp32(), num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    if split > 1:
        out.copy_(target.sum(dim=0))
    return out.view(*lead, n)
