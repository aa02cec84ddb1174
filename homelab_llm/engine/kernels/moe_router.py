"""The softmax top-k router in one kernel launch: per token, softmax over the E logits (fp32),
the top_k largest probabilities and their expert ids, renormalised to sum 1 when asked.
Reference: moe_ref.route_topk_ref (torch softmax + topk: four to five launches per layer).

One program per token holds its whole logit row in registers (E <= MAX_EXPERTS) and picks the
top_k by repeated max: ties go to the lowest expert id (bf16/fp16 logits: one integer max a pick
over keys that hold the logit's bits and the id, _softmax_topk). Output: weights float32 [T, K],
ids int32 [T, K], in descending weight order as torch.topk gives them. No host reads:
graph-capturable.

At decode sizes (T <= FUSED_MAX_TOKENS) route_gate_topk also computes the logits, x @ W.T for the
router's [E, H] weight (reference: F.linear, then route_topk_ref), in the same launch: each program
takes a few experts' rows for every token, and the last program to finish (an atomic ticket, as
in w4a16_gemv) routes all tokens -- no cuBLAS call, one launch instead of two. Each logit is one
program's fixed-order sum, so the picks are deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.pdl import pdl_args, pdl_enter
from homelab_llm.engine.kernels.tuning import RouterTiles, moe_decode_tiles, tiles_for
from homelab_llm.engine.kernels.w4a16_gemv import ticket_buffer
from homelab_llm.engine.kernels.w4a16_prologue import summed_input

MAX_EXPERTS = 1024
FUSED_MAX_TOKENS = 8  # route_gate_topk's last program holds [T, E] logits in registers


@triton.jit
def _softmax_topk(x, mask, offs_e, E, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr, ROUNDED: tl.constexpr = 0):
    """Logit rows x [R, BLOCK_E] (fp32, mask: real experts) -> (weights [R, BLOCK_K] fp32, ids
    [R, BLOCK_K] int32): softmax, then the TOP_K largest by repeated max, ties to the lowest id.
    A NaN row still gets ids < E (the expert kernels index weights and count picks by them).
    ROUNDED (rounded_code: 1 bf16, 2 fp16): every logit holds a value of that type (the router's
    logits are rounded so): each pick is then one max over 32-bit keys (the logit's 16 bits in
    signed order above 65535 - id) instead of a max and an argmin, and its probability comes
    from the key's logit by the same formula: bit for bit in the interpreter, within a few ulp
    on a GPU (its exp and division are approximate and compiled apart: 3 ulp seen on an H200).
    (Logits so far below the row's max that their probability is 0 tie for the chain, lowest id
    first, but not for the keys: with fewer than TOP_K nonzero probabilities the picks of weight
    0 may differ.)"""
    m = tl.max(x, axis=1)[:, None]
    p = tl.exp(x - m)
    p = tl.where(mask, p, 0.0)
    total = tl.sum(p, axis=1)[:, None]
    k_offs = tl.arange(0, BLOCK_K)[None, :]
    weights = tl.zeros([x.shape[0], BLOCK_K], tl.float32)
    ids = tl.zeros([x.shape[0], BLOCK_K], tl.int32)
    if ROUNDED == 0:
        # probabilities are >= 0: -1 marks taken or padding
        remaining = tl.where(mask, p / total, -1.0)
        for k in tl.static_range(TOP_K):
            best = tl.max(remaining, axis=1)[:, None]
            idx = tl.minimum(tl.min(tl.where(remaining == best, offs_e, BLOCK_E), axis=1),
                             E - 1)[:, None]
            weights = tl.where(k_offs == k, best, weights)
            ids = tl.where(k_offs == k, idx, ids)
            remaining = tl.where(offs_e == idx, -1.0, remaining)
    else:
        keys = tl.where(mask, _logit_key(x, ROUNDED) * 65536 + (65535 - offs_e), -2147483648)
        for k in tl.static_range(TOP_K):
            best = tl.max(keys, axis=1)[:, None]
            idx = tl.minimum(65535 - (best & 65535), E - 1)
            value = _key_logit(best >> 16, ROUNDED)
            weights = tl.where(k_offs == k, tl.exp(value - m) / total, weights)
            ids = tl.where(k_offs == k, idx, ids)
            keys = tl.where(keys == best, -2147483648, keys)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]
    return weights, ids


def rounded_code(dtype: torch.dtype) -> int:
    """_softmax_topk's ROUNDED for logits rounded to `dtype`: 1 bf16, 2 fp16, 0 other."""
    return {torch.bfloat16: 1, torch.float16: 2}.get(dtype, 0)


