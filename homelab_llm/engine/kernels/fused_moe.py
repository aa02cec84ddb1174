"""Fused mixture-of-experts: moe_align, then two grouped GEMMs over the active experts, then the
top-k weighted combine. Reference: moe_ref.moe_experts_ref.

  1. moe_align (moe_align.py) groups the T*K slots by expert in blocks of BLOCK_M rows.
  2. gate_up: each program takes one block (one expert) and BLOCK_N intermediate columns, gathers
     its tokens' rows of x, multiplies by the expert's gate and up columns side by side and
     writes silu(gate) * up: the [T*K, 2I] gate_up tensor never exists. Dense experts may take
     gate and up in one dot over interleaved columns (MoeGemmTiles.paired: one 2 x BLOCK_N MMA a
     K step instead of two, the activation tile read once).
  3. down: the same over the [T*K, I] activations, writing each slot's [H] output row.
  4. combine: out[t] = sum_k topk_weights[t, k] * y[t*K + k], in fp32.
Blocks past the used ones (block_expert -1) do no work, so the grid is fixed by the shapes.

Decode (T*K up to 64 slots, T <= 8 at top-8): a token picks an expert at most once, so with
BLOCK_M >= T every active expert fills exactly one block, and each (expert, column tile) is read
by exactly one program: each active expert's weights are read once per step. That is the
"decode path" — the same kernel with the table's small-M tiles and a grid of ~T*K blocks.
At T <= 8, bf16 and 4-bit experts take the fused decode kernels instead (fused_moe_decode.py: two
launches, the combine folded into down; no tl.dot), MXFP4 experts a GEMV (fused_moe_mx4.py). The
older 4-bit decode GEMV (fused_moe_gemv.py, then a combine launch) stays selectable for comparison.

Weights: dense w13 [E, 2I, H] / w2 [E, H, I] (HF layout, B tiles read transposed), 4-bit
(moe_ref.MoeW4: stacked W4Weight [E, K // 8, N] with per-group scales/biases, dequantized in
registers as in w4a16.py; BLOCK_K is capped at the group size so a tile needs one group row), or
MXFP4 as gpt-oss publishes it (moe_ref.MoeMx4: e2m1 codes [E, N, K // 2] and e8m0 scales per 32
weights, decoded in registers: about a quarter of bf16's bytes resident and read).

4-bit experts on tiles with w_left (sm_90's prefill entry) take the weights as the dots' LEFT
operand: out^T = W^T a^T through w4a16_dot.wleft_steps, whose AND-OR'd nibble pairs are the
MMA's register operand as they are, so the dequantized tile never goes through shared memory
(the right-operand loop stores it there each step, and its MMA waits for it). The activations
then come in "pair order" (w4a16_dot.pair_order: a K step's four nibble-pair slices side by
side), so each slice goes to the MMA straight from its async copy: gate_up's input is reordered
once, and gate_up stores its output already reordered for down's K steps (in registers, where
its column tile is whole steps of down's). Gated, one dot covers gate's columns then up's.
gpt-oss adds per-expert biases on both projections and its clamped SwiGLU (the `clamp` argument).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.common import dot_in_fp32
from homelab_llm.engine.kernels.fused_moe_decode import decode_blocks, moe_decode
from homelab_llm.engine.kernels.fused_moe_gemv import DECODE_MAX_TOKENS, moe_w4_gemv
from homelab_llm.engine.kernels.fused_moe_mx4 import mx4_gemv
from homelab_llm.engine.kernels.moe_align import moe_align
from homelab_llm.engine.kernels.moe_ref import MoeMx4, MoeW4, Mx4Weight, add_shared_ref, expert_shape
from homelab_llm.engine.kernels.pair_order import pair_order
from homelab_llm.engine.kernels.tuning import GemmTiles, MoeGemmTiles, gemm_tiles, tiles_for, uses_ptx
from homelab_llm.engine.kernels.w4a16_pack import W4Weight
from homelab_llm.engine.kernels.w4a16_dot import wleft_steps
from homelab_llm.engine.kernels.w4a16_words import k_rows, load_k_words


@triton.jit
def _expert_tile(w_ptr, s_ptr, b_ptr, e, offs_k, offs_n, k0, n_mask, k_mask,
                 stride_we, stride_wn, stride_wk, stride_se, stride_sg, stride_sn,
                 WFMT: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr):
    """Expert e's weight tile [BLOCK_K, BLOCK_N] (fp32; dense: as stored). WFMT 0 dense
    (w[e, n, k]); 1 int4 words (w[e, k // 8, n], per-group scale and bias); 2 MXFP4 (bytes
    w[e, n, k // 2], two e2m1 codes a byte, low nibble first; an e8m0 scale s[e, n, k // 32])."""
    if WFMT == 1:  # the tile's BLOCK_K // 8 word rows, loaded once and unpacked in registers
        words = load_k_words(w_ptr + e * stride_we, k0, stride_wk, offs_n, n_mask, BLOCK_K)
        q = k_rows(words).to(tl.float32)
        group = k0 // GROUP_SIZE
        s = tl.load(s_ptr + e * stride_se + group * stride_sg + offs_n, mask=n_mask, other=0.0)
        b = tl.load(b_ptr + e * stride_se + group * stride_sg + offs_n, mask=n_mask, other=0.0)
        tile = q * s.to(tl.float32)[None, :] + b.to(tl.float32)[None, :]
    elif WFMT == 2:
        mask = n_mask[None, :] & k_mask[:, None]
        byte = tl.load(w_ptr + e * stride_we + offs_n[None, :] * stride_wn + (offs_k // 2)[:, None],
                       mask=mask, other=0).to(tl.int32)
        code = (byte >> ((offs_k % 2) * 4)[:, None]) & 0xF
        ex = (code >> 1) & 3
        half = (code & 1).to(tl.float32) * 0.5
        mag = tl.where(ex == 0, half, (1.0 + half) * tl.exp2((ex - 1).to(tl.float32)))
        scale = tl.load(s_ptr + e * stride_se + offs_n[None, :] * stride_sn
                        + (offs_k // 32)[:, None] * stride_sg, mask=mask, other=127).to(tl.float32)
        tile = tl.where(code >= 8, -mag, mag) * tl.exp2(scale - 127.0)
    else:  # dense: the stored dtype, so the load can go straight to the MMA's shared tile
        tile = tl.load(w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                       mask=n_mask[None, :] & k_mask[:, None], other=0.0)
    return tile


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, s_ptr, b_ptr, bias_ptr, out_ptr, sorted_ptr, block_expert_ptr,
    num_slots, N, K, top_k, alpha, limit,
    stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sg, stride_sn, stride_be,
    stride_om,
    GATED: tl.constexpr, A_BY_TOKEN: tl.constexpr, WFMT: tl.constexpr, GROUP_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr, PAIRED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
    W_LEFT: tl.constexpr = False, USE_ASM: tl.constexpr = False, SCALED: tl.constexpr = False,
    IZERO: tl.constexpr = False, OUT_PAIRS: tl.constexpr = 0, PAIR_ACCS: tl.constexpr = False,
    JOINED: tl.constexpr = False,
):
    """out[slot, n] for the slots of block pid_m: GATED -> act(a @ w[:, n] + bias, a @ w[:, n + N]
    + bias), act silu(gate) * up, or (CLAMPED, gpt-oss) (clamp(up) + 1) * g * sigmoid(alpha * g)
    with g = min(gate, limit); else a @ w[:, n] (+ bias[n]). PAIRED (GATED): the tile's columns
    alternate gate n, up n, so one dot of 2 x BLOCK_N a K step computes both. W_LEFT (4-bit
    experts): the weights as the dots' left operand (w4a16_dot.wleft_steps, its SCALED / IZERO
    forms, a already in pair order; PAIR_ACCS / JOINED its wgmmas kept in flight); gated, the
    tile is gate's BLOCK_N columns then up's, one loop. OUT_PAIRS > 0: out's columns are stored in pair
    order for K steps of OUT_PAIRS."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < tl.where(e >= 0, num_slots, 0)  # an unused block (e -1) has no rows
    rows = (slots // top_k) if A_BY_TOKEN else slots
    rows = tl.where(valid, rows, 0).to(tl.int64)
    e = tl.maximum(e, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    if PAIRED:
        pair = tl.arange(0, 2 * BLOCK_N)
        offs_w = pid_n * BLOCK_N + pair // 2 + (pair % 2) * N  # gate n, up n, gate n + 1, ...
        w_mask = pid_n * BLOCK_N + pair // 2 < N
    elif W_LEFT and GATED:
        half = tl.arange(0, 2 * BLOCK_N)
        offs_w = pid_n * BLOCK_N + half % BLOCK_N + (half // BLOCK_N) * N  # gate's columns, up's
        w_mask = pid_n * BLOCK_N + half % BLOCK_N < N
    else:
        offs_w = offs_n
        w_mask = n_mask
    k_end = tl.where(tl.max(valid.to(tl.int32), axis=0) > 0, K, 0)  # unused block: no loads
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_N if PAIRED else BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if W_LEFT:
        both = wleft_steps(a_ptr, w_ptr + e * stride_we, s_ptr + e * stride_se, b_ptr + e * stride_se,
                           rows, offs_w, valid, w_mask, 0, k_end, stride_am, stride_wk, stride_sg,
                           GROUP_SIZE, BLOCK_M, offs_w.shape[0], BLOCK_K // 8,
                           a_ptr.dtype.element_ty == tl.float16, DOT_F32, USE_ASM, SCALED, IZERO,
                           X_PAIRS=True, PAIR_ACCS=PAIR_ACCS, JOINED=JOINED)
        if GATED:
            acc, acc_up = tl.split(tl.permute(tl.reshape(both, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
        else:
            acc = both
    else:
        for k0 in range(0, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            a = tl.load(a_ptr + rows[:, None] * stride_am + offs_k[None, :],
                        mask=valid[:, None] & k_mask[None, :], other=0.0)
            w = _expert_tile(w_ptr, s_ptr, b_ptr, e, offs_k, offs_w, k0, w_mask, k_mask, stride_we,
                             stride_wn, stride_wk, stride_se, stride_sg, stride_sn, WFMT, GROUP_SIZE,
                             BLOCK_K)
            if DOT_F32:
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32))
            else:
                acc += tl.dot(a, w.to(a.dtype))
            if GATED and not PAIRED:
                w_up = _expert_tile(w_ptr, s_ptr, b_ptr, e, offs_k, offs_n + N, k0, n_mask, k_mask,
                                    stride_we, stride_wn, stride_wk, stride_se, stride_sg, stride_sn,
                                    WFMT, GROUP_SIZE, BLOCK_K)
                if DOT_F32:
                    acc_up += tl.dot(a.to(tl.float32), w_up.to(tl.float32))
                else:
                    acc_up += tl.dot(a, w_up.to(a.dtype))
    if HAS_BIAS:
        offs_b = offs_w if PAIRED else offs_n
        acc += tl.load(bias_ptr + e * stride_be + offs_b, mask=w_mask if PAIRED else n_mask,
                       other=0.0).to(tl.float32)[None, :]
        if GATED and not PAIRED:
            acc_up += tl.load(bias_ptr + e * stride_be + N + offs_n, mask=n_mask,
                              other=0.0).to(tl.float32)[None, :]
    if PAIRED:
        acc, acc_up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
    if GATED:
        if CLAMPED:
            gate = tl.minimum(acc, limit)
            up = tl.minimum(tl.maximum(acc_up, -limit), limit)
            acc = (up + 1.0) * gate / (1.0 + tl.exp(-alpha * gate))
        else:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if OUT_PAIRS:  # the next GEMM's left-operand loop reads its K steps of OUT_PAIRS in pair
        # order (w4a16_dot.pair_order): the tile reordered in registers, whole-row stores
        tl.static_assert(BLOCK_N % OUT_PAIRS == 0)
        acc = tl.reshape(acc, (BLOCK_M, BLOCK_N // OUT_PAIRS, OUT_PAIRS // 8, 2, 4))
        acc = tl.reshape(tl.permute(acc, (0, 1, 4, 2, 3)), (BLOCK_M, BLOCK_N))
    out = out_ptr + tl.where(valid, slots, 0).to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _moe_combine_kernel(y_ptr, w_ptr, out_ptr, H, stride_y, stride_o,
                        TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for k in range(TOP_K):
        weight = tl.load(w_ptr + t * TOP_K + k).to(tl.float32)
        row = (t * TOP_K + k).to(tl.int64) * stride_y
        acc += weight * tl.load(y_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_tiles(num_slots: int, num_experts: int, device: torch.device,
              experts: str = "dense") -> MoeGemmTiles:
    """Tiles by the rows an expert sees on average: decode shapes get the small-M entry; at
    prefill sizes experts "dense" take the arch's moe_gemm, "w4" its moe_w4_gemm where it has
    them ("mx4" and the rest: `gemm` for both GEMMs)."""
    tiles = gemm_tiles(max(1, num_slots // num_experts), device)
    arch = tiles_for(device)
    if tiles is arch.gemm:
        if experts == "w4" and arch.moe_w4_gemm is not None:
            return arch.moe_w4_gemm
        if experts == "dense" and arch.moe_gemm is not None:
            return arch.moe_gemm
    return MoeGemmTiles(tiles, tiles)


def _experts_format(w13) -> str:
    """moe_tiles' name for a gate_up weight's format."""
    return "w4" if isinstance(w13, MoeW4) else "mx4" if isinstance(w13, MoeMx4) else "dense"


def left_block_k(weight, tiles: GemmTiles, k: int) -> int:
    """The K step of a 4-bit grouped GEMM that takes the left-operand loop (tiles.w_left, whole
    steps of at least 64 inside a group), whose input must then be in pair order
    (w4a16_dot.pair_order); 0 where the GEMM takes the right-operand loop."""
    if not (tiles.w_left and isinstance(weight, W4Weight)):
        return 0
    block_k = min(tiles.block_k, weight.group_size)
    return block_k if block_k >= 64 and k % block_k == 0 and weight.group_size % block_k == 0 else 0


def _gemm(a, weight, out, sorted_slots, block_expert, num_slots, n, k, top_k, gated, by_token,
          tiles: GemmTiles, bias: torch.Tensor | None = None, clamp: tuple[float, float] | None = None,
          paired: bool = False, out_pairs: int = 0):
    """One grouped GEMM launch; weight is a dense [E, N', K] tensor, a stacked W4Weight or an
    Mx4Weight; bias [E, N'] or None; clamp (alpha, limit) selects gpt-oss's activation; paired
    (gated, dense weights): gate and up in one dot. Where left_block_k is set, the weights are
    the dots' left operand (the tiles' scaled / int_zeros / offset form) and `a` is in pair
    order for it. out_pairs: store out in pair order for a next GEMM's K steps of that size
    where the tile's columns are whole steps of it. Returns whether out is in pair order."""
    block_n = tiles.block_n
    form = {}
    if isinstance(weight, Mx4Weight):
        w, s = weight.blocks, weight.scales
        strides = (w.stride(0), w.stride(1), 1, s.stride(0), s.stride(2), s.stride(1))
        wfmt, group, block_k = 2, 32, min(tiles.block_k, 64)
        if gated and tiles_for(a.device).mx4_gated_half_width:
            block_n //= 2
    elif not isinstance(weight, torch.Tensor):
        w, s = weight.qweight, weight.scales
        strides = (w.stride(0), 0, w.stride(1), s.stride(0), s.stride(1), 0)
        wfmt, group, block_k = 1, weight.group_size, min(tiles.block_k, weight.group_size)
        # The gated GEMM holds gate's and up's tiles in two dots (left: one dot of both): half
        # the table's width keeps their accumulators to the table's register budget.
        block_n = block_n // 2 if gated else block_n
        if left_block_k(weight, tiles, k):
            izero = tiles.int_zeros and weight.int_zeros and not tiles.in_flight
            form.update(W_LEFT=True, USE_ASM=uses_ptx(a.device), IZERO=izero,
                        SCALED=(tiles.scaled or tiles.in_flight) and not izero, JOINED=tiles.joined,
                        PAIR_ACCS=tiles.pair_accs and not tiles.joined)
    else:
        w = s = weight
        strides = (w.stride(0), w.stride(1), w.stride(2), 0, 0, 0)
        wfmt, group, block_k = 0, 0, tiles.block_k
    biases = weight.biases if wfmt == 1 else s
    # in registers at the store (scattered stores of reordered columns cost the down GEMM 16%)
    form["OUT_PAIRS"] = out_pairs if out_pairs and block_n % out_pairs == 0 else 0
    alpha, limit = clamp or (1.0, 0.0)
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a, w, s, biases, out if bias is None else bias, out, sorted_slots, block_expert,
        num_slots, n, k, top_k, alpha, limit,
        a.stride(0), *strides, 0 if bias is None else bias.stride(0), out.stride(0),
        GATED=gated, A_BY_TOKEN=by_token, WFMT=wfmt, GROUP_SIZE=group, HAS_BIAS=bias is not None,
        CLAMPED=clamp is not None, PAIRED=gated and paired and wfmt == 0, BLOCK_M=tiles.block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, DOT_F32=dot_in_fp32(),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **form)
    return bool(form["OUT_PAIRS"])


def moe_combine(y: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """y [T*K, H] in slot order -> [T, H]: the router-weighted sum of each token's K rows."""
    t, top_k = topk_weights.shape
    h = y.shape[1]
    out = torch.empty((t, h), dtype=y.dtype, device=y.device)
    block_h = min(1024, triton.next_power_of_2(h))
    _moe_combine_kernel[(t, triton.cdiv(h, block_h))](
        y, topk_weights.float().contiguous(), out, h, y.stride(0), out.stride(0),
        TOP_K=top_k, BLOCK_H=block_h, num_warps=tiles_for(y.device).elementwise_warps)
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor | MoeW4 | MoeMx4, w2: torch.Tensor | None,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              tiles: GemmTiles | MoeGemmTiles | None = None, decode: str = "fused",
              b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
              clamp: tuple[float, float] | None = None,
              shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [T, H] (bf16/fp16) through the router's picks -> [T, H] (see the module doc).
    shared: (a shared expert's output [T, H], its gate [T]) added as moe_ref.add_shared_ref
    does -- inside the decode kernels' combine when they run.
    tiles (sweeps): one GemmTiles for both GEMMs, or a MoeGemmTiles; None: the arch table's.
    decode (T <= 8, benchmarks compare them): "fused" the decode kernels, "gemv" the older 4-bit
    GEMV + combine (dense experts: the GEMM path), "gemm" the tl.dot GEMM path.
    gpt-oss: b13 [E, 2I] / b2 [E, H] expert biases and clamp = (alpha, limit)."""
    t, hidden = x.shape
    top_k = topk_ids.shape[1]
    if isinstance(w13, (MoeW4, MoeMx4)):
        gate_up, down = w13.w13, w13.w2
    else:
        gate_up, down = w13, w2
    num_experts, inter = expert_shape(w13)
    num_slots = t * top_k
    if t == 0:
        return torch.empty_like(x)
    x = x.contiguous()
    if decode not in ("fused", "gemv", "gemm"):
        raise ValueError(f"fused_moe: decode is 'fused', 'gemv' or 'gemm', got {decode!r}")
    plain = b13 is None and b2 is None and clamp is None
    small = tiles is None and t <= DECODE_MAX_TOKENS and decode != "gemm"
    if plain and small and decode == "fused" and not isinstance(w13, MoeMx4):
        return moe_decode(x, w13, w2, topk_weights, topk_ids, shared=shared)
    if shared is not None:
        out = fused_moe(x, w13, w2, topk_weights, topk_ids, tiles, decode, b13, b2, clamp)
        return add_shared_ref(out, *shared)
    if isinstance(w13, MoeW4) and plain and small:
        return w4_decode(x, w13, topk_weights, topk_ids)
    if isinstance(w13, MoeMx4) and clamp is not None and small:
        return mx4_decode(x, w13, topk_weights, topk_ids, b13, b2, clamp)
    if isinstance(tiles, GemmTiles):
        tiles = MoeGemmTiles(tiles, tiles)
    tiles = tiles or moe_tiles(num_slots, num_experts, x.device, _experts_format(w13))
    sorted_slots, block_expert, _ = moe_align(topk_ids, num_experts, tiles.up.block_m)
    act = torch.empty((num_slots, inter), dtype=x.dtype, device=x.device)
    up_k, down_k = left_block_k(gate_up, tiles.up, hidden), left_block_k(down, tiles.down, inter)
    if not _gemm(pair_order(x, up_k) if up_k else x, gate_up, act, sorted_slots, block_expert,
                 num_slots, inter, hidden, top_k, gated=True, by_token=True, tiles=tiles.up,
                 bias=b13, clamp=clamp, paired=tiles.paired, out_pairs=down_k) and down_k:
        act = pair_order(act, down_k)
    y = torch.empty((num_slots, hidden), dtype=x.dtype, device=x.device)
    _gemm(act, down, y, sorted_slots, block_expert, num_slots, hidden, inter, top_k,
          gated=False, by_token=False, tiles=tiles.down, bias=b2)
    return moe_combine(y, topk_weights)


def w4_decode(x: torch.Tensor, w4: MoeW4, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              **gemv_tiles) -> torch.Tensor:
    """The older 4-bit decode path: align (decode_blocks), two grouped GEMVs, a combine launch.
    gemv_tiles (block_n, rows, split, num_warps) override the table for sweeps."""
    t, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, inter = w4.w13.qweight.shape[0], w4.w13.qweight.shape[2] // 2
    num_slots = t * top_k
    sorted_slots, block_expert, block_m = decode_blocks(topk_ids, num_experts)
    act = torch.empty((num_slots, inter), dtype=x.dtype, device=x.device)
    moe_w4_gemv(x, w4.w13, act, sorted_slots, block_expert, num_slots, inter, top_k,
                gated=True, by_token=True, block_m=block_m, **gemv_tiles)
    y = torch.empty((num_slots, hidden), dtype=x.dtype, device=x.device)
    moe_w4_gemv(act, w4.w2, y, sorted_slots, block_expert, num_slots, hidden, top_k,
                gated=False, by_token=False, block_m=block_m, **gemv_tiles)
    return moe_combine(y, topk_weights)


def mx4_decode(x: torch.Tensor, mx4: MoeMx4, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               b13: torch.Tensor | None, b2: torch.Tensor | None,
               clamp: tuple[float, float], **gemv_tiles) -> torch.Tensor:
    """gpt-oss's MXFP4 experts at decode: two GEMVs over every (token, pick) slot, combine.
    gemv_tiles (block_n, groups, num_warps) override the defaults for sweeps."""
    t, hidden = x.shape
    top_k = topk_ids.shape[1]
    _, inter = expert_shape(mx4)
    ids = topk_ids.reshape(-1).to(torch.int32)
    act = torch.empty((ids.numel(), inter), dtype=x.dtype, device=x.device)
    mx4_gemv(x, mx4.w13, act, ids, inter, top_k, gated=True, by_token=True, bias=b13, clamp=clamp,
             **gemv_tiles)
    y = torch.empty((ids.numel(), hidden), dtype=x.dtype, device=x.device)
    mx4_gemv(act, mx4.w2, y, ids, hidden, top_k, gated=False, by_token=False, bias=b2, clamp=clamp,
             **gemv_tiles)
    return moe_combine(y, topk_weights)
