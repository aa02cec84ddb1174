"""The few-row W4A16 kernel's chained epilogues (w4a16_dot.py): a decoder's RMSNorms and its
SiLU-and-mul folded into the linears on either side of them, so a batch-3-64 decode step runs
no norm or act-and-mul launch between two layers.

Why (issue 19, docs/BENCHMARKS.md 39.5): at batch 8 the Llama-3.1-8B W4A16 step launched 65
RMSNorms and 32 SiLU-and-muls (~204 us of a 3.4 ms step) beside its 128 few-row linears; batch 1
folds them into the packed-half GEMV's prologue, but a few-row program cannot: the norm needs a
row's whole sum of squares before the first K step, and every column block would redo the
act-and-mul of its x tiles inside an issue-bound loop. Neither is needed. The norm's 1 / rms is
a per-row factor of the dot, out[m, :] = rstd[m] (s[m, :] * w) W, so the linear before the norm
forms s * w (and the squares) in its epilogue, once an output element, and the linear after it
scales its accumulator by rstd; and a gate | up program whose columns are half gate, half up
features (the same features of both halves) has both operands of the act-and-mul in its tile.

Forms (EPI, a constexpr of _w4a16_dot_kernel; a tile t of x W, fp32, after the split-K sum):
  NORM_OUT (1)  the linear before a norm (o_proj, down_proj, TP 1, no bias): the next norm's
                residual add s = round(round(t) + residual), stored (the next residual); the
                squares of s summed over the tile's columns, one fp32 partial a row and column
                block (parts [column blocks, M]); and s * norm_weight rounded, stored in the next
                linear's pair order (OUT_PAIRS). The linear's own output is never stored.
  ACT_OUT (2)   gate | up: program n's columns are gate features [n H, n H + H) and the same up
                features (act_columns, H = BLOCK_N / 2); act(round(gate)) * round(up) rounded, as
                the act-and-mul kernel computes it from the stored rows, stored in the down
                projection's pair order. The gate | up rows are never stored.
  NORM_IN       (with either form, or none) the linear after a norm: x is s * norm_weight, and the
                tile's total is scaled by each row's rstd, which the linear before computed:
                its row block's last column block to finish sums the parts into
                rsqrt(sum / N + eps) (row_norm_scale), so the program that finishes a tile here
                loads BLOCK_M floats, nothing before or through the K loop.

Rounding against the separate kernels: s, its squares' fp32 sum (in another order) and the
act-and-mul are theirs; the norm's output is rounded once as s * w instead of s * rstd * w, and
rstd applied to the fp32 sum: a bf16 rounding apart per element (tests bound the rows).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.elementwise import gate_act
from homelab_llm.engine.kernels.pair_order import pair_position
from homelab_llm.engine.kernels.w4a16_gemv import split_slot, split_total, store_or_reduce

NORM_OUT = 1
ACT_OUT = 2
ACTS = {"silu": 1, "gelu_tanh": 2}  # ACT


@dataclasses.dataclass(frozen=True)
class DotChain:
    """A w4a16_dot launch's chained epilogue (module docstring); the tensors a form does not use
    stay None. epi: 0, NORM_OUT or ACT_OUT; act: "silu" or "gelu_tanh" (ACT_OUT); out_pairs: the
    pair order y is stored in (the next linear's K step, 0: k order). NORM_OUT: residual,
    norm_weight and eps (the next norm's), summed and y [M, N], parts [column blocks, M] fp32
    (scratch) and rstd [M] fp32 (the next linear's rstd_in). ACT_OUT: y [M, N / 2]. NORM_IN:
    rstd_in [M] (the norm before this linear)."""

    epi: int = 0
    act: str = "silu"
    out_pairs: int = 0
    residual: torch.Tensor | None = None
    norm_weight: torch.Tensor | None = None
    eps: float = 0.0
    summed: torch.Tensor | None = None
    y: torch.Tensor | None = None
    parts: torch.Tensor | None = None
    rstd: torch.Tensor | None = None
    rstd_in: torch.Tensor | None = None

    def meta(self, n: int, block_n: int, grid_n: int) -> dict:
        """The launch's constexprs for n output columns in grid_n programs of block_n."""
        if self.epi == ACT_OUT and (n // 2) % (block_n // 2):
            raise ValueError(f"act-and-mul epilogue: {n // 2} features are not whole half blocks of {block_n}")
        if self.epi == NORM_OUT and self.parts is not None and self.parts.shape[0] != grid_n:
            raise ValueError(f"norm epilogue: {self.parts.shape[0]} partial sums a row for {grid_n} column blocks")
        # PARTS_BLOCK only shapes NORM_OUT's read of the partial sums: elsewhere 1, so launches
        # of every width share one compiled kernel instead of one per power of two of grid_n
        parts = triton.next_power_of_2(grid_n) if self.epi == NORM_OUT else 1
        return dict(EPI=self.epi, ACT=ACTS[self.act], NORM_IN=self.rstd_in is not None,
                    OUT_PAIRS=self.out_pairs, PARTS_BLOCK=parts)

    def runtime(self, n: int) -> tuple:
        """The kernel's chained-epilogue arguments, after num_splits."""
        return (self.residual, self.norm_weight, self.summed, self.y, self.parts, self.rstd, self.rstd_in,
                n // 2, self.eps, 0 if self.residual is None else self.residual.stride(0),
                0 if self.y is None else self.y.stride(0))


@triton.jit
def act_columns(pid_n, act_half, BLOCK_N: tl.constexpr):
    """ACT_OUT's output columns of program pid_n: gate features [pid_n H, pid_n H + H) then the
    same features of up (act_half on), H = BLOCK_N / 2; two contiguous runs, each starting at a
    multiple of H (act_half is one), so the weight loads stay vectors."""
    H: tl.constexpr = BLOCK_N // 2
    i = tl.arange(0, BLOCK_N)
    offs = pid_n * H + i % H + (i // H) * act_half
    return tl.max_contiguous(tl.multiple_of(offs, H), H)


@triton.jit
def finish_tile(part, out_ptr, ws_ptr, ticket_ptr, row_ticket, pid_k, pid_n, offs_m, offs_n, M, N,
                stride_om, SPLIT, res_ptr, nw_ptr, sum_ptr, y_ptr, parts_ptr, rstd_ptr, rstd_in_ptr,
                act_half, eps, stride_rm, stride_ym, EPI: tl.constexpr, ACT: tl.constexpr,
                NORM_IN: tl.constexpr, OUT_PAIRS: tl.constexpr, PARTS_BLOCK: tl.constexpr):
    """The few-row kernel's epilogue: plain, store_or_reduce; else the tile's total, by the
    program that has it (SPLIT 1: every program; else the tile's last to take its ticket, as
    store_or_reduce does), scaled by NORM_IN's rstd (loaded here, by that program only) and
    stored as is or in the chained form (module docstring). row_ticket: NORM_OUT's counter of
    this row block (row_norm_scale)."""
    if EPI == 0 and not NORM_IN:
        store_or_reduce(part, out_ptr, ws_ptr, ticket_ptr, pid_k, offs_m, offs_n, M, N, stride_om, SPLIT)
    elif SPLIT == 1:
        finish_total(part, out_ptr, res_ptr, nw_ptr, sum_ptr, y_ptr, parts_ptr, rstd_ptr, rstd_in_ptr, row_ticket,
                     pid_n, offs_m, offs_n, M, N, stride_om, act_half, eps, stride_rm, stride_ym, EPI, ACT,
                     NORM_IN, OUT_PAIRS, PARTS_BLOCK)
    else:
        ticket = split_slot(part, ws_ptr, ticket_ptr, pid_k, offs_m, offs_n, M, N)
        if ticket == SPLIT - 1:
            total = split_total(part, ws_ptr, offs_m, offs_n, M, N, SPLIT, 8192, 8)
            finish_total(total, out_ptr, res_ptr, nw_ptr, sum_ptr, y_ptr, parts_ptr, rstd_ptr, rstd_in_ptr,
                         row_ticket, pid_n, offs_m, offs_n, M, N, stride_om, act_half, eps, stride_rm,
                         stride_ym, EPI, ACT, NORM_IN, OUT_PAIRS, PARTS_BLOCK)
            tl.atomic_xchg(ticket_ptr, 0)


@triton.jit
def finish_total(t, out_ptr, res_ptr, nw_ptr, sum_ptr, y_ptr, parts_ptr, rstd_ptr, rstd_in_ptr, row_ticket,
                 pid_n, offs_m, offs_n, M, N, stride_om, act_half, eps, stride_rm, stride_ym,
                 EPI: tl.constexpr, ACT: tl.constexpr, NORM_IN: tl.constexpr, OUT_PAIRS: tl.constexpr,
                 PARTS_BLOCK: tl.constexpr):
    """finish_tile's work on a tile's total t: NORM_IN's scale, then out (EPI 0) or chained_store."""
    if NORM_IN:  # the norm's 1 / rms of each row, a factor of its dot
        t = t * tl.load(rstd_in_ptr + offs_m, mask=offs_m < M, other=0.0)[:, None]
    if EPI == 0:
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], t.to(out_ptr.dtype.element_ty),
                 mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])
    else:
        chained_store(t, res_ptr, nw_ptr, sum_ptr, y_ptr, parts_ptr, rstd_ptr, row_ticket, pid_n, offs_m,
                      offs_n, M, N, act_half, eps, stride_rm, stride_ym, EPI, ACT, OUT_PAIRS, PARTS_BLOCK)


@triton.jit
def chained_store(t, res_ptr, nw_ptr, sum_ptr, y_ptr, parts_ptr, rstd_ptr, row_ticket, pid_n, offs_m, offs_n, M, N,
                  act_half, eps, stride_rm, stride_ym, EPI: tl.constexpr, ACT: tl.constexpr,
                  OUT_PAIRS: tl.constexpr, PARTS_BLOCK: tl.constexpr):
    """NORM_OUT or ACT_OUT's stores from a tile's total t [BLOCK_M, BLOCK_N] (module docstring);
    y (and sum, NORM_OUT) are [M, *] rows of stride stride_ym, in x's dtype."""
    dt = y_ptr.dtype.element_ty
    rows = offs_m[:, None].to(tl.int64)
    if EPI == 1:
        cols = offs_n[None, :]
        mask = (offs_m < M)[:, None] & (cols < N)
        r = tl.load(res_ptr + rows * stride_rm + cols, mask=mask, other=0.0)
        s = (t.to(dt).to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(sum_ptr + rows * stride_ym + cols, s, mask=mask)
        sf = tl.where(mask, s.to(tl.float32), 0.0)
        w = tl.load(nw_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows * stride_ym + pair_position(cols, OUT_PAIRS), (sf * w[None, :]).to(dt),
                 mask=mask)
        row_norm_scale(tl.sum(sf * sf, axis=1), parts_ptr, rstd_ptr, row_ticket, pid_n, offs_m, M, N, eps,
                       PARTS_BLOCK)
    else:
        H: tl.constexpr = t.shape[1] // 2
        gate, up = tl.split(tl.permute(tl.reshape(t, [t.shape[0], 2, H]), (0, 2, 1)))
        gate = gate.to(dt).to(tl.float32)
        up = up.to(dt).to(tl.float32)
        if ACT == 2:  # GELU-tanh: its torch ops round gelu(gate) before the product
            y = (gate_act(gate, True).to(dt).to(tl.float32) * up).to(dt)
        else:
            y = (gate_act(gate, False) * up).to(dt)
        cols = (pid_n * H + tl.arange(0, H))[None, :]
        tl.store(y_ptr + rows * stride_ym + pair_position(cols, OUT_PAIRS), y,
                 mask=(offs_m < M)[:, None] & (cols < act_half))


@triton.jit
def row_norm_scale(sq, parts_ptr, rstd_ptr, row_ticket, pid_n, offs_m, M, N, eps,
                   PARTS_BLOCK: tl.constexpr):
    """NORM_OUT's rows' 1 / rms: this column block's sums of squares sq [BLOCK_M] go to its slot
    of parts [column blocks, M]; then the row block's counter (after the tiles' tickets) is
    taken, and the row block's last column block to finish sums the slots in column order (the
    same total whichever program it is), stores rsqrt(sum / N + eps) to rstd and resets the
    counter, so the launch replays inside CUDA/HIP graphs."""
    tl.store(parts_ptr + pid_n * M + offs_m, sq, mask=offs_m < M)
    tl.debug_barrier()  # every thread's slot is written before the counter is taken
    if tl.atomic_add(row_ticket, 1, sem="acq_rel") == tl.num_programs(1) - 1:
        p = tl.arange(0, PARTS_BLOCK)[:, None]
        slots = tl.load(parts_ptr + p * M + offs_m[None, :], mask=(p < tl.num_programs(1)) & (offs_m < M)[None, :],
                        other=0.0, cache_modifier=".cg")
        tl.store(rstd_ptr + offs_m, tl.math.rsqrt(tl.sum(slots, axis=0) / N + eps), mask=offs_m < M)
        tl.atomic_xchg(row_ticket, 0)
