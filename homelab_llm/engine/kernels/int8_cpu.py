"""int8 weights (one scale per 32 inputs, as GGUF Q8_0): the CPU LM head.

Where our AVX2 kernel runs (kernels/q4_native.py), the codes and fp16 scales go to it as they
are: 34 bytes per 32 weights, int8 activations per 32 inputs. Elsewhere, torch's int4 kernel:
torch 2.13 has no fast CPU kernel for group-wise int8 weights (`_weight_int8pack_mm` takes one
scale per output row and was 3x slower than the int4 kernel on the LM head), so each int8 code
q in [-127, 127] is split into two nibbles, q = 16 * hi + lo with hi in [-8, 7] and lo in
[0, 15], and the weight becomes two int4 weights stacked along the outputs:

    W[n, k] = 16 * d * hi + d * lo   (d: the group's scale)
    rows 0..N-1  : code hi + 8, scale 16 * d, zero 0      (the kernel computes (c - 8) * s + z)
    rows N..2N-1 : code lo,     scale d,      zero 8 * d

One kernel call gives both halves; their sum is the product. The codes are exact; only the scales
are rounded to bf16 (the kernel's dtype). Read per token: ~1.1 bytes per weight, a quarter of fp32.
Quantizing a Q8_0 tensor's dequantized values gives back its own codes: the block maximum is
exactly 127 * d, so d and every q round-trip (and d is an fp16 value, so the native pack's fp16
scales hold it exactly).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from homelab_llm.engine.kernels import q4_native
from homelab_llm.engine.kernels.cpu_threads import single_thread

INT8_GROUP_SIZE = 32


@dataclass
class CpuInt8Weight:
    """An [N, K] int8 weight as 2N int4 rows for torch's kernel (see the module docstring), or as
    Q8_0-style blocks for our AVX2 kernel (native: kernels/q4_native.py; packed and
    scales_and_zeros are then None)."""

    packed: torch.Tensor | None  # uint8 [2N, K / 2], torch's int4pack layout
    scales_and_zeros: torch.Tensor | None  # bf16 [K / G, 2N, 2]
    out_features: int
    in_features: int
    native: q4_native.NativeWeight | None = None


def supports(weight: torch.Tensor) -> bool:
    from homelab_llm.engine.kernels.w4a16_cpu import cpu_kernel_available

    n, k = weight.shape
    return k % INT8_GROUP_SIZE == 0 and (q4_native.available() or (cpu_kernel_available() and n % 8 == 0))


def int8_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> symmetric int8 codes [N, K] (int32, -127..127) and scales [N, K / 32]."""
    n, k = weight.shape
    g = INT8_GROUP_SIZE
    w = weight.detach().float().reshape(n, k // g, g)
    d = w.abs().amax(dim=-1) / 127.0  # [N, K/G]
    q = torch.round(w / torch.where(d > 0, d, 1.0).unsqueeze(-1)).clamp_(-127, 127).to(torch.int32)
    return q.reshape(n, k), d


def quantize_int8_for_cpu(weight: torch.Tensor, native: bool | None = None) -> CpuInt8Weight:
    """weight [N, K] (any float dtype) -> symmetric int8 per group of 32 inputs: for our AVX2
    kernel where it runs (native None: q4_native.available(); its scales in fp16), else split
    for the int4 kernel. One-time, at load."""
    n, k = weight.shape
    q, d = int8_codes(weight)
    if q4_native.available() if native is None else native:
        return CpuInt8Weight(None, None, n, k, native=q4_native.pack_q8(q, d))
    q = q.view(n, k // INT8_GROUP_SIZE, INT8_GROUP_SIZE)
    hi = torch.div(q, 16, rounding_mode="floor")  # -8..7
    lo = q - 16 * hi  # 0..15
    codes = torch.cat([(hi + 8).reshape(n, k), lo.reshape(n, k)])  # [2N, K]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
    scales = torch.cat([16.0 * d, d]).t()  # [K/G, 2N]
    zeros = torch.cat([torch.zeros_like(d), 8.0 * d]).t()
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).to(torch.bfloat16).contiguous()
    return CpuInt8Weight(packed, scales_and_zeros, n, k)


def int8_matmul_cpu(x: torch.Tensor, w: CpuInt8Weight) -> torch.Tensor:
    """x [M, K] @ W.T -> float32 [M, N]; the kernel runs in bf16, the halves add in fp32."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"activation has {x.shape[-1]} features, weight expects {w.in_features}")
    if x.shape[0] == 0:
        return x.new_empty(0, w.out_features, dtype=torch.float32)
    if w.native is not None:
        return q4_native.matmul(x.float(), w.native)
    both = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.to(torch.bfloat16).contiguous(), w.packed, INT8_GROUP_SIZE, w.scales_and_zeros)
    n = w.out_features
    with single_thread():  # two passes over one row: less than the pool's fork/join
        return both[:, :n].float().add_(both[:, n:])