@triton.jit
def _logit_key(x, ROUNDED: tl.constexpr):
    """fp32 values of a 16-bit type (ROUNDED) -> int32 in [-32768, 32767] in their order (-0
    as +0)."""
    if ROUNDED == 1:
        bits = x.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)
    else:
        bits = x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    bits = tl.where(bits == -32768, 0, bits)
    return tl.where(bits < 0, bits ^ 32767, bits)


@triton.jit
def _key_logit(key, ROUNDED: tl.constexpr):
    """_logit_key's inverse: the fp32 value."""
    bits = tl.where(key < 0, key ^ 32767, key).to(tl.int16)
    if ROUNDED == 1:
        return bits.to(tl.bfloat16, bitcast=True).to(tl.float32)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _store_picks(weights_ptr, ids_ptr, weights, ids, rows, row_mask,
                 TOP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    k_offs = tl.arange(0, BLOCK_K)[None, :]
    at = rows[:, None].to(tl.int64) * TOP_K + k_offs
    mask = row_mask[:, None] & (k_offs < TOP_K)
    tl.store(weights_ptr + at, weights, mask=mask)
    tl.store(ids_ptr + at, ids, mask=mask)


@triton.jit
def _route_topk_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride_l,
                       TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                       RENORMALIZE: tl.constexpr, ROUNDED: tl.constexpr = 0,
                       PDL: tl.constexpr = False):
    pdl_enter(PDL)
    rows = tl.program_id(0) + tl.arange(0, 1)
    offs = tl.arange(0, BLOCK_E)[None, :]
    mask = offs < E
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_l + offs, mask=mask,
                other=-float("inf")).to(tl.float32)
    weights, ids = _softmax_topk(x, mask, offs, E, TOP_K, BLOCK_E, BLOCK_K, RENORMALIZE, ROUNDED)
    _store_picks(weights_ptr, ids_ptr, weights, ids, rows, rows >= 0, TOP_K, BLOCK_K)


