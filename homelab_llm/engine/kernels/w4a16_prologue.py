"""The activation forms a packed-half W4A16 GEMV (w4a16_h2.py) reads in its prologue, so the small
kernels around a decoder's linears fold into the GEMV that consumes their output.

Why (issue 19): a W4A16 batch-1 step of Llama-3.1-8B launched 65 RMSNorms and 32 SiLU-and-muls
beside its 128 GEMVs (docs/BENCHMARKS.md 14.3), each a few microseconds of latency for a few KB.

Forms, by constexpr switches of `load_input` (values of x at K positions k, fp32):
  plain     x
  NORM      RMSNorm(s) * norm_weight with s = x, or with RESIDUAL s = x + residual rounded to x's
            dtype (and stored to `summed` by the programs told to, for the next layer's residual)
  ACT_IN    act(gate) * up of a merged [gate | up] row (x's rows hold 2K values): 1 SiLU,
            2 GELU-tanh (Gemma; ACT_CODES)
Each value is rounded to x's dtype exactly where the separate kernels round (their sums in
fp32, then one rounding of the result; GELU-and-mul's torch ops also round gelu(gate)), with the
same formulas as elementwise._rms_norm_kernel and _silu_and_mul_kernel, so the GEMV sees the
inputs those kernels would have stored; only the norm's sum of squares is taken in another
order (a rounding of rsqrt apart at most).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.common import next_pow2
from homelab_llm.engine.kernels.elementwise import gate_act

ACT_CODES = {None: 0, "silu": 1, "gelu_tanh": 2}  # act_in -> ACT_IN
NORM_ELEMS = 8192  # row values one norm trip loads (x and residual: 64 registers a thread at 4 warps)


def norm_chunk(k: int, block_m: int) -> int:
    """row_rstd's CHUNK: all of K in one trip where BLOCK_M rows of it fit NORM_ELEMS."""
    return min(next_pow2(k), max(256, NORM_ELEMS // block_m))


@triton.jit
def summed_input(x_ptr, res_ptr, rows, k, ok, stride_xm, stride_rm, RESIDUAL: tl.constexpr):
    """x (or x + residual rounded to x's dtype) at rows x k, fp32; masked-off values are 0."""
    x = tl.load(x_ptr + rows * stride_xm + k, mask=ok, other=0.0)
    if RESIDUAL:
        r = tl.load(res_ptr + rows * stride_rm + k, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return x.to(tl.float32)


@triton.jit
def row_rstd(x_ptr, res_ptr, M, K, eps, stride_xm, stride_rm, BLOCK_M: tl.constexpr,
             CHUNK: tl.constexpr, RESIDUAL: tl.constexpr):
    """1 / rms of each row's summed input over all K: [BLOCK_M] fp32 (the norm's scale; every
    program reads the whole row, a few KB from L2). CHUNK should cover K in one trip (NORM_CHUNK):
    a loop trip waits out an L2 round trip, and eight of them cost a 4096-wide row ~5 us a call
    (docs/BENCHMARKS.md 14.4); the program's own range then re-reads from L1."""
    rows = tl.minimum(tl.arange(0, BLOCK_M), M - 1)[:, None].to(tl.int64)
    sq = tl.zeros([BLOCK_M], tl.float32)
    for c0 in range(0, K, CHUNK):
        k = c0 + tl.arange(0, CHUNK)[None, :]
        s = summed_input(x_ptr, res_ptr, rows, k, k < K, stride_xm, stride_rm, RESIDUAL)
        sq += tl.sum(s * s, axis=1)
    return tl.math.rsqrt(sq / K + eps)


@triton.jit
def load_input(x_ptr, res_ptr, nw_ptr, sum_ptr, normed_ptr, rows, k, ok, K, stride_xm,
               stride_rm, stride_sm, rstd, sum_limit, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
               ACT_IN: tl.constexpr, NORM_OUT: tl.constexpr = False):
    """The GEMV's input at rows x k (any broadcastable shapes; rows int64, rstd shaped like rows)
    as fp32 values of x's dtype; s is written to sum_ptr where k < sum_limit (NORM + RESIDUAL: K
    in the programs that store it, 0 in the others), and with NORM_OUT the normalized input to
    normed_ptr there too (for other linears that read the same norm; sum_ptr's strides)."""
    dt = x_ptr.dtype.element_ty
    if ACT_IN:
        gate = tl.load(x_ptr + rows * stride_xm + k, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + rows * stride_xm + K + k, mask=ok, other=0.0).to(tl.float32)
        if ACT_IN == 2:
            return (gate_act(gate, True).to(dt).to(tl.float32) * up).to(dt).to(tl.float32)
        return (gate_act(gate, False) * up).to(dt).to(tl.float32)
    s = summed_input(x_ptr, res_ptr, rows, k, ok, stride_xm, stride_rm, RESIDUAL)
    if NORM:
        if RESIDUAL:
            tl.store(sum_ptr + rows * stride_sm + k, s.to(dt), mask=ok & (k < sum_limit))
        w = tl.load(nw_ptr + k, mask=ok, other=0.0).to(tl.float32)
        y = (s * rstd * w).to(dt)
        if NORM_OUT:
            tl.store(normed_ptr + rows * stride_sm + k, y, mask=ok & (k < sum_limit))
        return y.to(tl.float32)
    return s


@dataclass(frozen=True)
class InputForm:
    """A W4A16 launch's prologue operands (unused ones point at x), its epsilon and switches
    (NORM, RESIDUAL, ACT_IN, NORM_OUT)."""

    res: torch.Tensor
    nw: torch.Tensor
    sums: torch.Tensor
    normed: torch.Tensor
    eps: float
    meta: dict

    @property
    def formed(self) -> bool:
        """Whether the kernel forms its input (a norm or an activation) rather than reading x."""
        return bool(self.meta["NORM"] or self.meta["ACT_IN"])


def input_form(name: str, x2: torch.Tensor, k: int, norm_weight: torch.Tensor | None, eps: float,
               residual: torch.Tensor | None, summed: torch.Tensor | None, act_in: str | None,
               normed: torch.Tensor | None) -> InputForm:
    """Check a W4A16 kernel's prologue arguments (w4a16_h2.w4a16_h2's docstring says what each
    means) against x2 [M, K] (or [M, 2K] with act_in) and K; a ValueError names `name`."""
    if act_in not in ACT_CODES:
        raise ValueError(f"{name}: act_in {act_in!r}, expected one of {list(ACT_CODES)}")
    if x2.shape[1] != (2 * k if act_in else k) or (residual is not None) != (summed is not None) \
            or (residual is not None and norm_weight is None) or (act_in and norm_weight is not None):
        raise ValueError(f"{name}: x {tuple(x2.shape)} for K {k} with norm "
                         f"{norm_weight is not None}, residual {residual is not None}, summed "
                         f"{summed is not None}, act_in {act_in}")
    if summed is not None and summed.data_ptr() in (x2.data_ptr(), residual.data_ptr()):
        raise ValueError(f"{name}: summed must not alias x or residual (other programs read them)")
    if normed is not None:
        read = {x2.data_ptr()} | ({residual.data_ptr()} if residual is not None else set())
        if norm_weight is None or normed.shape != x2.shape or normed.data_ptr() in read \
                or (summed is not None and normed.stride() != summed.stride()):
            raise ValueError(f"{name}: normed takes a new [M, K] tensor (strided as summed) "
                             "and a norm")
    res = residual if residual is not None else x2
    sums = summed if summed is not None else (normed if normed is not None else x2)
    return InputForm(res, norm_weight if norm_weight is not None else x2, sums,
                     normed if normed is not None else x2, float(eps),
                     dict(NORM=norm_weight is not None, RESIDUAL=residual is not None,
                          ACT_IN=ACT_CODES[act_in], NORM_OUT=normed is not None))
