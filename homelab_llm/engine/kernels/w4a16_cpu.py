"""W4A16 on the CPU through torch's int4 weight-only GEMM (the kernel gpt-fast and torchao use).

`torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)` computes
x @ W with W[k, n] = (q[n, k] - 8) * scale[g, n] + zero[g, n], g = k // group_size, where
`packed` comes from `_convert_weight_to_int4pack_for_cpu(q [N, K] int32, inner_k_tiles)` (an
opaque [N, K/2] uint8 layout) and scales_and_zeros is [K/G, N, 2] in the activation dtype.

Our layout (w4a16_pack.W4Weight) is W = q * scale + bias, so zero = bias + 8 * scale: the same
numbers, repacked once at load. Only bf16 activations take the vectorized path in torch 2.13
(fp32 and fp16 fall back to a scalar loop 20-100x slower, measured on an AVX-512 Xeon), so the
kernel runs in bf16 (scales and zeros too): ~2-3e-3 relative error per matmul against the exact
fp32 reference. A layer gets the repacked copy only when its 4-bit matmuls are to compute in
bf16 (LinearBase.set_w4); activations of any dtype are then cast to bf16 and the result back.

Many rows (prompt processing) are compute-bound, and the int4 kernel is no faster there than a
dense GEMM on dequantized weights: fp32 (DENSE_DTYPE), faster than the int4 kernel from ~32 rows
(SmolLM2's shapes at 32 rows: 0.20-1.22 ms against 0.31-1.63, an AVX2 EPYC). bf16 would be ~2x
faster where oneDNN has a native bf16 GEMM (AVX-512 / AMX; on AVX2 torch's bf16 mm is a scalar
loop, 209 ms against 2.4 in fp32 at 128 x 576 x 1536) but flips near-tied prompts' first tokens
between cached and uncached requests (DENSE_DTYPE). DENSE_ROWS picks the path.

The CPU default for a GGUF Q4 model (device.fast_cpu_default) runs the model in fp32 with these
matmuls in bf16: SmolLM2-135M Q4_1 logits 0.8-1.7% (relative, Frobenius) from the exact fp32
path over four prompts, greedy picks the same on >= 95% of steps. The whole model in bf16 was
1.2-2.9% off (2026-11-29): the fp32 residual stream, norms and attention account for the gap.
Decode at batch 1 on one shared EPYC core (2026-12-01, CPU time, load 5-15): ~30 tok/s against
~12.5 for the exact path; about half of the step is still per-op dispatch of the small ops.

Where our AVX2 kernel runs (kernels/q4_native.py: a C compiler, AVX2/FMA/F16C, groups of 32s,
no act-order), a weight is packed for it instead of for torch's kernel (CpuInt4Weight.native),
and it takes calls of fewer than NATIVE_ROWS rows (and every call where no dense copy is kept).
On an AVX2 EPYC at 2 threads (SmolLM2's 3072x576, 2026-12-06): 1 row 43-52 us against torch's
int4 kernel's 131-142; 32 rows 0.68 ms against the fp32 GEMM's 1.16 and int4's 1.41; 128 rows
2.9 against 3.7 ms; even at 256, behind from 512 (14.8 against 13.5 ms). Speed alone would put
the switch near 256 rows; accuracy puts it at 16 where the dense copy is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from homelab_llm.engine.kernels import q4_native

# Group sizes the CPU kernel accepts; N must be a multiple of 16 (its packing block).
CPU_GROUP_SIZES = (32, 64, 128, 256)
_N_BLOCK = 16
# From this many rows on, dequantize to DENSE_DTYPE and run a dense GEMM (module docstring).
DENSE_ROWS = 32
# The dense copy's dtype: fp32 on every CPU. bf16 (where oneDNN has a native bf16 GEMM, AVX-512 /
# AMX) was ~2x faster there but moved prompt logits enough that a prompt's first token flipped
# between an uncached request (178 rows through the bf16 GEMM) and the same request again off the
# prefix cache (two rows through the int8-activation kernel): SmolLM2 Q4_1, the chat template's
# "What is the capital of France?", top-2 gap 0.082 nats exact, 0.047 bf16 (BENCHMARKS 56).
DENSE_DTYPE = torch.float32
# Below this many rows our AVX2 kernel (q4_native) runs where the weight has its pack; from here
# on the dense GEMM where a dense copy is kept (fp32 where bf16 is not native: prompts stay near
# exact, the int8 activations being ~5x coarser), else still ours (dequantizing each call costs
# more than it).
NATIVE_ROWS = 16
# A model whose 4-bit linears take at most this much in DENSE_DTYPE keeps that dense copy beside
# the packed one (model/cpu_kernels.py): SmolLM2-135M's is 212 MB in bf16, 424 MB in fp32, its
# packed weights ~66 MB.
DENSE_CACHE_BYTES = 512 << 20


@dataclass
class CpuInt4Weight:
    """A W4Weight repacked for a CPU kernel: torch's int4 kernel (packed, scales_and_zeros), or
    our AVX2 kernel (native: kernels/q4_native.py; then those two are None). perm: act-order
    input permutation, or None."""

    packed: torch.Tensor | None  # uint8 [N, K / 2], torch's int4pack layout
    scales_and_zeros: torch.Tensor | None  # bf16 [K / G, N, 2]
    group_size: int
    in_features: int
    out_features: int
    perm: torch.Tensor | None = None
    # [K, N] in DENSE_DTYPE (dequantize_dense), kept when the model is small enough (DENSE_CACHE_BYTES):
    # many-row calls then skip dequantizing, a quarter of a 512-token prefill's matmul time.
    dense: torch.Tensor | None = None
    native: q4_native.NativeWeight | None = None


def cpu_kernel_available() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


def supports(w) -> bool:
    """Whether this W4Weight fits a CPU kernel (otherwise the reference runs)."""
    return native_fits(w) or (cpu_kernel_available() and w.qweight.device.type == "cpu"
                              and w.group_size in CPU_GROUP_SIZES and w.out_features % _N_BLOCK == 0
                              and w.in_features % w.group_size == 0)


def native_fits(w) -> bool:
    """Whether this W4Weight takes our AVX2 kernel (kernels/q4_native.py): one on this CPU, whole
    groups of 32 inputs, no act-order permutation."""
    return (w.qweight.device.type == "cpu" and w.perm is None and w.group_size % q4_native.QK == 0
            and w.in_features % w.group_size == 0 and q4_native.available())


def repack_for_cpu(w) -> CpuInt4Weight:
    """W4Weight (kernels.w4a16_pack) -> CpuInt4Weight, for our AVX2 kernel where it fits
    (native_fits), else torch's int4 kernel. One-time, at load."""
    from homelab_llm.engine.kernels.w4a16_pack import unpack_int4

    q_nk = unpack_int4(w.qweight, dim=0).t().contiguous().to(torch.int32)  # [N, K] 0..15
    if native_fits(w):
        per_block = w.group_size // q4_native.QK
        scales = w.scales.t().repeat_interleave(per_block, dim=1)  # [N, K / 32], fp16 values
        offsets = w.biases.t().repeat_interleave(per_block, dim=1)
        native = q4_native.pack_q4(q_nk, scales, offsets)
        return CpuInt4Weight(None, None, w.group_size, w.in_features, w.out_features, None,
                             native=native)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q_nk, 1)
    scales = w.scales.float()
    zeros = w.biases.float() + 8.0 * scales  # exact in fp32: both are fp16 values
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).to(torch.bfloat16).contiguous()
    return CpuInt4Weight(packed, scales_and_zeros, w.group_size, w.in_features, w.out_features,
                         w.perm)


