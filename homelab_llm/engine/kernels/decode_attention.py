"""Paged decode attention, flash-decoding style: one query token per sequence (or per row of a
speculative verify group, below).

Stage 1 splits each sequence's KV into NUM_SPLITS ranges; a program owns one (sequence, KV head,
split) and handles the whole group of query heads that share that KV head, so every K/V row is
read from memory once per group rather than once per query head (GQA). It writes a partial output
and its log-sum-exp. Stage 2 merges the splits (decode_merge.py: a second kernel, or fused into
the last split program of each group). Splitting is what keeps a GPU busy at batch 1 with
a long context: without it there would be only B * num_kv_heads programs. A decode graph fixes the
split count for every length, so a split past a short sequence's end only writes an -inf
log-sum-exp (no q rotation, no partial row) and the merge skips it.

K/V rows are gathered token by token through the page table, so any page size works. int8 KV is
dequantized inside the dot products: K's per-token scale multiplies the scores, V's multiplies the
probabilities, which is exact because the scale is constant along head_dim. Variants the arch
table (tuning.AttentionTiles) or a benchmark's tiles switch on: int8 x int8 score dots and scale
prefetch for int8 KV, q prepared in the first tile (decode_steps.py), the fused merge (decode_merge.py).

A sliding-window layer (window > 0) reads only the last `window` keys: the splits cover
[seq_len - window, seq_len), so pages below it are never touched and may be freed. Sinks (gpt-oss)
are a per-head logit with no value: split 0 starts its running max and sum from it (max = sink,
sum = 1), which the merge then counts once.

The step's own K/V (new_kv, one-token rows): q and the new rows arrive unrotated; the program
whose split ends at the new token rotates its KV head's row and stores it with the V row (the
store kv_store.rope_store_kv runs, kv_store.store_rotated_kv), then reads the cache after a
barrier, and every program rotates (with q/k norms, normalizes) its own q heads in registers:
rope_store_kv's launch is gone. AttentionTiles.new_kv says where dispatch takes it.

Verify steps (rows_per_seq = K+1): a sequence's last token and its K drafts are K+1 consecutive
rows over one page table, row j seeing the first seq_len_j keys. One program takes the whole
group: its tile holds (K+1) x GROUP query rows, so each K/V row is read once per group rather
than once per verify row, and a per-row mask (key < seq_len_j) is the causal mask inside the block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.common import (attention_extras, dot_in_fp32, kv_cache_args,
                                               kv_for_dots, load_paged_kv, load_token_scales, next_pow2,
                                               page_rows, per_tile, scaled_pv, scaled_scores, sink_start,
                                               unrotate_out)
from homelab_llm.engine.kernels.decode_steps import (decode_q, int8_dot_scores, prepared_q_zeros, tile_kv,
                                                     tile_pages, tile_scales)
from homelab_llm.engine.kernels.decode_merge import decode_tickets, finish_split, merge_partials
from homelab_llm.engine.kernels.elementwise import sigmoid_mul
from homelab_llm.engine.kernels.kv_store import NewKV, new_kv_launch, rope_q_tile, store_new_kv_head
from homelab_llm.engine.kernels.launch_fit import launch_fitting_stages
from homelab_llm.engine.kernels.pair_order import pair_check, pair_position
from homelab_llm.engine.kernels.pdl import pdl_args, pdl_enter
from homelab_llm.engine.kernels.tuning import (AttentionTiles, decode_tiles, device_sms, kv_split_cap,
                                               q_each_tile, tiles_for)

_LOG2E = 1.4426950408889634
# Query rows one program's tile may hold (verify rows x query heads per KV head): past this a
# verify group would outgrow registers and RDNA3's 64 KB LDS, and its rows run one per program.
MAX_TILE_ROWS = 64


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, page_table_ptr, seq_lens_ptr, query_start_ptr,
    part_out_ptr, part_lse_ptr, out_ptr, sinks_ptr, ticket_ptr,
    key_ptr, value_ptr, pos_ptr, cos_sin_ptr, slot_ptr, qw_ptr, kw_ptr, scratch_ptr, eps, min_amax,
    stride_kt, stride_kh_in, stride_vt, stride_vh_in, stride_c,
    sm_scale_log2, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_vd,
    stride_sp, stride_ss, stride_sh,
    stride_pt,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, INT8_KV: tl.constexpr, DOT_F32: tl.constexpr,
    ROTATE: tl.constexpr, LOG2_D: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    ROWS: tl.constexpr, INT8_DOT: tl.constexpr, PREFETCH_SCALES: tl.constexpr,
    PREFETCH_KV: tl.constexpr, FUSED_MERGE: tl.constexpr, LATE_Q: tl.constexpr,
    MERGE_UNROTATES: tl.constexpr, PDL: tl.constexpr = False, NEW_KV: tl.constexpr = False,
    QK_NORM: tl.constexpr = False, HALF: tl.constexpr = 1, HALF_PAD: tl.constexpr = 1,
    TAIL_PAD: tl.constexpr = 1, NUM_KV_HEADS: tl.constexpr = 1, PAIR_BLOCK: tl.constexpr = 0,
    KV_ALIGN: tl.constexpr = 1, KV_CVT: tl.constexpr = 0, TILE_Q: tl.constexpr = False,
):
    pdl_enter(PDL)
    # The program's query rows: ROWS consecutive rows (one sequence's verify rows, sharing its
    # page table) times the GROUP query heads of this KV head, as GROUP_PAD rows of one tile.
    # INT8_DOT, PREFETCH_SCALES (int8 KV only), PREFETCH_KV, LATE_Q, MERGE_UNROTATES and FUSED_MERGE
    # (ROWS 1, NUM_SPLITS > 1 only): the variants of decode_steps.py and decode_merge.py.
    first = tl.program_id(0) * ROWS
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP

    offs_g = tl.arange(0, GROUP_PAD)
    g_mask = offs_g < ROWS * GROUP
    row = first + offs_g // GROUP  # the query row of each tile row
    heads = kv_head * GROUP + offs_g % GROUP
    row_len = tl.load(seq_lens_ptr + row, mask=g_mask, other=0)
    seq_len = tl.max(row_len, axis=0)
    q_row = tl.load(query_start_ptr + row, mask=g_mask, other=0).to(tl.int64)
    lo = 0
    if HAS_WINDOW:
        # from the first key of the page holding the window's first: every tile then starts at
        # a multiple of KV_ALIGN (the keys below the window are masked per row below)
        lo = tl.maximum(tl.min(tl.where(g_mask, row_len, seq_len), axis=0) - window, 0)
        lo = lo // PAGE_SIZE * PAGE_SIZE
    # Splits are whole BLOCK_N tiles so only the last tile of a sequence needs a mask.
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    # KV_ALIGN = min(BLOCK_N, PAGE_SIZE): a tile's slots run in whole pages (or inside one), which
    # lets a V cache stored dim-major (slots contiguous) load as vectors
    start = tl.multiple_of(lo + split * per_split, KV_ALIGN)
    end = tl.minimum(start + per_split, seq_len)
    if NUM_SPLITS > 1:
        empty = start >= end
        if HAS_SINKS:
            empty = empty & (split > 0)  # split 0 carries the sink term even without keys
        if empty:
            # No keys here (a short context under a graph's fixed split count): only the -inf
            # lse, which tells the merge to skip this split's (unwritten) partial output.
            part = (row.to(tl.int64) * num_q_heads + heads) * NUM_SPLITS + split
            tl.store(part_lse_ptr + part, tl.full([GROUP_PAD], float("-inf"), tl.float32), mask=g_mask)
            if FUSED_MERGE:
                finish_split(part_out_ptr, part_lse_ptr, out_ptr, ticket_ptr, first.to(tl.int64),
                             tl.max(q_row, axis=0), kv_head, num_q_heads, stride_ot, stride_oh,
                             GROUP, HEAD_DIM, HEAD_DIM_PAD, NUM_SPLITS, ROTATE and MERGE_UNROTATES, LOG2_D,
                             PAIR_BLOCK)
            return

    t = tl.max(q_row, axis=0)  # (ROWS 1) the row's token
    if NEW_KV:
        # The step's new token (rope_store_kv's work, folded in): the program whose keys end at
        # it rotates its K row and stores it and the V row into the cache, and reads them back
        # from there with the others after a barrier; every program rotates its own q heads.
        if (start <= seq_len - 1) & (seq_len - 1 < end):
            store_new_kv_head(t, kv_head, key_ptr, value_ptr, pos_ptr, cos_sin_ptr, slot_ptr, k_ptr,
                              v_ptr, ks_ptr, vs_ptr, kw_ptr, eps, scratch_ptr, stride_kt,
                              stride_kh_in, stride_vt, stride_vh_in, stride_c, stride_kp, stride_ks,
                              stride_kh, stride_vp, stride_vs, stride_vh, stride_vd, stride_sp, stride_ss,
                              stride_sh, min_amax, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM,
                              HEAD_DIM_PAD, HALF, HALF_PAD, TAIL_PAD, INT8_KV, ROTATE, LOG2_D,
                              QK_NORM)
            tl.debug_barrier()  # the row is in the cache before any thread loads it
    row_offset = first * stride_pt
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    if PREFETCH_SCALES or PREFETCH_KV:  # the first tile's loads and the second's pages, before q's math
        pages = tile_pages(page_table_ptr, row_offset, start, end, BLOCK_N, PAGE_SIZE)
        if PREFETCH_SCALES:
            ks_next, vs_next = tile_scales(ks_ptr, vs_ptr, pages, start, end, kv_head, stride_sp,
                                           stride_ss, stride_sh, BLOCK_N, PAGE_SIZE)
        if PREFETCH_KV:
            k_next, v_next = tile_kv(k_ptr, v_ptr, pages, start, end, offs_d, d_mask, kv_head, stride_kp,
                                     stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_vd,
                                     BLOCK_N, PAGE_SIZE)
        pages_next = tile_pages(page_table_ptr, row_offset, start + BLOCK_N, end, BLOCK_N, PAGE_SIZE)
    if NEW_KV:
        q_raw = rope_q_tile(q_ptr, t, heads, g_mask, offs_d, pos_ptr, cos_sin_ptr, stride_c,
                            stride_qt, stride_qh, qw_ptr, eps, HALF, HEAD_DIM, QK_NORM)
    else:
        q_raw = tl.load(q_ptr + q_row[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                        mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if LATE_Q:  # placeholders of the prepared q's types; the first tile prepares it
        q = prepared_q_zeros(q_raw, INT8_KV, DOT_F32)
        q_hi = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.int8)
        q_lo = q_hi
        q_step = tl.zeros([GROUP_PAD], tl.float32)
    else:
        q, q_hi, q_lo, q_step = decode_q(q_raw, offs_d, sm_scale_log2, HEAD_DIM, LOG2_D, ROTATE, INT8_KV,
                                         DOT_F32, INT8_DOT)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    if HAS_SINKS:
        m_i, l_i = sink_start(sinks_ptr, heads, g_mask, split == 0, m_i, l_i)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n0 = tl.multiple_of(n0, KV_ALIGN)
        if LATE_Q:
            if n0 == start:  # behind the first tiles' loads, which the pipeliner issues before the loop
                q, q_hi, q_lo, q_step = decode_q(q_raw, offs_d, sm_scale_log2, HEAD_DIM, LOG2_D, ROTATE,
                                                 INT8_KV, DOT_F32, INT8_DOT)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        if PREFETCH_KV:  # this tile's rows came a tile ago; request the next tile's now
            k, v = kv_for_dots(k_next, v_next, q, INT8_KV, DOT_F32, INT8_DOT, KV_CVT)
            k_next, v_next = tile_kv(k_ptr, v_ptr, pages_next, n0 + BLOCK_N, end, offs_d, d_mask, kv_head,
                                     stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_vd,
                                     BLOCK_N, PAGE_SIZE)
        else:
            k, v, page, slot = load_paged_kv(
                k_ptr, v_ptr, page_table_ptr, row_offset, offs_n, n_mask, page_rows(offs_n, end, PAGE_SIZE),
                offs_d, d_mask, kv_head, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                stride_vd, q,
                PAGE_SIZE, INT8_KV, DOT_F32, INT8_DOT, KV_CVT)
        ks = sm_scale_log2  # the per-token scales of int8 KV (unused otherwise)
        vs = sm_scale_log2
        if PREFETCH_SCALES:  # as the rows: this tile's scales came a tile ago
            ks, vs = ks_next, vs_next
            ks_next, vs_next = tile_scales(ks_ptr, vs_ptr, pages_next, n0 + BLOCK_N, end, kv_head,
                                           stride_sp, stride_ss, stride_sh, BLOCK_N, PAGE_SIZE)
        elif INT8_KV:
            if PREFETCH_KV:  # (page, slot) of this tile, which the prefetching loop did not keep
                page = tile_pages(page_table_ptr, row_offset, n0, end, BLOCK_N, PAGE_SIZE).to(tl.int64)
                slot = offs_n % PAGE_SIZE
            ks = load_token_scales(ks_ptr, page, slot, kv_head, stride_sp, stride_ss, stride_sh, n_mask)
            vs = load_token_scales(vs_ptr, page, slot, kv_head, stride_sp, stride_ss, stride_sh, n_mask)
        if PREFETCH_SCALES or PREFETCH_KV:
            pages_next = tile_pages(page_table_ptr, row_offset, n0 + 2 * BLOCK_N, end, BLOCK_N, PAGE_SIZE)
        # (TILE_Q: q, or its int8 halves, enter the dot's operand layout in this tile)
        if INT8_DOT:
            scores = int8_dot_scores(per_tile(q_hi, n0 >= start, TILE_Q), per_tile(q_lo, n0 >= start, TILE_Q),
                                     q_step, k, ks)  # [GROUP_PAD, BLOCK_N]
        else:
            scores = scaled_scores(per_tile(q, n0 >= start, TILE_Q), k, ks, sm_scale_log2, INT8_KV, DOT_F32)
        if ROWS == 1 and not HAS_WINDOW:
            scores = tl.where(n_mask[None, :], scores, float("-inf"))
        else:  # each row sees its own keys: row j of a verify group the first seq_len_j (causal)
            visible = n_mask[None, :] & (offs_n[None, :] < row_len[:, None])
            if HAS_WINDOW:
                visible = visible & (offs_n[None, :] >= row_len[:, None] - window)
            scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # a row with no visible key in this tile yet keeps max -inf: exponentiate against 0
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(scores - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = scaled_pv(acc, alpha, p, v, vs, INT8_KV)
        m_i = m_new

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1 or not MERGE_UNROTATES:
        out = unrotate_out(out, offs_d, HEAD_DIM, LOG2_D, ROTATE, DOT_F32)
    if NUM_SPLITS == 1:  # nothing to merge: the final output, no partials and no second kernel
        # (PAIR_BLOCK: each row's values in the out projection's pair order, rows contiguous)
        offs_o = pair_position(heads[:, None] * stride_oh + offs_d[None, :], PAIR_BLOCK)
        tl.store(out_ptr + q_row[:, None] * stride_ot + offs_o,
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
        return
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    # partials: [rows, Hq, NUM_SPLITS, HEAD_DIM_PAD] and [rows, Hq, NUM_SPLITS], contiguous; with
    # MERGE_UNROTATES still rotated (int8 KV): the merge is linear, so it un-rotates once per
    # output instead of once per split
    part = (row.to(tl.int64) * num_q_heads + heads) * NUM_SPLITS + split
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], out, mask=g_mask[:, None])
    tl.store(part_lse_ptr + part, lse, mask=g_mask)
    if FUSED_MERGE:
        finish_split(part_out_ptr, part_lse_ptr, out_ptr, ticket_ptr, first.to(tl.int64),
                     tl.max(q_row, axis=0), kv_head, num_q_heads, stride_ot, stride_oh,
                     GROUP, HEAD_DIM, HEAD_DIM_PAD, NUM_SPLITS, ROTATE and MERGE_UNROTATES, LOG2_D,
                     PAIR_BLOCK)


def choose_num_splits(batch: int, num_kv_heads: int, device: torch.device,
                      max_seq_len: int | None = None) -> int:
    """Enough (sequence, head, split) programs to cover the device about twice; a power of two so
    only a handful of kernel variants ever compile. Depends on max_seq_len only when given, so a
    CUDA graph captured without it stays valid for every length."""
    tiles = tiles_for(device)
    want = -(-2 * device_sms(device) // max(1, batch * num_kv_heads))
    if max_seq_len is not None:
        # A split shorter than two tiles costs more in the merge than it saves.
        want = min(want, max(1, max_seq_len // (2 * tiles.decode.block_n)))
    return max(1, min(next_pow2(want), kv_split_cap(device, num_kv_heads)))


def paged_decode_attention(
    q: torch.Tensor,  # [T, Hq, D], one token per sequence (row query_start_loc[b])
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [B, max_pages] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32
    softmax_scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    rows_per_seq: int = 1,
    tiles: AttentionTiles | None = None,
    gate: torch.Tensor | None = None,
    new_kv: NewKV | None = None,
    pair_block: int = 0,
) -> torch.Tensor:
    """window > 0: a sliding-window layer (the last `window` keys); sinks [Hq] float32 logits.
    gate [T, Hq, D] (a strided view is fine): the output times sigmoid(gate), in the merge kernel
    (one launch fewer; elementwise.sigmoid_mul after the split kernel when there is no merge).
    rows_per_seq > 1: the rows come in groups of that many consecutive one-token rows sharing a
    page table (a verify step's K+1 rows), attended by one program per group and KV head.
    tiles: the split kernel's tiles instead of the arch table's (benchmarks/int8kv_decode.py).
    new_kv: the step's K/V rows, unrotated and not yet in the cache, and q unrotated (with
    new_kv.qk_norm the projection's q, not normalized): each sequence's last split program
    rotates and stores them (kv_store.rope_store_kv's work, one launch fewer a layer), every
    program rotates its q heads in registers; one-token rows only (rows_per_seq 1).
    pair_block: each row's Hq * D values stored in that pair order (kernels/pair_order.py), the
    out projection's W4A16 few-row kernel's input (dispatch.w4a16_rows_pairs_block), by the
    kernel that writes the final output (the split kernel, the merge or the gate's launch);
    `out`, if given, contiguous."""
    batch = seq_lens.shape[0]
    if new_kv is not None and rows_per_seq != 1:
        raise ValueError(f"new K/V rows go with one-token rows only, got rows_per_seq={rows_per_seq}")
    if rows_per_seq < 1 or batch % rows_per_seq:
        raise ValueError(f"{batch} decode rows do not split into groups of rows_per_seq={rows_per_seq}")
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not divide into {num_kv_heads} KV heads")
    if next_pow2(rows_per_seq * num_q_heads // num_kv_heads) > MAX_TILE_ROWS:
        rows_per_seq = 1  # rows are independent queries: one program each is the same result
    if q.stride(2) != 1:
        raise ValueError("q head_dim axis must be contiguous")
    if gate is not None and (gate.shape != q.shape or gate.stride(2) != 1):
        raise ValueError(f"gate must be [T, Hq, D] = {tuple(q.shape)} with D contiguous, got "
                         f"{tuple(gate.shape)}")
    kv = kv_cache_args(k_cache, v_cache, k_scale, v_scale, head_dim)
    extras = attention_extras(window, sinks, num_q_heads, q)
    group = num_q_heads // num_kv_heads
    arch = tiles_for(q.device)
    # the tiles by head size and sequences (tuning.decode_tiles); verify groups look up as one
    # sequence: the wide-head tiles were timed on one-token rows only (BENCHMARKS 58.3)
    sequences = batch if rows_per_seq == 1 else 1
    split_tiles = decode_tiles(q.device, kv.int8, head_dim, sequences) if tiles is None else tiles
    if num_splits is None:
        if window > 0 and max_seq_len is not None:
            max_seq_len = min(max_seq_len, window)
        num_splits = choose_num_splits(batch // rows_per_seq, num_kv_heads, q.device, max_seq_len)
    if num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    d_pad = next_pow2(head_dim)
    pair_block = pair_check(num_q_heads * head_dim, pair_block)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if pair_block else torch.empty_like(q)
    elif pair_block and not out.is_contiguous():
        raise ValueError("pair order is written into a contiguous output")
    if batch == 0:
        return out
    fused = split_tiles.fused_merge and rows_per_seq == 1 and num_splits > 1
    if num_splits == 1:  # the split kernel writes `out` itself
        part_out = part_lse = out
    else:
        part_out = torch.empty((batch, num_q_heads, num_splits, d_pad), dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    tickets = decode_tickets(q.device, batch, num_kv_heads) if fused else out
    new_args, new_meta = new_kv_launch(new_kv, q, num_kv_heads, kv.rotate)
    merged = num_splits > 1 and not fused  # the merge kernel writes the output (and gates it)
    # a gate without the merge kernel is its own launch after the split kernel: that one writes
    # the pair order, the split kernel k order
    split_pairs = pair_block if gate is None or merged else 0

    def launch(num_stages: int) -> None:
        _decode_split_kernel[(batch // rows_per_seq, num_kv_heads, num_splits)](
            q, k_cache, v_cache, kv.k_scale, kv.v_scale,
            page_table, seq_lens, query_start_loc, part_out, part_lse, out, extras.sinks, tickets,
            *new_args, softmax_scale * _LOG2E, window,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), *kv.strides,
            page_table.stride(0),
            PAGE_SIZE=page_size, GROUP=group, GROUP_PAD=max(16, next_pow2(group * rows_per_seq)),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad, BLOCK_N=split_tiles.block_n,
            NUM_SPLITS=num_splits, INT8_KV=kv.int8, DOT_F32=dot_in_fp32(),
            ROTATE=kv.rotate, LOG2_D=kv.log2_d, HAS_WINDOW=extras.has_window, HAS_SINKS=extras.has_sinks,
            ROWS=rows_per_seq, INT8_DOT=kv.int8 and split_tiles.int8_dot,
            PREFETCH_SCALES=kv.int8 and split_tiles.prefetch_scales, PREFETCH_KV=split_tiles.prefetch_kv,
            FUSED_MERGE=fused, LATE_Q=split_tiles.late_q, MERGE_UNROTATES=split_tiles.merge_unrotates,
            num_warps=split_tiles.num_warps, num_stages=num_stages,
            **({"maxnreg": split_tiles.max_regs} if split_tiles.max_regs else {}),
            **pdl_args(q.device), **new_meta, PAIR_BLOCK=split_pairs,
            KV_ALIGN=min(split_tiles.block_n, page_size), KV_CVT=kv.int8_convert(q.device),
            TILE_Q=q_each_tile(split_tiles, head_dim, kv.int8),
        )

    launch_fitting_stages(launch, (q.device, q.dtype, k_cache.dtype, head_dim, group, rows_per_seq, num_splits > 1,
                                   split_tiles, new_kv is not None, split_pairs), split_tiles.num_stages)
    if merged:  # the merge applies the gate too
        merge_partials(part_out, part_lse, out, query_start_loc, head_dim,
                       kv.rotate and split_tiles.merge_unrotates, kv.log2_d,
                       arch.elementwise_warps, gate, pair_block)
    elif gate is not None:  # no second kernel ran: the gate in one launch of its own
        out = sigmoid_mul(out.view(out.shape[0], -1), gate, pair_block).view(out.shape)
    return out
