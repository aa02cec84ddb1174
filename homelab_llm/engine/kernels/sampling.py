"""Token sampling on the device: temperature, top-k, top-p, min-p and greedy, no sort, no host sync.

Every kernel splits each row's vocab into chunks, one program per (row, chunk), so a single row
still spreads over the whole GPU (one program per row made a batch-1 greedy step cost 121 us on
an H200). Chunk results are merged in a fixed order, so the result is deterministic.

  1. stats: each chunk's max logit and its first argmax.
  2. threshold search (only if some row uses top-k / top-p): filters become thresholds on an
     order-preserving int32 key of the scaled logit. Each pass counts (top-k) or sums probability
     mass (top-p) above NUM_PROBES probe keys spread over the row's current interval, and the next
     pass narrows the interval to the probe gap that holds the boundary: 32 probes cut 2^32 keys
     to one in 7 passes, each a single launch (the narrowing step is recomputed by every program
     from the previous pass's per-chunk partials, so no extra reduce launch is needed).
  3. race: argmax(s_i - log E_i) over kept tokens, E_i ~ Exp(1) from Philox keyed by (row seed,
     vocab index, step): a request's seed reproduces its tokens in any batch.
  4. final: merge the chunks (greedy rows take the argmax).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.common import next_pow2
from homelab_llm.engine.kernels.pdl import pdl_args, pdl_enter
from homelab_llm.engine.kernels.tuning import device_sms, interpreting, tiles_for

NUM_PROBES = 32
_NO_TOKEN = 2147483647
_KEY_MIN = -2147483648


def _search_passes(probes: int) -> int:
    """Passes until a 2^32-wide key interval is one key: each pass leaves ceil(w / probes) - 1."""
    width, passes = 2**32 - 1, 0
    while width > 0:
        width = -(-width // probes) - 1
        passes += 1
    return passes


SEARCH_PASSES = _search_passes(NUM_PROBES)


@dataclass(frozen=True)
class SampleModes:
    """What the batch needs, known on the host (the sampler builds its parameters from lists)."""

    any_random: bool  # some row has temperature > 0
    any_top_k: bool  # ... and 0 < top_k < vocab
    any_top_p: bool  # ... and top_p < 1

    @staticmethod
    def of(temperature: list[float], top_k: list[int], top_p: list[float], vocab: int) -> "SampleModes":
        rows = [i for i, t in enumerate(temperature) if t > 0]
        return SampleModes(bool(rows), any(0 < top_k[i] < vocab for i in rows),
                           any(top_p[i] < 1.0 for i in rows))


@triton.jit
def _order_key(s):
    bits = s.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _keep_best(x, offs, best, best_idx):
    """Running per-lane maximum and its index (the first index on ties)."""
    better = x > best
    return tl.where(better, x, best), tl.where(better, offs, best_idx)


@triton.jit
def _store_chunk_best(best, best_idx, value_ptr, index_ptr, slot):
    """A chunk's maximum and its lowest index among equal maxima."""
    top = tl.max(best, axis=0)
    tl.store(value_ptr + slot, top)
    tl.store(index_ptr + slot, tl.min(tl.where(best == top, best_idx, 2147483647), axis=0))


@triton.jit
def _row_max(part_max_ptr, row, NUM_CHUNKS: tl.constexpr):
    return tl.max(tl.load(part_max_ptr + row * NUM_CHUNKS + tl.arange(0, NUM_CHUNKS)), axis=0)


@triton.jit
def _stats_kernel(logits_ptr, part_max_ptr, part_idx_ptr, V, stride_l, CHUNK,
                  NUM_CHUNKS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    base = logits_ptr + row * stride_l
    start = chunk * CHUNK
    end = tl.minimum(start + CHUNK, V)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], 2147483647, tl.int32)
    for v0 in range(start, end, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < end, other=float("-inf")).to(tl.float32)
        best, best_idx = _keep_best(x, offs, best, best_idx)
    _store_chunk_best(best, best_idx, part_max_ptr, part_idx_ptr, row * NUM_CHUNKS + chunk)


_KEY_MIN_I64 = tl.constexpr(-(2**62))


@triton.jit
def _probe_keys(lo, hi, NUM_PROBES: tl.constexpr):
    j = tl.arange(0, NUM_PROBES).to(tl.int64)
    return lo + (j * (hi - lo)) // NUM_PROBES


