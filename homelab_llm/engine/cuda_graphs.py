"""CUDA/HIP graphs for decode steps: one graph per padded shape, replayed with the step's inputs
copied into static buffers. Launch overhead is most of a small model's decode step; a graph turns
hundreds of kernel launches into one.

A shape is (rows, verify_width). Plain decodes: one row per sequence, width 1. Speculative verify
steps are decode rows in groups of K+1 per sequence (step_plan.py; decode attention reads a group's
K/V once, hybrid models' Gated DeltaNet kernels chain its rows), so speculation adds width-(K+1)
graphs of batch * (K+1) rows beside the decode graphs. Padding rows (and whole padding groups)
carry state slot -1 and KV slot -1: they write nothing.

Short contexts get graphs of their own: a split count sized for the longest context leaves most
splits of a short one empty, and those cost (BENCHMARKS 23.4: Qwen3-30B-A3B batch 1 at 32 tokens,
32 splits 345.7 tok/s, 4 splits 353.9). Where the arch table names short_kv_splits below a decode
shape's count, that shape gets a second graph with that many splits, replayed for the steps whose
longest sequence wants no more (kv_splits_for). Every split count gives the same attention, so the
choice is speed only; all ranks of a TP group choose alike (the step header's max_seq_len).

A model with a sliding page group (cache/page_groups.py) gets a second static slot mapping and
page table of the same shapes, which its sliding layers read in the captured graph.

With `keep_hidden` (a model with an MTP head, spec/mtp_draft.py) each graph also returns the
model's final hidden states of every row (padding included) in a static output, and run() leaves
the replayed step's rows in `hidden`: the same rows, in the same layout, as the eager forward's.
The capture itself goes through graph_capture.py, so tests run all of this on a CPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from homelab_llm.engine.context import ForwardContext, forward_context
from homelab_llm.engine.graph_capture import Capturer, CudaCapture, Outputs, Replayable
from homelab_llm.load_progress import LOAD

log = logging.getLogger("homelab_llm.engine.graphs")


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16))
    out = [s for s in sizes if s < max_num_seqs] + [max_num_seqs]
    return sorted(set(out))


def graph_shapes(max_num_seqs: int, verify_width: int) -> list[tuple[int, int]]:
    """(rows, width) to capture: decode batches, and with speculation (verify_width = K+1 > 1)
    the verify steps' groups."""
    sizes = graph_batch_sizes(max_num_seqs)
    verify = [(bs * verify_width, verify_width) for bs in sizes] if verify_width > 1 else []
    return [(bs, 1) for bs in sizes] + verify


