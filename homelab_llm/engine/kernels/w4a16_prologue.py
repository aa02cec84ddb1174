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
def input_parts(x_ptr, res_ptr, rows, k, ok, stride_xm, stride_rm, RESIDUAL: tl.constexpr):
    """The loads of summed_input, no math on them yet: (x, residual) at rows x k as stored
    (residual: x again without RESIDUAL); masked-off values are 0."""
    x = tl.load(x_ptr + rows * stride_xm + k, mask=ok, other=0.0)
    r = tl.load(res_ptr + rows * stride_rm + k, mask=ok, other=0.0) if RESIDUAL else x
    return x, r


@triton.jit
def summed_parts(x, r, RESIDUAL: tl.constexpr):
    """input_parts' values summed: x (or x + residual rounded to x's dtype), fp32."""
    if RESIDUAL:
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def summed_input(x_ptr, res_ptr, rows, k, ok, stride_xm, stride_rm, RESIDUAL: tl.constexpr):
    """x (or x + residual rounded to x's dtype) at rows x k, fp32; masked-off values are 0."""
    x, r = input_parts(x_ptr, res_ptr, rows, k, ok, stride_xm, stride_rm, RESIDUAL)
    return summed_parts(x, r, RESIDUAL)


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
def row_parts(x_ptr, res_ptr, M, K, stride_xm, stride_rm, BLOCK_M: tl.constexpr,
              CHUNK: tl.constexpr, RESIDUAL: tl.constexpr):
    """row_rstd's loads alone, for a row that fits one trip (CHUNK >= K): a caller can issue
    other loads after them before rstd_of_parts waits for them."""
    rows = tl.minimum(tl.arange(0, BLOCK_M), M - 1)[:, None].to(tl.int64)
    k = tl.arange(0, CHUNK)[None, :]
    return input_parts(x_ptr, res_ptr, rows, k, k < K, stride_xm, stride_rm, RESIDUAL)


@triton.jit
def rstd_of_parts(x, r, K, eps, RESIDUAL: tl.constexpr):
    """row_rstd from row_parts' values (the same arithmetic as row_rstd's one trip)."""
    s = summed_parts(x, r, RESIDUAL)
    return tl.math.rsqrt(tl.sum(s * s, axis=1) / K + eps)


@triton.jit
def input_loads(x_ptr, res_ptr, nw_ptr, rows, k, ok, K, stride_xm, stride_rm, NORM: tl.constexpr,
                RESIDUAL: tl.constexpr, ACT_IN: tl.constexpr):
    """load_input's loads, no math on them yet: (a, b, w) as stored -- ACT_IN: gate, up; else x,
    the residual (x again without RESIDUAL) and with NORM the norm weight (x again without)."""
    if ACT_IN:
        a = tl.load(x_ptr + rows * stride_xm + k, mask=ok, other=0.0)
        return a, tl.load(x_ptr + rows * stride_xm + K + k, mask=ok, other=0.0), a
    a, b = input_parts(x_ptr, res_ptr, rows, k, ok, stride_xm, stride_rm, RESIDUAL)
    w = tl.load(nw_ptr + k, mask=ok, other=0.0) if NORM else a
    return a, b, w


@triton.jit
def input_from_loads(a, b, w, sum_ptr, normed_ptr, rows, k, ok, stride_sm, rstd, sum_limit,
                     NORM: tl.constexpr, RESIDUAL: tl.constexpr, ACT_IN: tl.constexpr,
                     NORM_OUT: tl.constexpr):
    """load_input's value from input_loads' (and its stores)."""
    dt = a.dtype
    if ACT_IN:
        gate = a.to(tl.float32)
        up = b.to(tl.float32)
        if ACT_IN == 2:
            return (gate_act(gate, True).to(dt).to(tl.float32) * up).to(dt).to(tl.float32)
        return (gate_act(gate, False) * up).to(dt).to(tl.float32)
    s = summed_parts(a, b, RESIDUAL)
    if NORM:
        if RESIDUAL:
            tl.store(sum_ptr + rows * stride_sm + k, s.to(dt), mask=ok & (k < sum_limit))
        y = (s * rstd * w.to(tl.float32)).to(dt)
        if NORM_OUT:
            tl.store(normed_ptr + rows * stride_sm + k, y, mask=ok & (k < sum_limit))
        return y.to(tl.float32)
    return s


@triton.jit
def load_input(x_ptr, res_ptr, nw_ptr, sum_ptr, normed_ptr, rows, k, ok, K, stride_xm,
               stride_rm, stride_sm, rstd, sum_limit, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
               ACT_IN: tl.constexpr, NORM_OUT: tl.constexpr = False):
    """The GEMV's input at rows x k (any broadcastable shapes; rows int64, rstd shaped like rows)
    as fp32 values of x's dtype; s is written to sum_ptr where k < sum_limit (NORM + RESIDUAL: K
    in the programs that store it, 0 in the others), and with NORM_OUT the normalized input to
    normed_ptr there too (for other linears that read the same norm; sum_ptr's strides)."""
    a, b, w = input_loads(x_ptr, res_ptr, nw_ptr, rows, k, ok, K, stride_xm, stride_rm, NORM,
                          RESIDUAL, ACT_IN)
    return input_from_loads(a, b, w, sum_ptr, normed_ptr, rows, k, ok, stride_sm, rstd, sum_limit,
                            NORM, RESIDUAL, ACT_IN, NORM_OUT)