@triton.jit
def _narrow(lo, hi, stats_ptr, target, row, NUM_CHUNKS: tl.constexpr, NUM_PROBES: tl.constexpr):
    """The boundary's key interval after one pass: stats [NUM_CHUNKS, NUM_PROBES] per row hold the
    count (or mass) above each probe; the answer is the smallest key whose value is <= target."""
    if lo < hi:
        offs_c = tl.arange(0, NUM_CHUNKS)
        offs_j = tl.arange(0, NUM_PROBES)
        stats = tl.load(stats_ptr + (row * NUM_CHUNKS + offs_c)[:, None] * NUM_PROBES + offs_j[None, :])
        above = tl.sum(stats, axis=0)
        probes = _probe_keys(lo, hi, NUM_PROBES)
        ok = above <= target
        first = tl.min(tl.where(ok, offs_j, NUM_PROBES), axis=0)
        prev = tl.max(tl.where(offs_j == first - 1, probes, _KEY_MIN_I64), axis=0)
        at = tl.max(tl.where(offs_j == first, probes, _KEY_MIN_I64), axis=0)
        last = tl.max(probes, axis=0)
        new_lo = tl.where(first == 0, lo, tl.where(first == NUM_PROBES, last + 1, prev + 1))
        new_hi = tl.where(first == NUM_PROBES, hi, at)
        lo, hi = new_lo, new_hi
    return lo, hi


@triton.jit
def _row_setup(temp_ptr, top_k_ptr, top_p_ptr, part_max_ptr, row, V, NUM_CHUNKS: tl.constexpr):
    temperature = tl.load(temp_ptr + row)
    t = tl.where(temperature > 0.0, temperature, 1.0)
    s_max = tl.math.div_rn(_row_max(part_max_ptr, row, NUM_CHUNKS), t)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    return temperature, t, s_max, (top_k > 0) & (top_k < V), top_k, top_p < 1.0, top_p


@triton.jit
def _search_state(state_ptr, stats_ptr, total_ptr, pass_idx, row, top_k, top_p, k_on, p_on, s_max,
                  P_PASSES: tl.constexpr, K_PASSES: tl.constexpr,
                  NUM_CHUNKS: tl.constexpr, NUM_PROBES: tl.constexpr):
    """(lo, hi, keep_key) at the start of pass `pass_idx` (K_PASSES top-k passes, then P_PASSES
    top-p passes; pass_idx == K_PASSES + P_PASSES gives the final state)."""
    s_key = _order_key(s_max).to(tl.int64)
    if pass_idx == 0:
        lo = tl.full([], -2147483648, tl.int64)
        hi = tl.where(k_on, s_key, lo)
        keep = tl.full([], -2147483648, tl.int64)
    else:
        prev = state_ptr + ((pass_idx - 1) * tl.num_programs(0) + row) * 3
        lo = tl.load(prev)
        hi = tl.load(prev + 1)
        keep = tl.load(prev + 2)
        prev_stats = stats_ptr + (pass_idx - 1) * tl.num_programs(0) * NUM_CHUNKS * NUM_PROBES
        if pass_idx <= K_PASSES:
            lo, hi = _narrow(lo, hi, prev_stats, (top_k - 1).to(tl.float32), row, NUM_CHUNKS,
                             NUM_PROBES)
        else:
            total = tl.sum(tl.load(total_ptr + row * NUM_CHUNKS + tl.arange(0, NUM_CHUNKS)), axis=0)
            lo, hi = _narrow(lo, hi, prev_stats, top_p * total, row, NUM_CHUNKS, NUM_PROBES)
    if pass_idx == K_PASSES:  # top-k done (or never run): top-p searches above its threshold
        keep = tl.where(k_on, lo, keep)
        lo = keep
        hi = keep
        if P_PASSES > 0:
            hi = tl.where(p_on, s_key, keep)
    if pass_idx == K_PASSES + P_PASSES:
        keep = lo
    return lo, hi, keep


