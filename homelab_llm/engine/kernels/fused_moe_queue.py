"""A pre-norm MoE block at decode sizes in one launch: the norm and router, the experts' gate_up
and their down with the weighted sum, as the items of a work queue (work_queue.py).

Why: at batch 1 the 30B-A3B W4A16 layer pays a grid boundary per kernel, ~4.5 us each beyond its
bytes (BENCHMARKS 60.5); its MoE half is three launches (moe_router's fused norm + router, then
fused_moe_h2's gate_up and down). Here they are one grid whose programs take items in order:

  router items  moe_router.route_gate_kernel's programs: a few experts' logits each,
                RMSNorm(x + residual) formed on the way and stored (a share of the columns
                each) with the summed rows; the last to finish routes every token and then
                counts `routed`.
  gate_up items w4a16_h2_kernel's programs over the picks (Picks with token_x): column block c
                of pick s = t * P + p through its expert, after `routed`; each counts its pick
                done.
  down items    the same with act_in SiLU and the router weights (the picks' sum in pick order
                through the split-K epilogue's slots, as fused_moe_h2's down): column block c of
                pick s requests its expert's first words, then waits until all of pick s's
                gate_up items are done.

Items go pick-major, so the down items of pick 0 can start while later picks' gate_up items run.
The results are fused_moe_h2's bit for bit (the same programs on the same inputs; test), and
the picks the router's (route_gate_topk_norm's). Counters: [0] the queue, [1] routed, [2] the
router's ticket, [3, 3 + S) the S = T * P picks' gate_up counts, [3 + S] programs that left.

Serves: 4-bit experts (MoeW4) without a shared expert, a plain bf16/fp16 router, 1 to
FUSED_MAX_TOKENS tokens, whole-K tiles that fit both K (QueueTiles); on by the arch table
(ArchTiles.moe_queue) or HOMELAB_LLM_MOE_QUEUE=1 (=0 off).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.moe_ref import MoeW4
from homelab_llm.engine.kernels.moe_router import FUSED_MAX_TOKENS, rounded_code, route_gate_kernel
from homelab_llm.engine.kernels.pdl import pdl_args, pdl_enter
from homelab_llm.engine.kernels.tuning import QueueTiles, RouterTiles, env_tiles, tiles_for, whole_k_fits
from homelab_llm.engine.kernels.w4a16_h2 import Picks, kernel_args, picks_check, w4a16_h2_kernel
from homelab_llm.engine.kernels.work_queue import (count_done, counter, counters, leave_queue, pause_code,
                                                   take_item, wait_count)

ENV = "HOMELAB_LLM_MOE_QUEUE"
# A/B runs without a patched tree: "field=value,..." over the table's QueueTiles (its int and bool
# fields: router_block_e, router_block_k, poll_pause_ns), e.g. "poll_pause_ns=1000"
TILES_ENV = "HOMELAB_LLM_MOE_QUEUE_TILES"
# counter indices (0: the queue)
ROUTED, ROUTER_TICKET, PICKS_DONE = tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)


@triton.jit
def _gemv_item(col, pick, n_cols, x_ptr, qw_ptr, scales_ptr, biases_ptr, out_ptr, ws_ptr,
               ticket_ptr, xh_ptr, xp_ptr, xg_ptr, M, N, K, k_per_split, stride_xm, stride_qw,
               stride_sg, stride_om, num_splits, pick_ptr, pick_w_ptr, stride_we, stride_se,
               stride_xp, stride_op, picks_k, x_div, ready_ptr, ready_count,
               GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               WROWS: tl.constexpr, CHUNK_SEGS: tl.constexpr, EVEN_N: tl.constexpr,
               PREFETCH: tl.constexpr, USE_ASM: tl.constexpr, LOOP_STAGES: tl.constexpr,
               LOADS_FIRST: tl.constexpr, KSPLIT: tl.constexpr, TWO_STEPS: tl.constexpr,
               ACT_IN: tl.constexpr, PICKS_SUM: tl.constexpr, READY: tl.constexpr,
               SLEEP: tl.constexpr):
    """One picks-form w4a16_h2 program (column block col of n_cols, pick `pick`), no norm."""
    w4a16_h2_kernel(
        x_ptr=x_ptr, qw_ptr=qw_ptr, scales_ptr=scales_ptr, biases_ptr=biases_ptr,
        out_ptr=out_ptr, ws_ptr=ws_ptr, ticket_ptr=ticket_ptr, xh_ptr=xh_ptr, xp_ptr=xp_ptr,
        xg_ptr=xg_ptr, res_ptr=x_ptr, nw_ptr=x_ptr, sum_ptr=x_ptr, normed_ptr=x_ptr, eps=0.0,
        trace_ptr=x_ptr, M=M, N=N, K=K, k_per_split=k_per_split, stride_xm=stride_xm,
        stride_qw=stride_qw, stride_sg=stride_sg, stride_om=stride_om, stride_rm=0, stride_sm=0,
        num_splits=num_splits, GROUP_SIZE=GROUP_SIZE, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        WROWS=WROWS, CHUNK_SEGS=CHUNK_SEGS, EVEN_N=EVEN_N, PREFETCH=PREFETCH, USE_ASM=USE_ASM,
        LOOP_STAGES=LOOP_STAGES, PREFETCH_L2=False, NORM=False, RESIDUAL=False, ACT_IN=ACT_IN,
        NORM_CHUNK=1, NORM_OUT=False, PDL=False, TRACE=False, LOADS_FIRST=LOADS_FIRST,
        KSPLIT=KSPLIT, TWO_STEPS=TWO_STEPS, pick_ptr=pick_ptr, pick_w_ptr=pick_w_ptr,
        stride_we=stride_we, stride_se=stride_se, stride_xp=stride_xp, stride_op=stride_op,
        picks_k=picks_k, x_div=x_div, add_ptr=None, add_w_ptr=None, stride_add=0, PICKS=True,
        PICKS_SUM=PICKS_SUM, PICKS_ADD=False, item_n=col, item_k=pick, item_cols=n_cols,
        ready_ptr=ready_ptr, ready_count=ready_count, ITEM=True, READY=READY, READY_SLEEP=SLEEP)


@triton.jit
def _moe_queue_kernel(
    x_ptr, res_ptr, nw_ptr, gw_ptr, logits_ptr, weights_ptr, ids_ptr, normed_ptr, summed_ptr,
    T, E, H, stride_x, stride_r, stride_w, eps,
    queue_ptr, n_router, n_up_cols, n_down_cols, n_items,
    u_qw_ptr, u_scales_ptr, u_biases_ptr, u_out_ptr, u_ws_ptr, u_ticket_ptr, u_xh_ptr, u_xp_ptr,
    u_xg_ptr, u_M, u_N, u_K, u_k_per_split, u_stride_xm, u_stride_qw, u_stride_sg, u_stride_om,
    u_num_splits, u_stride_we, u_stride_se, u_stride_xp, u_stride_op,
    d_qw_ptr, d_scales_ptr, d_biases_ptr, d_out_ptr, d_ws_ptr, d_ticket_ptr, d_xh_ptr, d_xp_ptr,
    d_xg_ptr, d_M, d_N, d_K, d_k_per_split, d_stride_xm, d_stride_qw, d_stride_sg, d_stride_om,
    d_num_splits, d_stride_we, d_stride_se, d_stride_xp, d_stride_op,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
    E_POW2: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr, RESIDUAL: tl.constexpr,
    BLOCK_NORMED: tl.constexpr, ROUNDED: tl.constexpr,
    U_GROUP_SIZE: tl.constexpr, U_BLOCK_M: tl.constexpr, U_BLOCK_N: tl.constexpr,
    U_WROWS: tl.constexpr, U_CHUNK_SEGS: tl.constexpr, U_EVEN_N: tl.constexpr,
    U_PREFETCH: tl.constexpr, U_LOOP_STAGES: tl.constexpr, U_LOADS_FIRST: tl.constexpr,
    U_KSPLIT: tl.constexpr, U_TWO_STEPS: tl.constexpr,
    D_GROUP_SIZE: tl.constexpr, D_BLOCK_M: tl.constexpr, D_BLOCK_N: tl.constexpr,
    D_WROWS: tl.constexpr, D_CHUNK_SEGS: tl.constexpr, D_EVEN_N: tl.constexpr,
    D_PREFETCH: tl.constexpr, D_LOOP_STAGES: tl.constexpr, D_LOADS_FIRST: tl.constexpr,
    D_KSPLIT: tl.constexpr, D_TWO_STEPS: tl.constexpr,
    USE_ASM: tl.constexpr, N_COUNTERS: tl.constexpr, COUNTERS_P2: tl.constexpr,
    SLEEP: tl.constexpr = 0, PDL: tl.constexpr = False,
):
    """One item a program, in the order the programs take them (work_queue.take_item)."""
    pdl_enter(PDL)  # x and the residual come from the previous grid; the counters are shared
    item = take_item(queue_ptr)
    n_up = n_up_cols * T * TOP_K
    if item < n_router:
        route_gate_kernel(
            x_ptr, res_ptr, nw_ptr, gw_ptr, gw_ptr, logits_ptr, logits_ptr, weights_ptr,
            ids_ptr, logits_ptr, counter(queue_ptr, ROUTER_TICKET), normed_ptr, summed_ptr, T,
            E, H, stride_x, stride_r, stride_w, eps, TOP_K=TOP_K, BLOCK_T=BLOCK_T,
            BLOCK_E=BLOCK_E, BLOCK_H=BLOCK_H, E_POW2=E_POW2, BLOCK_K=BLOCK_K,
            RENORMALIZE=RENORMALIZE, SHARED=False, NORM=True, RESIDUAL=RESIDUAL,
            WRITE_NORMED=True, BLOCK_NORMED=BLOCK_NORMED, ROUNDED=ROUNDED, PDL=False, item=item,
            n_items=n_router, routed_ptr=counter(queue_ptr, ROUTED), ITEM=True)
    elif item < n_router + n_up:
        wait_count(counter(queue_ptr, ROUTED), 1, SLEEP)
        j = item - n_router
        pick = j // n_up_cols
        _gemv_item(j % n_up_cols, pick, n_up_cols, normed_ptr, u_qw_ptr, u_scales_ptr,
                   u_biases_ptr, u_out_ptr, u_ws_ptr, u_ticket_ptr, u_xh_ptr, u_xp_ptr,
                   u_xg_ptr, u_M, u_N, u_K, u_k_per_split, u_stride_xm, u_stride_qw,
                   u_stride_sg, u_stride_om, u_num_splits, ids_ptr, ids_ptr, u_stride_we,
                   u_stride_se, u_stride_xp, u_stride_op, TOP_K, TOP_K, queue_ptr, 0,
                   GROUP_SIZE=U_GROUP_SIZE, BLOCK_M=U_BLOCK_M, BLOCK_N=U_BLOCK_N,
                   WROWS=U_WROWS, CHUNK_SEGS=U_CHUNK_SEGS, EVEN_N=U_EVEN_N, PREFETCH=U_PREFETCH,
                   USE_ASM=USE_ASM, LOOP_STAGES=U_LOOP_STAGES, LOADS_FIRST=U_LOADS_FIRST,
                   KSPLIT=U_KSPLIT, TWO_STEPS=U_TWO_STEPS, ACT_IN=0, PICKS_SUM=False, READY=False,
                   SLEEP=SLEEP)
        count_done(counter(queue_ptr, PICKS_DONE + pick))
    else:
        wait_count(counter(queue_ptr, ROUTED), 1, SLEEP)  # long met: gate_up's items waited
        j = item - n_router - n_up
        pick = j // n_down_cols
        _gemv_item(j % n_down_cols, pick, n_down_cols, u_out_ptr, d_qw_ptr, d_scales_ptr,
                   d_biases_ptr, d_out_ptr, d_ws_ptr, d_ticket_ptr, d_xh_ptr, d_xp_ptr,
                   d_xg_ptr, d_M, d_N, d_K, d_k_per_split, d_stride_xm, d_stride_qw,
                   d_stride_sg, d_stride_om, d_num_splits, ids_ptr, weights_ptr, d_stride_we,
                   d_stride_se, d_stride_xp, d_stride_op, TOP_K, 1,
                   counter(queue_ptr, PICKS_DONE + pick), n_up_cols,
                   GROUP_SIZE=D_GROUP_SIZE, BLOCK_M=D_BLOCK_M, BLOCK_N=D_BLOCK_N,
                   WROWS=D_WROWS, CHUNK_SEGS=D_CHUNK_SEGS, EVEN_N=D_EVEN_N, PREFETCH=D_PREFETCH,
                   USE_ASM=USE_ASM, LOOP_STAGES=D_LOOP_STAGES, LOADS_FIRST=D_LOADS_FIRST,
                   KSPLIT=D_KSPLIT, TWO_STEPS=D_TWO_STEPS, ACT_IN=1, PICKS_SUM=True,
                   READY=True, SLEEP=SLEEP)
    leave_queue(queue_ptr, n_items, N_COUNTERS, COUNTERS_P2)


# w4a16_h2.kernel_args' names that _moe_queue_kernel takes per GEMV (prefixed u_ / U_, d_ / D_)
_RUNTIME = ("qw_ptr", "scales_ptr", "biases_ptr", "out_ptr", "ws_ptr", "ticket_ptr", "xh_ptr",
            "xp_ptr", "xg_ptr", "M", "N", "K", "k_per_split", "stride_xm", "stride_qw",
            "stride_sg", "stride_om", "num_splits", "stride_we", "stride_se", "stride_xp",
            "stride_op")
_CONSTEXPR = ("GROUP_SIZE", "BLOCK_M", "BLOCK_N", "WROWS", "CHUNK_SEGS", "EVEN_N", "PREFETCH",
              "LOOP_STAGES", "LOADS_FIRST", "KSPLIT", "TWO_STEPS")


def _prefixed(args: dict, prefix: str) -> dict:
    out = {f"{prefix}_{name}": args[name] for name in _RUNTIME}
    out.update({f"{prefix.upper()}_{name}": args[name] for name in _CONSTEXPR})
    return out


def queue_tiles(device: torch.device, w: MoeW4) -> QueueTiles | None:
    """This device's moe_queue tiles where the engine takes them for w's experts: an entry whose
    tiles fit both K, on by default or asked for (ENV=1), TILES_ENV's changes applied; None with
    ENV=0."""
    env = os.environ.get(ENV, "")
    if env not in ("", "0", "1"):
        raise ValueError(f"{ENV}={env!r}: 1 (on) or 0 (off)")
    tiles = tiles_for(device).moe_queue
    if env == "0" or tiles is None:
        return None
    tiles = env_tiles(tiles, TILES_ENV)
    k_up, k_down = w.w13.qweight.shape[1] * 8, w.w2.qweight.shape[1] * 8
    fits = (whole_k_fits(tiles.up, k_up, w.w13.group_size)
            and whole_k_fits(tiles.down, k_down, w.w2.group_size))
    return tiles if fits and (env == "1" or tiles.default) else None


def moe_queue_route(x: torch.Tensor, w: MoeW4 | None) -> QueueTiles | None:
    """The tiles where x's tokens take moe_queue through w's experts, else None."""
    if w is None or not 0 < x.shape[0] <= tiles_for(x.device).moe_h2_tokens \
            or x.dtype not in (torch.bfloat16, torch.float16):
        return None
    return queue_tiles(x.device, w)


def router_tiles(tiles: QueueTiles, tokens: int) -> RouterTiles:
    """The router items' tiles as route_gate_topk_norm takes them (the same logits, bit for bit):
    the queue's warps, and hidden values a step capped so a step's [tokens, experts, values]
    products stay within 32 registers a thread."""
    warps = tiles.up.num_warps
    cap = 1024 * warps // (triton.next_power_of_2(tokens) * tiles.router_block_e)
    return RouterTiles(tiles.router_block_e, max(16, min(tiles.router_block_k, cap)), warps)


@dataclass(frozen=True)
class QueueOut:
    """moe_queue's results: the experts' weighted sum [T, H] (x's dtype), x + residual (x itself
    without a residual), and the router's picks (weights fp32, ids int32 [T, P])."""

    out: torch.Tensor
    summed: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor


def moe_queue(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              gate_weight: torch.Tensor, top_k: int, renormalize: bool, w: MoeW4,
              tiles: QueueTiles) -> QueueOut:
    """RMSNorm(x + residual) * norm_weight through the router (gate_weight [E, H]: softmax top_k,
    renormalized when asked) and w's picked experts, in one launch; see the module doc."""
    t, hidden = x.shape
    num_experts = gate_weight.shape[0]
    if residual is not None and residual.shape != x.shape or tuple(norm_weight.shape) != (hidden,) \
            or gate_weight.shape[1] != hidden or not 0 < t <= FUSED_MAX_TOKENS \
            or not 0 < top_k <= num_experts or w.w13.qweight.shape[1] * 8 != hidden:
        raise ValueError(f"moe_queue: x {tuple(x.shape)} (1 to {FUSED_MAX_TOKENS} tokens), residual "
                         f"{None if residual is None else tuple(residual.shape)}, norm "
                         f"{tuple(norm_weight.shape)}, router {tuple(gate_weight.shape)} top {top_k}, "
                         f"experts' K {w.w13.qweight.shape[1] * 8}")
    if tiles.up.num_warps != tiles.down.num_warps:
        raise ValueError(f"moe_queue: gate_up's and down's tiles run in one grid, so with the same "
                         f"warps ({tiles.up.num_warps} and {tiles.down.num_warps})")
    dev = x.device
    x = x if x.stride(1) == 1 else x.contiguous()
    res = x if residual is None else (residual if residual.stride(1) == 1 else residual.contiguous())
    gw = gate_weight if gate_weight.stride(1) == 1 else gate_weight.contiguous()
    e_pow2 = triton.next_power_of_2(num_experts)
    logits = torch.empty((t, e_pow2), dtype=torch.float32, device=dev)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=dev)
    normed = torch.empty((t, hidden), dtype=x.dtype, device=dev)
    summed = torch.empty_like(normed) if residual is not None else normed
    inter = w.w2.qweight.shape[1] * 8
    gate_up = torch.empty((t * top_k, 2 * inter), dtype=x.dtype, device=dev)
    out = torch.empty_like(x)
    up_picks, down_picks = Picks(ids, token_x=True), Picks(ids, weights)
    picks_check(normed, w.w13, gate_up, up_picks, tiles.up)
    picks_check(gate_up, w.w2, out, down_picks, tiles.down)
    no_pdl: dict = {}
    up_grid, up = kernel_args(normed, w.w13, gate_up, tiles.up, 1, no_pdl, picks=up_picks)
    down_grid, down = kernel_args(gate_up, w.w2, out, tiles.down, 1, no_pdl, act_in="silu",
                                  picks=down_picks)
    down["LOADS_FIRST"] = False  # a down item requests its first words before it waits
    router = router_tiles(tiles, t)
    n_router = triton.cdiv(num_experts, router.block_e)
    n_items = n_router + up_grid[0] * up_grid[1] + down_grid[0] * down_grid[1]
    n_counters = PICKS_DONE.value + t * top_k + 1
    queue = counters(dev, n_counters)
    _moe_queue_kernel[(n_items,)](
        x, res, norm_weight, gw, logits, weights, ids, normed, summed,
        t, num_experts, hidden, x.stride(0), res.stride(0), gw.stride(0), float(eps),
        queue, n_router, up_grid[0], down_grid[0], n_items,
        **_prefixed(up, "u"), **_prefixed(down, "d"),
        TOP_K=top_k, BLOCK_T=triton.next_power_of_2(t), BLOCK_E=router.block_e,
        BLOCK_H=router.block_k, E_POW2=e_pow2, BLOCK_K=triton.next_power_of_2(top_k),
        RENORMALIZE=renormalize, RESIDUAL=residual is not None,
        BLOCK_NORMED=max(16, triton.next_power_of_2(triton.cdiv(hidden, n_router))),
        ROUNDED=rounded_code(x.dtype), USE_ASM=up["USE_ASM"], N_COUNTERS=n_counters,
        COUNTERS_P2=triton.next_power_of_2(n_counters),
        SLEEP=pause_code(dev, tiles.poll_pause_ns),
        num_warps=tiles.up.num_warps,
        num_stages=1, **pdl_args(dev, "router"))
    return QueueOut(out, summed if residual is not None else x, weights, ids)

