"""W4A16 on the CPU through torch's int4 weight-only GEMM (the kernel gpt-fast and torchao use).

`torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)` computes
x @ W with W[k, n] = (q[n, k] - 8) * scale[g, n] + zero[g, n], g = k // group_size, where
`packed` comes from `_convert_weight_to_int4pack_for_cpu(q [N, K] int32, inner_k_tiles)` (an
opaque [N, K/2] uint8 layout) and scales_and_zeros is [K/G, N, 2] in the activation dtype.

Our layout (w4a16_pack.W4Weight) is W = q * scale + bias, so zero = bias + 8 * scale: the same
numbers, repacked once at load. Only bf16 activations take the vectorized path in torch 2.13
(fp32 and fp16 fall back to a scalar loop 20-100x slower, measured on an AVX-512 Xeon), so the
kernel runs in bf16 (scales and zeros too): ~2-3e-3 relative error per matmul against the exact
fp32 reference. dispatch.w4a16_matmul therefore routes bf16 activations here and keeps fp32 ones
on the exact reference.

Measured on SmolLM2-135M Q4_1 (GGUF, group 32 with a min), 2 shared Xeon cores, decode tok/s
best of 3 (2026-11-29): fp32 dense (the CPU default) 23.0 at batch 1 / 72.6 at batch 8; bf16
W4A16 through this kernel 32.8 / 98.7; fp32 W4A16 on the exact reference 1.8 / 12.6. Logits of
bf16 W4A16 against the fp32 default: 1.2e-2 to 2.9e-2 relative over five prompts (teacher-forced,
greedy picks agree on >= 96% of steps); bf16 dense alone is 1.4e-2 to 2.2e-2 off. That is above
the 1e-2 bar, so GGUF Q4 models stay dense fp32 by default on the CPU; --dtype bfloat16
--quantization w4a16 is the fast CPU setting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Group sizes the CPU kernel accepts; N must be a multiple of 16 (its packing block).
CPU_GROUP_SIZES = (32, 64, 128, 256)
_N_BLOCK = 16


@dataclass
class CpuInt4Weight:
    """A W4Weight repacked for the CPU kernel. perm: act-order input permutation, or None."""

    packed: torch.Tensor  # uint8 [N, K / 2], torch's int4pack layout
    scales_and_zeros: torch.Tensor  # bf16 [K / G, N, 2]
    group_size: int
    in_features: int
    out_features: int
    perm: torch.Tensor | None = None


def cpu_kernel_available() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


def supports(w) -> bool:
    """Whether this W4Weight's shape fits the CPU kernel (otherwise the reference runs)."""
    return (cpu_kernel_available() and w.qweight.device.type == "cpu"
            and w.group_size in CPU_GROUP_SIZES and w.out_features % _N_BLOCK == 0
            and w.in_features % w.group_size == 0)


def repack_for_cpu(w) -> CpuInt4Weight:
    """W4Weight (kernels.w4a16_pack) -> CpuInt4Weight. One-time, at load."""
    from homelab_llm.engine.kernels.w4a16_pack import unpack_int4

    q_nk = unpack_int4(w.qweight, dim=0).t().contiguous().to(torch.int32)  # [N, K] 0..15
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q_nk, 1)
    scales = w.scales.float()
    zeros = w.biases.float() + 8.0 * scales  # exact in fp32: both are fp16 values
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).to(torch.bfloat16).contiguous()
    return CpuInt4Weight(packed, scales_and_zeros, w.group_size, w.in_features, w.out_features,
                         w.perm)


def w4a16_matmul_cpu(x: torch.Tensor, w: CpuInt4Weight) -> torch.Tensor:
    """x [..., K] @ W -> [..., N] in x's dtype; the kernel runs in bf16."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"activation has {x.shape[-1]} features, weight expects {w.in_features}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features)
    if w.perm is not None:
        x2 = x2[:, w.perm]
    if x2.shape[0] == 0:
        return x.new_empty(*lead, w.out_features)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x2.to(torch.bfloat16).contiguous(), w.packed, w.group_size, w.scales_and_zeros)
    return out.to(x.dtype).view(*lead, w.out_features)