def dequantize_dense(w, dtype: torch.dtype) -> torch.Tensor:
    """W4Weight -> [K, N] in dtype (bf16 or fp32), in the kernel's (possibly act-order permuted)
    input order."""
    from homelab_llm.engine.kernels.w4a16_pack import unpack_int4

    k, n, g = w.in_features, w.out_features, w.group_size
    q = unpack_int4(w.qweight, dim=0).view(k // g, g, n).float()
    # fp32, rounded once: q * scale + bias cancels (symmetric: bias = -8 * scale), and rounding
    # scale and bias to bf16 first would leave errors large against the small results.
    w_kn = torch.addcmul(w.biases.float().unsqueeze(1), q, w.scales.float().unsqueeze(1))
    return w_kn.view(k, n).to(dtype)


def w4a16_matmul_cpu_rows(x: torch.Tensor, w) -> torch.Tensor:
    """x [..., K] @ W4Weight with a CPU pack, in x's dtype: the pack's kernel for few rows, a
    GEMM on the dense (DENSE_DTYPE) weight from DENSE_ROWS rows on (with our AVX2 kernel: from
    NATIVE_ROWS on, and only where the dense copy is kept)."""
    pack = w.cpu_pack
    many = DENSE_ROWS
    rows = x.numel() // max(x.shape[-1], 1)
    if pack.native is not None:
        if rows < NATIVE_ROWS or pack.dense is None:
            return q4_native.matmul(x, pack.native)
    elif x.dim() == 2 and pack.perm is None and 0 < rows < many and x.shape[1] == pack.in_features:
        # Decode's shape, once per linear per token: the fewest ops (no reshapes, no checks that
        # cannot fail here); ~1 us of dispatch each is a visible share of a 135M model's step.
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16).contiguous(), pack.packed, pack.group_size, pack.scales_and_zeros)
        return out.to(x.dtype)
    elif rows < many:
        return w4a16_matmul_cpu(x, pack)
    x2 = x.reshape(-1, w.in_features)
    if w.perm is not None:
        x2 = x2[:, w.perm]
    dense = pack.dense if pack.dense is not None else dequantize_dense(w, DENSE_DTYPE)
    out = torch.mm(x2.to(dense.dtype), dense)
    return out.to(x.dtype).view(*x.shape[:-1], w.out_features)


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
    if w.native is not None:
        return q4_native.matmul(x2, w.native).view(*lead, w.out_features)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x2.to(torch.bfloat16).contiguous(), w.packed, w.group_size, w.scales_and_zeros)
    return out.to(x.dtype).view(*lead, w.out_features)