@triton.jit
def _store_normed(x_ptr, res_ptr, nw_ptr, normed_ptr, summed_ptr, rstd, offs_t, t_mask, h_start,
                  h_end, stride_x, stride_r, H, BLOCK_H: tl.constexpr, RESIDUAL: tl.constexpr):
    """normed[t, h_start:h_end] = (x[t] (+ residual[t], rounded: stored in summed)) * rstd[t] *
    nw, rounded to x's dtype: elementwise.add_rms_norm's formula (contiguous [T, H] outputs)."""
    dtype = x_ptr.dtype.element_ty
    for h0 in range(h_start, h_end, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_mask = offs_h < h_end
        mask = t_mask[:, None] & h_mask[None, :]
        x = summed_input(x_ptr, res_ptr, offs_t[:, None], offs_h[None, :], mask, stride_x,
                         stride_r, RESIDUAL)
        at = offs_t[:, None] * H + offs_h[None, :]
        if RESIDUAL:
            tl.store(summed_ptr + at, x.to(dtype), mask=mask)
        w = tl.load(nw_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(normed_ptr + at, (x * rstd[:, None] * w).to(dtype), mask=mask)


@triton.jit
def _gate_rows(w_ptr, g_ptr, offs_e, e_mask, h0, H, stride_w, E, BLOCK_H: tl.constexpr,
               SHARED: tl.constexpr):
    """Experts offs_e's gate rows over [h0, h0 + BLOCK_H), fp32 [BLOCK_E, BLOCK_H] (SHARED: row
    E is the shared expert's gate, masked off in every other program)."""
    offs_h = h0 + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    w = tl.load(w_ptr + offs_e[:, None].to(tl.int64) * stride_w + offs_h[None, :],
                mask=e_mask[:, None] & h_mask[None, :], other=0.0).to(tl.float32)
    if SHARED:
        w += tl.load(g_ptr + offs_e[:, None] * 0 + offs_h[None, :],
                     mask=(offs_e == E)[:, None] & h_mask[None, :], other=0.0).to(tl.float32)
    return w


@triton.jit
def _gate_step(x_ptr, res_ptr, nw_ptr, w, offs_t, t_mask, h0, H, stride_x, stride_r,
               BLOCK_H: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr):
    """One K step of the router's logits: (x [BLOCK_T, BLOCK_H] (NORM: times nw) @ w^T, each
    token's sum of squares of the step) in fp32."""
    offs_h = h0 + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    x = summed_input(x_ptr, res_ptr, offs_t[:, None], offs_h[None, :],
                     t_mask[:, None] & h_mask[None, :], stride_x, stride_r, RESIDUAL)
    sq = tl.zeros([x.shape[0]], tl.float32)
    if NORM:
        sq = tl.sum(x * x, axis=1)
        x = x * tl.load(nw_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32)[None, :]
    return tl.sum(x[:, None, :] * w[None, :, :], axis=2), sq


@triton.jit
def route_gate_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, g_ptr, logits_ptr, shared_ptr, weights_ptr,
                      ids_ptr, shared_w_ptr, ticket_ptr, normed_ptr, summed_ptr, T, E, H,
                      stride_x, stride_r, stride_w, eps, TOP_K: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                      E_POW2: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                      SHARED: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
                      WRITE_NORMED: tl.constexpr = False, BLOCK_NORMED: tl.constexpr = 16,
                      ROUNDED: tl.constexpr = 0, PDL: tl.constexpr = False,
                      item=0, n_items=0, routed_ptr=None, ITEM: tl.constexpr = False):
    """Program pid of n_progs (the grid; with ITEM, item of n_items, a router item of
    fused_moe_queue.py's work queue): the logits of experts [pid * BLOCK_E, +BLOCK_E) for every
    token, rounded to x's dtype as a bf16 linear layer gives them, into an fp32 [T, E_POW2]
    workspace (SHARED: row E is the shared expert's gate g, its logit into shared [T]); the last
    program to finish (an atomic ticket, reset after) routes every token from the whole
    workspace (and stores sigmoid(g x)); with ITEM it then counts routed_ptr (a release: the
    picks and every program's normed share are out).
    NORM: the input is RMSNorm(x (+ residual, rounded to x's dtype)) * nw, formed on the way:
    x * nw feeds the dot and each token's 1 / rms, gathered in the same loop, scales the logits
    (dense_gemv's prologue; the normalized input is not rounded to x's dtype first).
    WRITE_NORMED: every program then also stores its share of the columns of the rows the
    experts read, RMSNorm(x + residual) [T, H] in x's dtype (add_rms_norm's values; the summed
    rows too with a residual), so the norm launch in front of the experts goes away; contiguous
    rows. (Program 0 storing all of it kept the ticket waiting ~1-2 us on that program.)"""
    if ITEM:
        pid = item
        n_progs = n_items
    else:
        pid = tl.program_id(0)
        n_progs = tl.num_programs(0)
    offs_t = tl.arange(0, BLOCK_T)
    offs_e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    t_mask = offs_t < T
    e_mask = offs_e < E
    # the first K step's gate rows are weights, which no kernel of the step writes: requested
    # ahead of the PDL wait (pdl.py), so they overlap the tail of the grid before
    w = _gate_rows(w_ptr, g_ptr, offs_e, e_mask, 0, H, stride_w, E, BLOCK_H, SHARED)
    pdl_enter(PDL)
    acc, sq = _gate_step(x_ptr, res_ptr, nw_ptr, w, offs_t, t_mask, 0, H, stride_x, stride_r,
                         BLOCK_H, NORM, RESIDUAL)
    for h0 in range(BLOCK_H, H, BLOCK_H):
        w = _gate_rows(w_ptr, g_ptr, offs_e, e_mask, h0, H, stride_w, E, BLOCK_H, SHARED)
        part, part_sq = _gate_step(x_ptr, res_ptr, nw_ptr, w, offs_t, t_mask, h0, H, stride_x,
                                   stride_r, BLOCK_H, NORM, RESIDUAL)
        acc += part
        sq += part_sq
    if NORM:
        rstd = tl.math.rsqrt(sq / H + eps)
        acc = acc * rstd[:, None]
        if WRITE_NORMED:
            cols = tl.cdiv(H, n_progs)
            h_start = pid * cols
            _store_normed(x_ptr, res_ptr, nw_ptr, normed_ptr, summed_ptr, rstd, offs_t, t_mask,
                          h_start, tl.minimum(h_start + cols, H), stride_x, stride_r, H,
                          BLOCK_NORMED, RESIDUAL)
    acc = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(logits_ptr + offs_t[:, None] * E_POW2 + offs_e[None, :], acc,
             mask=t_mask[:, None] & e_mask[None, :])
    if SHARED:
        tl.store(shared_ptr + offs_t[:, None] + offs_e[None, :] * 0, acc,
                 mask=t_mask[:, None] & (offs_e == E)[None, :])
    tl.debug_barrier()  # every thread's logits are written before the ticket is taken
    if tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == n_progs - 1:
        offs = tl.arange(0, E_POW2)[None, :]
        mask = t_mask[:, None] & (offs < E)
        logits = tl.load(logits_ptr + offs_t[:, None] * E_POW2 + offs, mask=mask,
                         other=-float("inf"), cache_modifier=".cg")
        weights, ids = _softmax_topk(logits, offs < E, offs, E, TOP_K, E_POW2, BLOCK_K,
                                     RENORMALIZE, ROUNDED)
        _store_picks(weights_ptr, ids_ptr, weights, ids, offs_t, t_mask, TOP_K, BLOCK_K)
        if SHARED:
            g = tl.load(shared_ptr + offs_t, mask=t_mask, other=0.0, cache_modifier=".cg")
            tl.store(shared_w_ptr + offs_t, 1.0 / (1.0 + tl.exp(-g)), mask=t_mask)
        tl.atomic_xchg(ticket_ptr, 0)
        if ITEM:
            tl.debug_barrier()  # every thread's picks are written before they are published
            tl.atomic_add(routed_ptr, 1, sem="release")


def _check_pick(top_k: int, num_experts: int) -> None:
    if not 0 < top_k <= num_experts or num_experts > MAX_EXPERTS:
        raise ValueError(f"router: top_k {top_k} of {num_experts} experts (at most "
                         f"{MAX_EXPERTS}) is not a valid pick")


def route_topk(router_logits: torch.Tensor, top_k: int,
               renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights float32 [T, K], ids int32 [T, K]); see the module doc."""
    t, num_experts = router_logits.shape
    _check_pick(top_k, num_experts)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=router_logits.device)
    if t == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    _route_topk_kernel[(t,)](
        logits, weights, ids, num_experts, logits.stride(0),
        TOP_K=top_k, BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_K=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
        ROUNDED=rounded_code(logits.dtype),
        num_warps=tiles_for(logits.device).elementwise_warps, **pdl_args(logits.device, "router"))
    return weights, ids


def route_gate_topk(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool,
                    shared_gate: torch.Tensor | None = None, tiles: RouterTiles | None = None,
                    *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                    residual: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [T, H] (T <= FUSED_MAX_TOKENS) and the router's weight [E, H] -> route_topk(x @ W.T),
    the logits rounded to x's dtype as the linear layer rounds them, in one launch; with the
    shared expert's gate [1, H] also sigmoid(x @ g.T) float32 [T] (else None). norm_weight:
    the router reads RMSNorm(x (+ residual)) instead of x, formed in the same launch (the
    normalized rows are not written; route_gate_topk_norm also returns them)."""
    return _route(x, gate_weight, top_k, renormalize, shared_gate, tiles, norm_weight, eps,
                  residual, False)[:3]


def route_gate_topk_norm(x: torch.Tensor, residual: torch.Tensor | None,
                         norm_weight: torch.Tensor, eps: float, gate_weight: torch.Tensor,
                         top_k: int, renormalize: bool, shared_gate: torch.Tensor | None = None,
                         tiles: RouterTiles | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                    torch.Tensor, torch.Tensor]:
    """A pre-norm decoder's norm and its MoE router in one launch: (weights, ids, shared gate
    weight or None, RMSNorm(x + residual), x + residual) -- route_gate_topk over the normalized
    rows, which are also returned (as add_rms_norm returns them) for the experts to read.
    Without a residual (a first layer) the last result is x."""
    weights, ids, shared_w, normed, summed = _route(x, gate_weight, top_k, renormalize,
                                                    shared_gate, tiles, norm_weight, eps,
                                                    residual, True)
    return weights, ids, shared_w, normed, (x if summed is None else summed)


def _route(x, gate_weight, top_k, renormalize, shared_gate, tiles, norm_weight, eps, residual,
           write_normed: bool):
    t, hidden = x.shape
    if residual is not None and (norm_weight is None or residual.shape != x.shape):
        raise ValueError(f"fused router: a residual {tuple(residual.shape)} goes with a norm and "
                         f"x's shape {tuple(x.shape)}")
    if norm_weight is not None and tuple(norm_weight.shape) != (hidden,):
        raise ValueError(f"fused router: norm weight {tuple(norm_weight.shape)}, expected "
                         f"({hidden},)")
    num_experts = gate_weight.shape[0]
    _check_pick(top_k, num_experts)
    if not 0 < t <= FUSED_MAX_TOKENS or gate_weight.shape[1] != hidden:
        raise ValueError(f"fused router: {t} tokens of {hidden} (1 to {FUSED_MAX_TOKENS}) against "
                         f"a {tuple(gate_weight.shape)} weight")
    tiles = tiles or moe_decode_tiles(x.device).router
    x = x if x.stride(1) == 1 else x.contiguous()
    w = gate_weight if gate_weight.stride(1) == 1 else gate_weight.contiguous()
    if shared_gate is not None and tuple(shared_gate.shape) != (1, hidden):
        raise ValueError(f"fused router: shared expert gate {tuple(shared_gate.shape)}, expected "
                         f"(1, {hidden})")
    e_pow2 = triton.next_power_of_2(num_experts)
    logits = torch.empty((t, e_pow2), dtype=torch.float32, device=x.device)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=x.device)
    shared = torch.empty((2, t), dtype=torch.float32, device=x.device)  # logit, sigmoid
    g = w if shared_gate is None else shared_gate.contiguous()
    rows = num_experts + (shared_gate is not None)
    res = x if residual is None else (residual if residual.stride(1) == 1 else residual.contiguous())
    normed = torch.empty((t, hidden), dtype=x.dtype, device=x.device) if write_normed else x
    summed = torch.empty_like(normed) if write_normed and residual is not None else None
    grid = triton.cdiv(rows, tiles.block_e)
    route_gate_kernel[(grid,)](
        x, res, x if norm_weight is None else norm_weight, w, g, logits, shared[0], weights, ids,
        shared[1], ticket_buffer(x.device, 1), normed, normed if summed is None else summed,
        t, num_experts, hidden, x.stride(0), res.stride(0), w.stride(0), float(eps),
        TOP_K=top_k, BLOCK_T=triton.next_power_of_2(t), BLOCK_E=tiles.block_e,
        BLOCK_H=tiles.block_k, E_POW2=e_pow2, BLOCK_K=triton.next_power_of_2(top_k),
        RENORMALIZE=renormalize, SHARED=shared_gate is not None, NORM=norm_weight is not None,
        RESIDUAL=residual is not None, WRITE_NORMED=write_normed,
        BLOCK_NORMED=max(16, triton.next_power_of_2(triton.cdiv(hidden, grid))),
        ROUNDED=rounded_code(x.dtype),
        num_warps=tiles.one_token_warps if t == 1 and tiles.one_token_warps else tiles.num_warps,
        **pdl_args(x.device, "router"))
    return weights, ids, (shared[1] if shared_gate is not None else None), normed, summed
