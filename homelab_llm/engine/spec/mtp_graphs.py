"""Captured graphs of the MTP head's forward (model/mtp.py), one per padded row count and MTP
layer, beside the target model's decode graphs (cuda_graphs.py) and in their memory pool.

A head forward (Runner.run_mtp) is the pass after a step or one link of the draft chain
(spec/mtp_draft.py). When every row is its own one-token query (a chain step: one row per
drafting sequence; a pass after decode and verify steps: the kept rows, each a decode row, see
mtp_draft.py) the forward is decode-only and replays here; a pass over a prefill chunk (varlen
queries) runs eagerly.

Static inputs: token ids, positions, the input hidden rows [rows, H] (gathered from the target's
or the previous link's output before the replay), KV slots, sequence lengths and page tables of
the head's KV layer, and the logits rows (the chains' rows: at most one per running sequence, so
min(rows, max_num_seqs) of them; padding entries point at row 0). Outputs: the head's states h'
of the logits rows [L, H] and their argmax tokens (the logits stay inside the graph). Padding
rows write no KV (slot -1) and attend over one position; what they compute is never read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from homelab_llm.engine.context import ForwardContext, forward_context
from homelab_llm.engine.cuda_graphs import graph_batch_sizes, kv_splits_at
from homelab_llm.engine.graph_capture import Capturer, Outputs, Replayable

log = logging.getLogger("homelab_llm.engine.graphs")


def head_graph_rows(max_num_seqs: int, verify_width: int) -> list[int]:
    """Row counts captured for the head: each decode batch size (a chain step has one row per
    drafting sequence) and each times verify_width (a pass after a verify step keeps up to K+1
    rows per sequence)."""
    return sorted({bs * w for bs in graph_batch_sizes(max_num_seqs) for w in {1, verify_width}})


def head_graph_fits(decode_only: bool, rows: int, num_logits: int, pages: int, max_pages: int,
                    max_logits: int, captured: list[int]) -> bool:
    """Whether a head forward of `rows` rows (`num_logits` of them logits rows) over `pages`
    page-table columns replays a graph."""
    return (decode_only and pages <= max_pages and num_logits <= max_logits
            and any(rows <= size for size in captured))


class HeadGraphs:
    """Graphs of `mtp` (a MultiTokenPredictor) with the target's embedding and logits."""

    def __init__(self, mtp: nn.Module, embed: nn.Module,
                 compute_logits: Callable[[torch.Tensor], torch.Tensor],
                 hidden_size: int, dtype: torch.dtype, device: torch.device, max_rows: int,
                 max_pages: int, page_size: int, num_kv_splits: int, max_logits: int,
                 capturer: Capturer, row_programs: int = 0) -> None:
        self.mtp, self.embed, self.compute_logits = mtp, embed, compute_logits
        self.max_pages, self.page_size, self.num_kv_splits = max_pages, page_size, num_kv_splits
        self.row_programs = row_programs  # cuda_graphs.kv_splits_at's, past batch 1
        self.capturer = capturer
        self.max_logits = max_logits  # logits rows per forward: one per running sequence at most
        n, h = max_rows, hidden_size
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.hidden = torch.zeros((n, h), dtype=dtype, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.page_table = torch.zeros((n, max_pages), dtype=torch.int32, device=device)
        self.logits_rows = torch.zeros(min(n, max_logits), dtype=torch.long, device=device)
        self.graphs: dict[tuple[int, int], tuple[Replayable, Outputs]] = {}  # (rows, layer)
        self.sizes: list[int] = []
        self.memory_bytes = 0

    def _context(self, n: int) -> ForwardContext:
        return ForwardContext(
            positions=self.positions[:n], slot_mapping=self.slot_mapping[:n],
            query_start_loc=self.query_start_loc[:n + 1], seq_lens=self.seq_lens[:n],
            page_table=self.page_table[:n], max_query_len=1,
            max_seq_len=self.max_pages * self.page_size, page_size=self.page_size,
            decode_only=True, num_kv_splits=kv_splits_at(self.num_kv_splits, n, self.row_programs),
            decode_rows=n)

    def _forward(self, n: int, layer: int) -> Outputs:
        with forward_context(self._context(n)):
            out = self.mtp(self.input_ids[:n], self.positions[:n], self.hidden[:n], self.embed, layer)
            picked = out.index_select(0, self.logits_rows[:min(n, self.max_logits)])
            tokens = self.compute_logits(picked).argmax(dim=-1)
        return picked, tokens

    @torch.inference_mode()
    def capture(self, sizes: list[int]) -> None:
        before = self.capturer.allocated()
        for n in sorted(sizes, reverse=True):  # largest first, as the decode graphs
            for layer in range(len(self.mtp.layers)):
                self.graphs[n, layer] = self.capturer(lambda n=n, layer=layer: self._forward(n, layer))
        self.sizes = sorted(sizes)
        self.memory_bytes = max(0, self.capturer.allocated() - before)
        log.info("captured %d MTP head graphs (rows %s), %.1f MiB", len(self.graphs), self.sizes,
                 self.memory_bytes / 2**20)

    def release(self) -> None:
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.sizes = []

    def fits(self, ctx: ForwardContext, rows: int, num_logits: int) -> bool:
        return head_graph_fits(ctx.decode_only, rows, num_logits, ctx.page_table.shape[1], self.max_pages,
                               self.max_logits, self.sizes)

    def run(self, input_ids: torch.Tensor, ctx: ForwardContext, source: torch.Tensor,
            hidden_rows: torch.Tensor, logits_indices: torch.Tensor, step: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """One head forward (fits() said yes): (h' of the logits rows, their argmax tokens).
        h' is the static output (valid until this graph replays again); the tokens are a copy."""
        n = input_ids.shape[0]
        size = min(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(ctx.positions)
        self.slot_mapping[:n].copy_(ctx.slot_mapping)
        self.seq_lens[:n].copy_(ctx.seq_lens)
        self.page_table[:n, :ctx.page_table.shape[1]].copy_(ctx.page_table)
        self.hidden[:n].copy_(source.index_select(0, hidden_rows))
        r = logits_indices.numel()
        self.logits_rows[:r].copy_(logits_indices)
        self.logits_rows[r:].zero_()  # a row of this forward (a stale one may be past its rows)
        if size > n:
            self.slot_mapping[n:size].fill_(-1)  # padding rows write nowhere
            self.seq_lens[n:size].fill_(1)
        graph, (picked, tokens) = self.graphs[size, step % len(self.mtp.layers)]
        graph.replay()
        return picked[:r], tokens[:r].clone()  # the drafter reads every link's tokens at the end
