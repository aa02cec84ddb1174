"""The previous sampler (one program per row), kept only so kernels_bench.py can time old vs new.

Token sampling on the device: temperature, top-k, top-p, min-p and greedy, one program per row,
no sort and no host sync.

Filters become thresholds on the row's scaled logits. The top-k and top-p thresholds are found by
bisection over the float's bit pattern mapped to an order-preserving int32 key: 32 passes over the
row pin the exact boundary (a float bisection could not separate neighbouring values). The draw
is an exponential race, argmax(s_i - log E_i) with E_i ~ Exp(1) from Philox keyed by (row seed,
vocab index, step), so a request's seed reproduces its tokens in any batch and the runner only
needs to bump `steps` each decode step. Rows without top-k/top-p cost two passes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.common import next_pow2
from homelab_llm.engine.kernels.tuning import tiles_for


@triton.jit
def _order_key(s):
    bits = s.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _sample_kernel(
    logits_ptr, out_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, step_ptr, noise_ptr,
    V, stride_l, stride_n,
    BLOCK_V: tl.constexpr, HAS_NOISE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_l
    temperature = tl.load(temp_ptr + row)

    # Pass 1: max and first argmax of the raw logits.
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_V], tl.int32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        better = x > best
        best = tl.where(better, x, best)
        best_idx = tl.where(better, offs, best_idx)
    x_max = tl.max(best, axis=0)
    greedy_idx = tl.min(tl.where(best == x_max, best_idx, 2147483647), axis=0)
    if temperature <= 0.0:
        tl.store(out_ptr + row, greedy_idx.to(tl.int64))
        return

    t_vec = tl.full([BLOCK_V], 1.0, tl.float32) * temperature
    s_max = tl.math.div_rn(x_max, temperature)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)

    # Top-k: the smallest key t with count(key > t) < k; keep key >= t.
    keep_key = tl.full([], -2147483648, tl.int64)
    if (top_k > 0) & (top_k < V):
        lo = tl.full([], -2147483648, tl.int64)
        hi = _order_key(s_max).to(tl.int64)
        for _ in range(32):
            mid = (lo + hi) >> 1
            count = tl.zeros([BLOCK_V], tl.int32)
            for v0 in range(0, V, BLOCK_V):
                offs = v0 + tl.arange(0, BLOCK_V)
                x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
                key = _order_key(tl.math.div_rn(x, t_vec)).to(tl.int64)
                count += ((key > mid) & (offs < V)).to(tl.int32)
            ok = tl.sum(count, axis=0) < top_k
            hi = tl.where(ok, mid, hi)
            lo = tl.where(ok, lo, mid + 1)
        keep_key = lo

    # Top-p over what top-k kept: the smallest key t with mass(key > t) <= top_p * total.
    if top_p < 1.0:
        total = tl.zeros([BLOCK_V], tl.float32)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            s = tl.math.div_rn(x, t_vec)
            kept = _order_key(s).to(tl.int64) >= keep_key
            total += tl.where(kept & (offs < V), tl.exp(s - s_max), 0.0)
        budget = top_p * tl.sum(total, axis=0)
        lo = keep_key
        hi = _order_key(s_max).to(tl.int64)
        for _ in range(32):
            mid = (lo + hi) >> 1
            mass = tl.zeros([BLOCK_V], tl.float32)
            for v0 in range(0, V, BLOCK_V):
                offs = v0 + tl.arange(0, BLOCK_V)
                x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
                s = tl.math.div_rn(x, t_vec)
                key = _order_key(s).to(tl.int64)
                mass += tl.where((key > mid) & (key >= keep_key) & (offs < V), tl.exp(s - s_max), 0.0)
            ok = tl.sum(mass, axis=0) <= budget
            hi = tl.where(ok, mid, hi)
            lo = tl.where(ok, lo, mid + 1)
        keep_key = lo

    min_s = tl.where(min_p > 0.0, s_max + tl.log(tl.maximum(min_p, 1e-30)), float("-inf"))

    # Final pass: exponential race among the kept tokens.
    seed = tl.load(seed_ptr + row)
    step = tl.load(step_ptr + row)
    step_lo = (step & 0xFFFFFFFF).to(tl.uint32)
    step_hi = ((step >> 32) & 0xFFFFFFFF).to(tl.uint32)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_V], tl.int32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        valid = offs < V
        x = tl.load(base + offs, mask=valid, other=float("-inf")).to(tl.float32)
        s = tl.math.div_rn(x, t_vec)
        kept = valid & (_order_key(s).to(tl.int64) >= keep_key) & (s >= min_s)
        if HAS_NOISE:
            e = tl.load(noise_ptr + row * stride_n + offs, mask=valid, other=1.0).to(tl.float32)
        else:
            c0 = offs.to(tl.uint32)
            zero = tl.zeros([BLOCK_V], tl.uint32)
            r, _, _, _ = tl.philox(seed, c0, zero + step_lo, zero + step_hi, zero)
            u = tl.uint_to_uniform_float(r)
            e = -tl.log(tl.maximum(u, 1e-20))
        score = tl.where(kept, s - tl.log(e), float("-inf"))
        better = score > best
        best = tl.where(better, score, best)
        best_idx = tl.where(better, offs, best_idx)
    top = tl.max(best, axis=0)
    token = tl.min(tl.where(best == top, best_idx, 2147483647), axis=0)
    token = tl.where(top == float("-inf"), greedy_idx, token)  # nothing survived: fall back to argmax
    tl.store(out_ptr + row, token.to(tl.int64))


def sample(
    logits: torch.Tensor,  # [B, V] float (any float dtype)
    temperature: torch.Tensor,  # [B] float32; 0 = greedy
    top_k: torch.Tensor,  # [B] int32; <= 0 = off
    top_p: torch.Tensor,  # [B] float32; >= 1 = off
    min_p: torch.Tensor,  # [B] float32; <= 0 = off
    seeds: torch.Tensor,  # [B] int64, one per request
    steps: torch.Tensor,  # [B] int64, the request's decode step: new noise each token
    exponentials: torch.Tensor | None = None,  # [B, V] Exp(1) noise to use instead (tests)
) -> torch.Tensor:
    """Token ids [B] int64 on logits' device."""
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block = min(4096, next_pow2(vocab))
    noise = exponentials if exponentials is not None else logits
    _sample_kernel[(batch,)](
        logits, out, temperature.float(), top_k.to(torch.int32), top_p.float(), min_p.float(),
        seeds.to(torch.int64), steps.to(torch.int64), noise,
        vocab, logits.stride(0), noise.stride(0),
        BLOCK_V=block, HAS_NOISE=exponentials is not None,
        num_warps=tiles_for(logits.device).elementwise_warps,
    )
    return out
