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

from homelab_llm.engine.cuda_graphs import DecodeGraphs, kv_splits_for
from homelab_llm.engine.plan_rows import PlanRows
from homelab_llm.engine.step_plan import StepBatch, plan_from_lists


@dataclass
class VerifyCost:
    batch: int
    k: int  # 0: the plain decode step
    ms: float


def step_batch(runner, batch: int, k: int, ctx: int, rng: random.Random) -> StepBatch:
    """B sequences with `ctx` computed tokens, each running its last token and k drafts."""
    ps = runner.page_size
    pages = -(-(ctx + k + 1) // ps)
    hybrid = runner.config.is_hybrid
    rows = PlanRows()
    logits: list[int] = []
    for i in range(batch):
        table = list(range(i * pages, (i + 1) * pages))
        kv = [table[p // ps] * ps + p % ps for p in range(ctx, ctx + k + 1)]
        # hybrid: row 0 the sequence's slot, rows 1..k spares past the batch's own slots
        states = [i] + [batch + i * k + j for j in range(k)] if hybrid else [-1] * (k + 1)
        ids = [rng.randrange(10, runner.config.vocab_size - 10) for _ in range(k + 1)]
        logits += rows.add_decode_rows(ids, ctx, kv, table, states)
    header, payload = plan_from_lists(rows.ids, rows.positions, rows.slots, rows.query_lens, rows.seq_lens,
                                      rows.tables, logits, rows.state_slots, rows.has_initial,
                                      verify_width=k + 1, decode_rows=len(rows.ids))
    return runner.batch_from_plan(header, payload)


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
    """Plain (k = 0) and verify step times for every batch and K."""
    rng = random.Random(0)
    out = []
    for b in batches:
        for k in [0] + ks:
            out.append(VerifyCost(b, k, time_forward(runner, step_batch(runner, b, k, ctx, rng), iters)))
    return out
