"""What one speculative verify forward costs next to a plain decode forward (spec_gpu.py `verify`).

One engine per model (dummy weights, speculation configured with K = max K, eager at startup so
that this module captures exactly the shapes it times): graphs for plain decodes of B rows and for
verify steps of B sequences x (K+1) rows (groups of width K+1, as step_plan builds them for the
engine), then ModelRunner.forward timed with CUDA
events over repeated replays of one fixed batch (contexts of `ctx` tokens, every row live). The
sampler and the acceptance rule are not in these numbers: they run on the logits afterwards, the
same for both. Cost model (stated as such, measured step times x modelled acceptance): a verify
step yields L tokens per sequence on average, so tok/s = B * L / t_verify(K).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from gpu_harness import profile_totals
from homelab_llm.engine.cuda_graphs import DecodeGraphs, kv_splits_for
from homelab_llm.engine.kernels.gdn_pending import replay_slot, state_word
from homelab_llm.engine.plan_rows import PlanRows
from homelab_llm.engine.step_plan import StepBatch, plan_from_lists


STEADY_PENDING = 2  # rows a hybrid verify step applies from the previous one (~2 tokens a step)


@dataclass
class VerifyCost:
    batch: int
    k: int  # 0: the plain decode step
    ms: float


def step_batch(runner, ids: list[list[int]], ctx: int, pages: int, pending: int = 0) -> StepBatch:
    """Sequence i (pages [i*pages, (i+1)*pages), state slot i) with `ctx` computed tokens runs the
    rows ids[i]: its last token and len(ids[i]) - 1 drafts; on a hybrid model its slot applies
    `pending` rows of a previous verify first (half 0; the verify rows go to half 1)."""
    ps = runner.page_size
    hybrid = runner.config.is_hybrid
    rows = PlanRows()
    logits: list[int] = []
    k = len(ids[0]) - 1
    for i, row_ids in enumerate(ids):
        table = list(range(i * pages, (i + 1) * pages))
        kv = [table[p // ps] * ps + p % ps for p in range(ctx, ctx + k + 1)]
        states = [state_word(i, pending)] + [i] * k if hybrid else [-1] * (k + 1)
        logits += rows.add_decode_rows(row_ids, ctx, kv, table, states)
    header, payload = plan_from_lists(rows.ids, rows.positions, rows.slots, rows.query_lens, rows.seq_lens,
                                      rows.tables, logits, rows.state_slots, rows.has_initial,
                                      verify_width=k + 1, decode_rows=len(rows.ids))
    return runner.batch_from_plan(header, payload)


def random_rows(runner, batch: int, k: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(10, runner.config.vocab_size - 10) for _ in range(k + 1)] for _ in range(batch)]


def capture(runner, batches: list[int], ks: list[int], max_model_len: int) -> None:
    """Graphs for every timed shape (GPU only)."""
    shapes = sorted({(b * (k + 1), k + 1) for b in batches for k in [0] + ks})
    max_pages = -(-max_model_len // runner.page_size)
    runner.graphs = DecodeGraphs(runner.model, runner.device, max(r for r, _ in shapes), max_pages,
                                 runner.page_size, kv_splits_for(max_model_len, runner.page_size))
    runner.graphs.capture(shapes)


def time_forward(runner, batch: StepBatch, iters: int) -> float:
    """Median ms of runner.forward(batch) (CUDA events on a GPU, wall time on the CPU)."""
    for _ in range(2):
        runner.forward(batch)
    times = []
    cuda = runner.device.type == "cuda"
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            runner.forward(batch)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            runner.forward(batch)
            times.append(1000 * (time.perf_counter() - t))
    return sorted(times)[len(times) // 2]


def measure(runner, batches: list[int], ks: list[int], ctx: int, iters: int) -> list[VerifyCost]:
    """Plain (k = 0, nothing pending: a run without speculation) and verify step times for every
    batch and K; a hybrid verify step applies STEADY_PENDING rows of the previous one first, as
    in a run that keeps about that many tokens a step."""
    rng = random.Random(0)
    pages = -(-(ctx + max(ks) + 1) // runner.page_size)
    out = []
    for b in batches:
        for k in [0] + ks:
            pending = min(STEADY_PENDING, k + 1) if k else 0
            batch = step_batch(runner, random_rows(runner, b, k, rng), ctx, pages, pending)
            out.append(VerifyCost(b, k, time_forward(runner, batch, iters)))
    return out


def kernel_profile(runner, batch: int, k: int, ctx: int, iters: int = 8) -> dict[str, list[float]]:
    """Kernel name -> [GPU us, launches] per forward of one fixed batch (batch sequences x k+1
    rows) run eagerly (no graphs captured), so every launch of a verify forward shows beside a
    plain one's (k = 0). On the CPU: torch ops and their CPU time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = runner.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    pages = -(-(ctx + k + 1) // runner.page_size)
    step = step_batch(runner, random_rows(runner, batch, k, random.Random(2)), ctx, pages)
    for _ in range(2):
        runner.forward(step)
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            runner.forward(step)
        sync()
    return profile_totals(prof, iters, device_time=cuda)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()


@torch.inference_mode()
def check(runner, batch: int, k: int, ctx: int) -> tuple[float, float, float]:
    """The verify forward (graphs on where captured) against k+1 plain decode steps over the same
    tokens: (max relative logits error, argmax agreement, max relative error of the state after
    each row, its pending rows applied, vs after that many plain steps; 0 on dense models).
    Leaves the states it used dirty."""
    rows = random_rows(runner, batch, k, random.Random(1))
    pages = -(-(ctx + k + 1) // runner.page_size)
    pool = runner.state_pool
    layers = list(zip(pool.conv_states, pool.ssm_states, pool.pending)) if pool is not None else []
    saved = [t[:batch].clone() for conv, ssm, _ in layers for t in (conv, ssm)]
    verify = runner.forward(step_batch(runner, rows, ctx, pages)).view(batch, k + 1, -1).float()
    # the verify read half 0 and wrote its rows to half 1
    after = [[[t for layer in layers for t in replay_slot(*layer, state_word(i, j + 1, 1))] for j in range(k + 1)]
             for i in range(batch)]
    for t, s in zip([t for conv, ssm, _ in layers for t in (conv, ssm)], saved):
        t[:batch].copy_(s)
    plain, state_err = [], 0.0
    for j in range(k + 1):
        plain.append(runner.forward(step_batch(runner, [[r[j]] for r in rows], ctx + j, pages)).float())
        for i in range(batch):
            now = [t[i] for conv, ssm, _ in layers for t in (conv, ssm)]
            for got, want in zip(after[i][j], now):
                state_err = max(state_err, _rel(got, want))
    plain_t = torch.stack(plain, dim=1)
    agree = (verify.argmax(-1) == plain_t.argmax(-1)).float().mean().item()
    return _rel(verify, plain_t), agree, state_err