def kv_splits_for(max_model_len: int, page_size: int, max_splits: int = 32) -> int:
    """Split count for batch-1 graph replays: enough parallel work on long contexts (up to the
    arch's tuning max_kv_splits), while a split never gets fewer than a few pages. Splits past a
    short context's end cost one store each (decode_attention skips them)."""
    return max(1, min(max_splits, max_model_len // (8 * page_size)))


def graph_kv_splits(device: torch.device, kv_heads: int, max_model_len: int, page_size: int) -> int:
    """The decode graphs' batch-1 split count on a rank with kv_heads KV heads: kv_splits_for
    under the arch's cap for that many heads (tuning.kv_split_cap)."""
    from homelab_llm.engine.kernels.tuning import kv_split_cap

    return kv_splits_for(max_model_len, page_size, kv_split_cap(device, kv_heads))


def kv_splits_at(batch_1_splits: int, batch: int, row_programs: int = 0, floor: int = 8) -> int:
    """Splits for a padded batch size, a power of two as the kernel requires. With row_programs
    (kv_row_programs: the programs wanted per decode row) and batch > 1: row_programs / batch,
    at most the batch-1 count, so programs (batch x heads x splits) stay near the arch's
    measured count at every batch and length. Else the batch-1 count shared out, at least
    `floor` (or the batch-1 count, if smaller)."""
    if row_programs and batch > 1:
        want = max(1, row_programs // batch)
        return min(batch_1_splits, 1 << (want.bit_length() - 1))
    share = max(1, batch_1_splits // max(1, batch))
    return max(min(floor, batch_1_splits), 1 << (share.bit_length() - 1))


def kv_row_programs(device: torch.device, kv_heads: int) -> int:
    """Decode programs wanted per row for kv_splits_at: the arch's kv_programs_per_sm x SMs over
    this rank's KV heads (0 where the arch table has no count)."""
    from homelab_llm.engine.kernels.tuning import device_sms, tiles_for

    per_sm = tiles_for(device).kv_programs_per_sm
    return per_sm * device_sms(device) // max(1, kv_heads) if per_sm else 0


@dataclass
class _Graph:
    graph: Replayable
    logits: torch.Tensor
    hidden: torch.Tensor | None  # keep_hidden: every row's final hidden state


class DecodeGraphs:
    def __init__(self, model, device: torch.device, max_rows: int, max_pages: int,
                 page_size: int, num_kv_splits: int, sliding: bool = False,
                 keep_hidden: bool = False, capturer: Capturer | None = None,
                 row_programs: int = 0, short_kv_splits: int = 0) -> None:
        self.model = model
        self.device = device
        self.keep_hidden = keep_hidden
        self.capturer = capturer if capturer is not None else CudaCapture(device)
        self.hidden: torch.Tensor | None = None  # keep_hidden: the last run's rows [rows, H]
        self.max_pages = max_pages
        self.page_size = page_size
        self.num_kv_splits = num_kv_splits
        self.row_programs = row_programs  # kv_splits_at's, past batch 1
        self.short_kv_splits = short_kv_splits  # 0: no short-context graphs
        n = max_rows
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.page_table = torch.zeros((n, max_pages), dtype=torch.int32, device=device)
        self.sliding_slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device) if sliding else None
        self.sliding_page_table = (torch.zeros((n, max_pages), dtype=torch.int32, device=device)
                                   if sliding else None)
        # Hybrid models: fixed-size state slots; padding rows are -1 (the GDN kernels skip them).
        self.state_indices = torch.full((n,), -1, dtype=torch.int32, device=device)
        self.has_initial_state = torch.ones(n, dtype=torch.bool, device=device)
        self.graphs: dict[tuple[int, int], _Graph] = {}  # (rows, verify_width)
        self.short: dict[int, _Graph] = {}  # rows -> the short-context decode graph
        self.memory_bytes = 0

    def splits(self, bs: int, width: int) -> int:
        """The KV split count of the graph of `bs` rows of this width (its short-context graph,
        where it has one: short_kv_splits)."""
        return kv_splits_at(self.num_kv_splits, max(1, bs // width), self.row_programs)

    def _context(self, bs: int, width: int, splits: int) -> ForwardContext:
        sliding = self.sliding_page_table is not None
        return ForwardContext(
            positions=self.positions[:bs], slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[:bs + 1], seq_lens=self.seq_lens[:bs],
            page_table=self.page_table[:bs], max_query_len=1,
            max_seq_len=self.max_pages * self.page_size, page_size=self.page_size,
            decode_only=True,
            num_kv_splits=splits,
            state_indices=self.state_indices[:bs], has_initial_state=self.has_initial_state[:bs],
            verify_width=width, decode_rows=bs,
            sliding_slot_mapping=self.sliding_slot_mapping[:bs] if sliding else None,
            sliding_page_table=self.sliding_page_table[:bs] if sliding else None)

    def _forward(self, bs: int, width: int, splits: int) -> Outputs:
        """The captured function: the model over the first `bs` static rows."""
        with forward_context(self._context(bs, width, splits)):
            hidden = self.model(self.input_ids[:bs], self.positions[:bs])
            logits = self.model.compute_logits(hidden)
        return (logits, hidden) if self.keep_hidden else (logits,)

    @torch.inference_mode()
    def capture(self, shapes: list[tuple[int, int]]) -> None:
        """Capture each (rows, verify_width) shape (graph_shapes), and a short-context graph for
        each decode shape whose split count is above short_kv_splits."""
        before = self.capturer.allocated()
        # largest first: later graphs reuse its pool
        jobs = []  # (rows, width, splits, short)
        for bs, width in sorted(shapes, reverse=True):
            jobs.append((bs, width, self.splits(bs, width), False))
            if width == 1 and 0 < self.short_kv_splits < self.splits(bs, 1):
                jobs.append((bs, 1, self.short_kv_splits, True))
        for done, (bs, width, splits, short) in enumerate(jobs):
            what = f"(verify {bs} rows)" if width > 1 else f"(batch {bs}{', short' if short else ''})"
            LOAD.step(done, len(jobs), what)
            graph, out = self.capturer(lambda bs=bs, width=width, splits=splits:
                                       self._forward(bs, width, splits))
            captured = _Graph(graph, out[0], out[1] if self.keep_hidden else None)
            if short:
                self.short[bs] = captured
            else:
                self.graphs[bs, width] = captured
        self.memory_bytes = max(0, self.capturer.allocated() - before)
        log.info("captured %d decode graphs (rows, width: %s; short-context graphs for batches "
                 "%s), %.1f MiB", len(jobs), shapes, sorted(self.short), self.memory_bytes / 2**20)

    def release(self) -> None:
        """Destroy every captured graph (what they captured, collectives included, is let go)."""
        for g in (*self.graphs.values(), *self.short.values()):
            g.graph.reset()
        self.graphs.clear()
        self.short.clear()

    def takes_short(self, rows: int, ctx: ForwardContext) -> bool:
        """Whether the step replays the short-context graph of its padded `rows`: one is
        captured and the step's longest sequence wants no more splits than it has."""
        return (ctx.verify_width == 1 and rows in self.short
                and kv_splits_for(ctx.max_seq_len, self.page_size, self.num_kv_splits)
                <= self.short_kv_splits)

    def _shape(self, rows: int, width: int) -> tuple[int, int] | None:
        """The smallest captured shape that holds `rows` rows of this width."""
        fit = [shape for shape in self.graphs if shape[1] == width and shape[0] >= rows]
        return min(fit) if fit else None

    def fits(self, ctx: ForwardContext, num_tokens: int) -> bool:
        return (ctx.decode_only and ctx.page_table.shape[1] <= self.max_pages
                and self._shape(num_tokens, ctx.verify_width) is not None)

    def run(self, input_ids: torch.Tensor, ctx: ForwardContext, logits_indices: torch.Tensor) -> torch.Tensor:
        bs = input_ids.shape[0]
        shape = self._shape(bs, ctx.verify_width)
        size = shape[0]
        self.input_ids[:bs].copy_(input_ids)
        self.positions[:bs].copy_(ctx.positions)
        self.slot_mapping[:bs].copy_(ctx.slot_mapping)
        self.seq_lens[:bs].copy_(ctx.seq_lens)
        if ctx.state_indices is not None:
            self.state_indices[:bs].copy_(ctx.state_indices)
        if self.sliding_page_table is not None:
            assert ctx.sliding_page_table is not None and ctx.sliding_slot_mapping is not None
            self.sliding_slot_mapping[:bs].copy_(ctx.sliding_slot_mapping)
            self.sliding_slot_mapping[bs:size].fill_(-1)
            self.sliding_page_table[:bs, :ctx.sliding_page_table.shape[1]].copy_(ctx.sliding_page_table)
        if size > bs:
            self.slot_mapping[bs:size].fill_(-1)  # padding rows write nowhere
            self.seq_lens[bs:size].fill_(1)
            self.state_indices[bs:size].fill_(-1)  # nor read or write any state
        pages = ctx.page_table.shape[1]
        self.page_table[:bs, :pages].copy_(ctx.page_table)
        graph = self.short[size] if self.takes_short(size, ctx) else self.graphs[shape]
        graph.graph.replay()
        self.hidden = graph.hidden[:bs] if graph.hidden is not None else None
        return graph.logits[:bs][logits_indices]
