"""The MoE layer at decode sizes (T <= DECODE_MAX_TOKENS) in two launches: gate_up with
SiLU-and-mul, then down with the router-weighted combine. Reference: moe_ref.moe_experts_ref.

At batch 1-8 the layer is bound by reading the active experts' weights once, and at these sizes
by latency: a program whose K loop walks several steps waits on each step's loads in turn. So
every program here takes few K steps (tuning.MoeDecodeTiles.steps, one on GPUs) and the grid
(blocks x column blocks x K splits) is wide enough to keep all loads of the layer in flight at once.

Work split, with slots s = t * top_k + k and blocks of one expert (decode_blocks):
  launch 1, program (b, n, s): block b's slots (<= 2) through expert e's gate and up columns
    [n * BLOCK_N, +BLOCK_N), K range s; the last of the SPLIT programs of (b, n) to finish (an
    atomic ticket) sums the fp32 partials of every split at once and stores silu(gate) * up.
  launch 2, program (b, n, s): the same over down's columns, each slot's partial times its router
    weight; the last of the top_k x SPLIT programs of (token, n) to finish sums that token's
    partials -- every pick, every split -- and stores the layer's output row. No [T*K, H] buffer,
    no combine launch.
Both reductions load all partials as one tile and sum it with tl.sum: a fixed order, whichever
program finishes last, so results are deterministic (graph == eager), and the split count depends
on K alone, so a token's output does not depend on the batch it rides in. Tickets reset
themselves and nothing is read back to the host: CUDA/HIP graphs replay it.

A gated shared expert (Qwen3.5-MoE, Qwen3-Next), computed beforehand, can ride in launch 2's
final sum: out[t] += sigmoid(g x_t) * shared[t] (moe_ref.add_shared_ref), no launches of its own
for the gate product and the add.

Weights: 4-bit (moe_ref.MoeW4) or dense (w13 [E, 2I, H], w2 [E, H, I]); the dot products of
one program live in moe_decode_dot.py. 4-bit experts go to the packed-half GEMV instead where
the arch table has moe_h2 entries for both K, for up to its moe_h2_tokens tokens (8 on sm_90;
fused_moe_h2.py: the Qwen3-30B-A3B W4A16 layer at one token 19.9 -> 14.8 us on the H200, at 8
tokens 122.7 -> 57.7, docs/BENCHMARKS.md 36.2, 38.3).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.fused_moe_gemv import DECODE_MAX_TOKENS, row_mask
from homelab_llm.engine.kernels.fused_moe_h2 import moe_h2, moe_h2_route
from homelab_llm.engine.kernels.moe_align import moe_align
from homelab_llm.engine.kernels.moe_decode_dot import expert_columns, program_share, step_weights
from homelab_llm.engine.kernels.moe_ref import MoeW4, expert_shape
from homelab_llm.engine.kernels.pdl import pdl_args, pdl_enter
from homelab_llm.engine.kernels.tuning import MoeDecodeTiles, moe_decode_tiles
from homelab_llm.engine.kernels.w4a16_gemv import ticket_buffer
from homelab_llm.engine.kernels.w4a16_pack import W4Weight


@triton.jit
def _store_act(act_ptr, ws_ptr, slot, valid, offs_n, n_mask, N, split_stride, stride_act,
               SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr):
    """silu(gate) * up of one slot from the fp32 partials of all SPLIT programs, summed as one
    [SPLIT_P2, BLOCK_N] tile (a fixed order)."""
    splits = tl.arange(0, SPLIT_P2)
    at = ws_ptr + splits[:, None] * split_stride + slot * (2 * N) + offs_n[None, :]
    mask = (splits < SPLIT)[:, None] & n_mask[None, :]
    gate = tl.sum(tl.load(at, mask=mask, other=0.0, cache_modifier=".cg"), axis=0)
    up = tl.sum(tl.load(at + N, mask=mask, other=0.0, cache_modifier=".cg"), axis=0)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act_ptr + slot * stride_act + offs_n, act.to(act_ptr.dtype.element_ty),
             mask=row_mask(offs_n, n_mask, valid))


@triton.jit
def _moe_decode_up_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, act_ptr, ws_ptr, ticket_ptr, sorted_ptr, block_expert_ptr,
    num_slots, N, K, k_per_split,
    stride_x, stride_we, stride_wr, stride_se, stride_sg, stride_act,
    TOP_K: tl.constexpr, W4: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """act[slot, n] = silu(x[t] @ W_e[:, n]) * (x[t] @ W_e[:, n + N]), t = slot // TOP_K."""
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    slot0, valid0, slot1, valid1, k_start, k_end, offs_n, n_mask, w, s, b = program_share(
        sorted_ptr, block_expert_ptr, w_ptr, s_ptr, b_ptr, num_slots, N, K, k_per_split, stride_we,
        stride_se, BLOCK_M, BLOCK_N)
    up = N if W4 else N * stride_wr  # up columns (4-bit) or rows (dense) follow the gate's
    if BLOCK_M == 1:  # one slot a block: gate's and up's first steps requested outside the
        # branch, masked off for an unused block (3-4% faster on the H200 at batch 1; at two
        # slots a block the registers they hold cost 2.4% at batch 8, so there each step is
        # requested where it is used)
        used = offs_n < tl.where(valid0, N, 0)
        g_w0, g_w1, g_w2 = step_weights(w, s, b, offs_n, used, k_start, k_end, stride_wr, stride_sg,
                                        W4, GROUP_SIZE, BLOCK_K)
        u_w0, u_w1, u_w2 = step_weights(w + up, s + N, b + N, offs_n, used, k_start, k_end,
                                        stride_wr, stride_sg, W4, GROUP_SIZE, BLOCK_K)
    if valid0:  # a used block's first slot is always filled
        x0 = x_ptr + (slot0 // TOP_K) * stride_x
        x1 = x_ptr + (slot1 // TOP_K) * stride_x
        if BLOCK_M == 2:
            g_w0, g_w1, g_w2 = step_weights(w, s, b, offs_n, n_mask, k_start, k_end, stride_wr,
                                            stride_sg, W4, GROUP_SIZE, BLOCK_K)
        g0, g1 = expert_columns(g_w0, g_w1, g_w2, w, s, b, offs_n, n_mask, k_start, k_end, x0, x1,
                                stride_wr, stride_sg, W4, GROUP_SIZE, BLOCK_K, BLOCK_M == 2)
        if BLOCK_M == 2:
            u_w0, u_w1, u_w2 = step_weights(w + up, s + N, b + N, offs_n, n_mask, k_start, k_end,
                                            stride_wr, stride_sg, W4, GROUP_SIZE, BLOCK_K)
        u0, u1 = expert_columns(u_w0, u_w1, u_w2, w + up, s + N, b + N, offs_n, n_mask, k_start,
                                k_end, x0, x1, stride_wr, stride_sg, W4, GROUP_SIZE, BLOCK_K,
                                BLOCK_M == 2)
        split_stride = num_slots * 2 * N
        ws0 = ws_ptr + pid_k * split_stride + slot0 * (2 * N) + offs_n
        tl.store(ws0, g0, mask=n_mask)
        tl.store(ws0 + N, u0, mask=n_mask)
        if BLOCK_M == 2:
            ws1 = ws_ptr + pid_k * split_stride + slot1 * (2 * N) + offs_n
            tl.store(ws1, g1, mask=row_mask(offs_n, n_mask, valid1))
            tl.store(ws1 + N, u1, mask=row_mask(offs_n, n_mask, valid1))
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken
        ticket_at = ticket_ptr + pid_m * tl.num_programs(1) + pid_n
        if tl.atomic_add(ticket_at, 1, sem="acq_rel") == SPLIT - 1:
            _store_act(act_ptr, ws_ptr, slot0, valid0, offs_n, n_mask, N, split_stride, stride_act,
                       SPLIT, SPLIT_P2)
            if BLOCK_M == 2:
                if valid1:
                    _store_act(act_ptr, ws_ptr, slot1, valid1, offs_n, n_mask, N, split_stride,
                               stride_act, SPLIT, SPLIT_P2)
            tl.atomic_xchg(ticket_at, 0)


@triton.jit
def _finish_token(out_ptr, ws_ptr, ticket_ptr, shared_ptr, shared_w_ptr, token, pid_n, offs_n,
                  n_mask, split_stride, N, stride_out, stride_shared,
                  TOP_K: tl.constexpr, TOPK_P2: tl.constexpr, SPLIT: tl.constexpr,
                  SPLIT_P2: tl.constexpr, SHARED: tl.constexpr):
    """Take token's ticket for column block pid_n; the last of its TOP_K x SPLIT programs sums
    the weighted partials of every pick and split as one tile (SHARED: plus the gated shared
    expert's row) and stores the output row."""
    ticket_at = ticket_ptr + token * tl.num_programs(1) + pid_n
    if tl.atomic_add(ticket_at, 1, sem="acq_rel") == TOP_K * SPLIT - 1:
        r = tl.arange(0, TOPK_P2 * SPLIT_P2)
        pick, split = r // SPLIT_P2, r % SPLIT_P2
        at = (ws_ptr + split[:, None] * split_stride + (token * TOP_K + pick)[:, None] * N
              + offs_n[None, :])
        mask = ((pick < TOP_K) & (split < SPLIT))[:, None] & n_mask[None, :]
        total = tl.sum(tl.load(at, mask=mask, other=0.0, cache_modifier=".cg"), axis=0)
        if SHARED:
            shared = tl.load(shared_ptr + token * stride_shared + offs_n, mask=n_mask, other=0.0)
            total += tl.load(shared_w_ptr + token) * shared.to(tl.float32)
        tl.store(out_ptr + token * stride_out + offs_n, total.to(out_ptr.dtype.element_ty),
                 mask=n_mask)
        tl.atomic_xchg(ticket_at, 0)


@triton.jit
def _moe_decode_down_kernel(
    act_ptr, w_ptr, s_ptr, b_ptr, topk_w_ptr, out_ptr, ws_ptr, ticket_ptr, sorted_ptr,
    block_expert_ptr, shared_ptr, shared_w_ptr, num_slots, N, K, k_per_split,
    stride_act, stride_we, stride_wr, stride_se, stride_sg, stride_out, stride_shared,
    TOP_K: tl.constexpr, TOPK_P2: tl.constexpr, W4: tl.constexpr, GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    SPLIT_P2: tl.constexpr, SHARED: tl.constexpr, PDL: tl.constexpr = False,
):
    """out[t, n] = sum_k topk_w[t, k] * (act[t * TOP_K + k] @ W_e(t, k)[:, n])
    (SHARED: + shared_w[t] * shared[t, n]).
    Ahead of its PDL wait a program reads its block's expert and slots and (one slot a block)
    requests its first K step's weights: the router's picks (or the align's blocks) come two
    grids back, and the gate_up grid in between lets this one launch only after each of its
    programs has waited for them (pdl.py), so they are complete. act, the tickets and the
    workspace are read and written after the wait."""
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    slot0, valid0, slot1, valid1, k_start, k_end, offs_n, n_mask, w, s, b = program_share(
        sorted_ptr, block_expert_ptr, w_ptr, s_ptr, b_ptr, num_slots, N, K, k_per_split, stride_we,
        stride_se, BLOCK_M, BLOCK_N)
    if BLOCK_M == 1:  # as gate_up's: outside the branch at one slot a block only
        used = offs_n < tl.where(valid0, N, 0)  # an unused block requests nothing
        w0, w1, w2 = step_weights(w, s, b, offs_n, used, k_start, k_end, stride_wr, stride_sg, W4,
                                  GROUP_SIZE, BLOCK_K)
    pdl_enter(PDL)
    if valid0:
        if BLOCK_M == 2:
            w0, w1, w2 = step_weights(w, s, b, offs_n, n_mask, k_start, k_end, stride_wr, stride_sg,
                                      W4, GROUP_SIZE, BLOCK_K)
        p0, p1 = expert_columns(w0, w1, w2, w, s, b, offs_n, n_mask, k_start, k_end,
                                act_ptr + slot0 * stride_act, act_ptr + slot1 * stride_act,
                                stride_wr, stride_sg, W4, GROUP_SIZE, BLOCK_K, BLOCK_M == 2)
        split_stride = num_slots * N
        ws = ws_ptr + pid_k * split_stride + offs_n
        tl.store(ws + slot0 * N, p0 * tl.load(topk_w_ptr + slot0), mask=n_mask)
        if BLOCK_M == 2:
            tl.store(ws + slot1 * N, p1 * tl.load(topk_w_ptr + slot1),
                     mask=row_mask(offs_n, n_mask, valid1))
        tl.debug_barrier()  # every thread's partial is written before a ticket is taken
        _finish_token(out_ptr, ws_ptr, ticket_ptr, shared_ptr, shared_w_ptr, slot0 // TOP_K,
                      pid_n, offs_n, n_mask, split_stride, N, stride_out, stride_shared,
                      TOP_K, TOPK_P2, SPLIT, SPLIT_P2, SHARED)
        if BLOCK_M == 2:
            if valid1:  # the two slots of a block are two tokens (a token picks an expert once)
                _finish_token(out_ptr, ws_ptr, ticket_ptr, shared_ptr, shared_w_ptr,
                              slot1 // TOP_K, pid_n, offs_n, n_mask, split_stride, N, stride_out,
                              stride_shared, TOP_K, TOPK_P2, SPLIT, SPLIT_P2, SHARED)


_SLOT_ORDER: dict[tuple[int, torch.device], torch.Tensor] = {}


def decode_blocks(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(sorted_slots, block_expert, block_m) for T <= DECODE_MAX_TOKENS: at T = 1 the K picks are
    K distinct experts, so slot k is block k and no align launch runs; above, moe_align in
    blocks of two slots (few experts repeat, so a block rarely wastes a row). Either way the
    used blocks come first and number at most T * K (each holds a slot): the grids launch
    min(blocks, T * K) rows, not moe_align's worst-case count."""
    t, top_k = topk_ids.shape
    if t == 1:
        key = (top_k, topk_ids.device)
        if key not in _SLOT_ORDER:  # made once and kept: captured graphs hold its address
            _SLOT_ORDER[key] = torch.arange(top_k, dtype=torch.int32, device=topk_ids.device)
        return _SLOT_ORDER[key], topk_ids.reshape(-1).to(torch.int32), 1
    sorted_slots, block_expert, _ = moe_align(topk_ids, num_experts, 2)
    return sorted_slots, block_expert, 2


def _weight_args(weight: torch.Tensor | W4Weight, k: int, tiles: MoeDecodeTiles) -> tuple:
    """(w, s, b, stride_we, stride_wr, stride_se, stride_sg, group, block_k) of one projection."""
    if isinstance(weight, W4Weight):
        qw, s = weight.qweight, weight.scales
        block_k = min(tiles.block_k, weight.group_size)
        args = (qw, s, weight.biases, qw.stride(0), qw.stride(1), s.stride(0), s.stride(1),
                weight.group_size, block_k)
        if k % block_k:  # groups tile K; a 4-bit step stays within one group
            raise ValueError(f"MoE decode: K={k} is not a multiple of the {block_k}-wide K step")
    else:  # dense steps mask K's tail
        block_k = tiles.block_k
        args = (weight, weight, weight, weight.stride(0), weight.stride(1), 0, 0, 0, block_k)
    return args


def _split(k: int, block_k: int, steps: int) -> tuple[int, int]:
    """(split, k_per_split): K / (block_k x steps) programs, by K alone."""
    k_per_split = block_k * steps
    return triton.cdiv(k, k_per_split), k_per_split


def moe_decode(x: torch.Tensor, w13: torch.Tensor | MoeW4, w2: torch.Tensor | None,
               topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               tiles: MoeDecodeTiles | None = None,
               shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [T, H] (T <= DECODE_MAX_TOKENS) through the picked experts -> [T, H] in x's dtype.
    w13/w2 dense [E, 2I, H] / [E, H, I], or w13 a MoeW4 and w2 None. shared: (a shared
    expert's output [T, H], its gate float32 [T]) added in the combine (moe_ref.add_shared_ref).
    tiles override the table (sweeps)."""
    t, hidden = x.shape
    top_k = topk_ids.shape[1]
    if not 0 < t <= DECODE_MAX_TOKENS:
        raise ValueError(f"moe_decode: {t} tokens (1 to {DECODE_MAX_TOKENS})")
    num_experts, inter = expert_shape(w13)
    w4 = isinstance(w13, MoeW4)
    h2 = moe_h2_route(x, w13) if w4 and tiles is None else None
    if h2 is not None:  # one token: the packed-half GEMV over the picks (fused_moe_h2.py)
        return moe_h2(x, w13, topk_weights, topk_ids, h2, shared=shared)
    up_w, down_w = (w13.w13, w13.w2) if w4 else (w13, w2)
    pdl = pdl_args(x.device, "moe_w4" if w4 else "moe")
    table = moe_decode_tiles(x.device)
    tiles = tiles or (table.w4 if w4 else table.dense)
    x = x.contiguous()
    num_slots = t * top_k
    sorted_slots, block_expert, block_m = decode_blocks(topk_ids, num_experts)
    num_blocks = min(block_expert.numel(), num_slots)  # the used blocks (see decode_blocks)
    tickets = ticket_buffer(x.device, max(num_blocks * triton.cdiv(inter, tiles.block_n),
                                          t * triton.cdiv(hidden, tiles.block_n)))
    act = torch.empty((num_slots, inter), dtype=x.dtype, device=x.device)
    wargs = _weight_args(up_w, hidden, tiles)
    split, k_per_split = _split(hidden, wargs[-1], tiles.steps)
    ws = torch.empty((split, num_slots, 2 * inter), dtype=torch.float32, device=x.device)
    _moe_decode_up_kernel[(num_blocks, triton.cdiv(inter, tiles.block_n), split)](
        x, *wargs[:3], act, ws, tickets, sorted_slots, block_expert,
        num_slots, inter, hidden, k_per_split, x.stride(0), *wargs[3:7], act.stride(0),
        TOP_K=top_k, W4=w4, GROUP_SIZE=wargs[7], BLOCK_M=block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=wargs[8], SPLIT=split, SPLIT_P2=triton.next_power_of_2(split),
        num_warps=tiles.num_warps, num_stages=1, **pdl)
    out = torch.empty_like(x)
    wargs = _weight_args(down_w, inter, tiles)
    split, k_per_split = _split(inter, wargs[-1], tiles.steps)
    ws = torch.empty((split, num_slots, hidden), dtype=torch.float32, device=x.device)
    shared_out, shared_w = shared if shared is not None else (out, topk_weights)
    if shared is not None and (shared_out.shape != x.shape or shared_out.stride(1) != 1
                               or shared_w.shape != (t,)):
        raise ValueError(f"moe_decode: shared expert output {tuple(shared_out.shape)} and gate "
                         f"{tuple(shared_w.shape)}, expected {tuple(x.shape)} and ({t},)")
    _moe_decode_down_kernel[(num_blocks, triton.cdiv(hidden, tiles.block_n), split)](
        act, *wargs[:3], topk_weights.float().contiguous(), out, ws, tickets, sorted_slots,
        block_expert, shared_out, shared_w.float().contiguous(), num_slots, hidden, inter,
        k_per_split, act.stride(0), *wargs[3:7], out.stride(0), shared_out.stride(0),
        TOP_K=top_k, TOPK_P2=triton.next_power_of_2(top_k), W4=w4, GROUP_SIZE=wargs[7],
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=wargs[8], SPLIT=split,
        SPLIT_P2=triton.next_power_of_2(split), SHARED=shared is not None,
        num_warps=tiles.num_warps, num_stages=1, **pdl)
    return out