@triton.jit
def _search_pass_kernel(
    logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, part_max_ptr, state_ptr, stats_ptr, total_ptr,
    pass_idx, V, stride_l, CHUNK,
    K_PASSES: tl.constexpr, P_PASSES: tl.constexpr, TOP_P: tl.constexpr,
    NUM_CHUNKS: tl.constexpr, NUM_PROBES: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature, t, s_max, k_on, top_k, p_on, top_p = _row_setup(
        temp_ptr, top_k_ptr, top_p_ptr, part_max_ptr, row, V, NUM_CHUNKS)
    lo, hi, keep = _search_state(state_ptr, stats_ptr, total_ptr, pass_idx, row, top_k, top_p, k_on,
                                 p_on, s_max, P_PASSES, K_PASSES, NUM_CHUNKS, NUM_PROBES)
    if chunk == 0:
        state = state_ptr + (pass_idx * tl.num_programs(0) + row) * 3
        tl.store(state, lo)
        tl.store(state + 1, hi)
        tl.store(state + 2, keep)
    if (temperature > 0.0) & (lo < hi):
        probes = _probe_keys(lo, hi, NUM_PROBES).to(tl.int32)
        base = logits_ptr + row * stride_l
        start = chunk * CHUNK
        end = tl.minimum(start + CHUNK, V)
        t_vec = tl.full([BLOCK], 1.0, tl.float32) * t
        above = tl.zeros([NUM_PROBES], tl.float32)
        total = tl.zeros([BLOCK], tl.float32)
        for v0 in range(start, end, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            valid = offs < end
            x = tl.load(base + offs, mask=valid, other=float("-inf")).to(tl.float32)
            s = tl.math.div_rn(x, t_vec)
            key = _order_key(s)
            if TOP_P:
                w = tl.where(valid & (key.to(tl.int64) >= keep), tl.exp(s - s_max), 0.0)
                total += w
            else:
                w = valid.to(tl.float32)
            hit = key[:, None] > probes[None, :]
            above += tl.sum(tl.where(hit, w[:, None], 0.0), axis=0)
        out = stats_ptr + ((pass_idx * tl.num_programs(0) + row) * NUM_CHUNKS + chunk) * NUM_PROBES
        tl.store(out + tl.arange(0, NUM_PROBES), above)
        if TOP_P:
            if pass_idx == K_PASSES:
                tl.store(total_ptr + row * NUM_CHUNKS + chunk, tl.sum(total, axis=0))


@triton.jit
def _race_kernel(
    logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, step_ptr, noise_ptr,
    part_max_ptr, state_ptr, stats_ptr, total_ptr, part_score_ptr, part_tok_ptr,
    V, stride_l, stride_n, CHUNK,
    K_PASSES: tl.constexpr, P_PASSES: tl.constexpr,
    NUM_CHUNKS: tl.constexpr, NUM_PROBES: tl.constexpr, BLOCK: tl.constexpr, HAS_NOISE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature, t, s_max, k_on, top_k, p_on, top_p = _row_setup(
        temp_ptr, top_k_ptr, top_p_ptr, part_max_ptr, row, V, NUM_CHUNKS)
    if temperature > 0.0:
        _, _, keep = _search_state(state_ptr, stats_ptr, total_ptr, K_PASSES + P_PASSES, row, top_k,
                                   top_p, k_on, p_on, s_max, P_PASSES, K_PASSES, NUM_CHUNKS,
                                   NUM_PROBES)
        min_p = tl.load(min_p_ptr + row)
        min_s = tl.where(min_p > 0.0, s_max + tl.log(tl.maximum(min_p, 1e-30)), float("-inf"))
        seed = tl.load(seed_ptr + row)
        step = tl.load(step_ptr + row)
        step_lo = (step & 0xFFFFFFFF).to(tl.uint32)
        step_hi = ((step >> 32) & 0xFFFFFFFF).to(tl.uint32)
        base = logits_ptr + row * stride_l
        start = chunk * CHUNK
        end = tl.minimum(start + CHUNK, V)
        t_vec = tl.full([BLOCK], 1.0, tl.float32) * t
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_idx = tl.full([BLOCK], 2147483647, tl.int32)
        for v0 in range(start, end, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            valid = offs < end
            x = tl.load(base + offs, mask=valid, other=float("-inf")).to(tl.float32)
            s = tl.math.div_rn(x, t_vec)
            kept = valid & (_order_key(s).to(tl.int64) >= keep) & (s >= min_s)
            if HAS_NOISE:
                e = tl.load(noise_ptr + row * stride_n + offs, mask=valid, other=1.0).to(tl.float32)
            else:
                c0 = offs.to(tl.uint32)
                zero = tl.zeros([BLOCK], tl.uint32)
                r, _r1, _r2, _r3 = tl.philox(seed, c0, zero + step_lo, zero + step_hi, zero)
                u = tl.uint_to_uniform_float(r)
                e = -tl.log(tl.maximum(u, 1e-20))
            score = tl.where(kept, s - tl.log(e), float("-inf"))
            best, best_idx = _keep_best(score, offs, best, best_idx)
        _store_chunk_best(best, best_idx, part_score_ptr, part_tok_ptr, row * NUM_CHUNKS + chunk)


@triton.jit
def _final_kernel(temp_ptr, part_max_ptr, part_idx_ptr, part_score_ptr, part_tok_ptr, out_ptr,
                  NUM_CHUNKS: tl.constexpr, RACE: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = row * NUM_CHUNKS + tl.arange(0, NUM_CHUNKS)
    maxes = tl.load(part_max_ptr + offs)
    x_max = tl.max(maxes, axis=0)
    token = tl.min(tl.where(maxes == x_max, tl.load(part_idx_ptr + offs), 2147483647), axis=0)
    token = tl.where(token == 2147483647, 0, token)  # an all -inf row: index 0, like torch.argmax
    if RACE:
        if tl.load(temp_ptr + row) > 0.0:
            scores = tl.load(part_score_ptr + offs)
            top = tl.max(scores, axis=0)
            drawn = tl.min(tl.where(scores == top, tl.load(part_tok_ptr + offs), 2147483647), axis=0)
            token = tl.where(top == float("-inf"), token, drawn)  # nothing survived: argmax
    tl.store(out_ptr + row, token.to(tl.int64))


def _chunks(batch: int, vocab: int, block: int, device: torch.device) -> tuple[int, int]:
    """(chunks per row, chunk length): about four programs per SM over the batch, a power of two
    (the merges load all chunks of a row as one vector), each chunk a whole number of blocks."""
    want = max(1, 4 * device_sms(device) // batch)
    chunks = min(next_pow2(want), next_pow2(triton.cdiv(vocab, block)))
    chunk_len = triton.cdiv(triton.cdiv(vocab, chunks), block) * block
    return chunks, chunk_len


def sample(
    logits: torch.Tensor,  # [B, V] float (any float dtype)
    temperature: torch.Tensor,  # [B] float32; 0 = greedy
    top_k: torch.Tensor,  # [B] int32; <= 0 = off
    top_p: torch.Tensor,  # [B] float32; >= 1 = off
    min_p: torch.Tensor,  # [B] float32; <= 0 = off
    seeds: torch.Tensor,  # [B] int64, one per request
    steps: torch.Tensor,  # [B] int64, the request's decode step: new noise each token
    exponentials: torch.Tensor | None = None,  # [B, V] Exp(1) noise to use instead (tests)
    modes: SampleModes | None = None,  # which filters the batch uses; None = assume all
) -> torch.Tensor:
    """Token ids [B] int64 on logits' device. Without `modes` every search pass is launched (rows
    that need none return at once): asking the device which filters are on would make the host
    wait for the forward. Callers that hold the parameters on the host pass `SampleModes.of`."""
    batch, vocab = logits.shape
    device = logits.device
    out = torch.empty(batch, dtype=torch.int64, device=device)
    if batch == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    temperature, top_k, top_p = temperature.float(), top_k.to(torch.int32), top_p.float()
    if modes is None:
        modes = SampleModes(True, True, True)
    block = 64 if interpreting() else 1024
    chunks, chunk_len = _chunks(batch, vocab, block, device)
    warps = tiles_for(device).elementwise_warps
    grid = (batch, chunks)
    part_max = torch.empty((batch, chunks), dtype=torch.float32, device=device)
    part_idx = torch.empty((batch, chunks), dtype=torch.int32, device=device)
    _stats_kernel[grid](logits, part_max, part_idx, vocab, logits.stride(0), chunk_len,
                        NUM_CHUNKS=chunks, BLOCK=block, num_warps=warps, **pdl_args(device))
    if not modes.any_random:
        _final_kernel[(batch,)](temperature, part_max, part_idx, part_max, part_idx, out,
                                NUM_CHUNKS=chunks, RACE=False, num_warps=1, **pdl_args(device))
        return out
    k_passes = SEARCH_PASSES if modes.any_top_k else 0
    p_passes = SEARCH_PASSES if modes.any_top_p else 0
    passes = k_passes + p_passes
    state = torch.empty((max(passes, 1), batch, 3), dtype=torch.int64, device=device)
    stats = torch.empty((max(passes, 1), batch, chunks, NUM_PROBES), dtype=torch.float32, device=device)
    total = torch.empty((batch, chunks), dtype=torch.float32, device=device)
    # The probe tile is [BLOCK, NUM_PROBES]: smaller blocks keep it in registers.
    search_block = 16 if interpreting() else 256
    for pass_idx in range(passes):
        _search_pass_kernel[grid](
            logits, temperature, top_k, top_p, part_max, state, stats, total,
            pass_idx, vocab, logits.stride(0), chunk_len,
            K_PASSES=k_passes, P_PASSES=p_passes, TOP_P=pass_idx >= k_passes, NUM_CHUNKS=chunks,
            NUM_PROBES=NUM_PROBES, BLOCK=search_block, num_warps=warps, **pdl_args(device))
    noise = exponentials if exponentials is not None else logits
    part_score = torch.empty((batch, chunks), dtype=torch.float32, device=device)
    part_tok = torch.empty((batch, chunks), dtype=torch.int32, device=device)
    _race_kernel[grid](
        logits, temperature, top_k, top_p, min_p.float(), seeds.to(torch.int64), steps.to(torch.int64),
        noise, part_max, state, stats, total, part_score, part_tok,
        vocab, logits.stride(0), noise.stride(0), chunk_len,
        K_PASSES=k_passes, P_PASSES=p_passes, NUM_CHUNKS=chunks, NUM_PROBES=NUM_PROBES,
        BLOCK=block, HAS_NOISE=exponentials is not None, num_warps=warps, **pdl_args(device))
    _final_kernel[(batch,)](temperature, part_max, part_idx, part_score, part_tok, out,
                            NUM_CHUNKS=chunks, RACE=True, num_warps=1, **pdl_args(device))
    return out
