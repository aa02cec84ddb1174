"""Decode graphs for short contexts (cuda_graphs.DecodeGraphs, short_kv_splits): which shapes get a
second graph, which graph a step replays, and that each graph was captured with its own split
count. A stand-in model returns the split count its forward saw, through graph_capture's
EagerCapture (the runner's real model runs the same path in test_mtp_graphs.py)."""

from __future__ import annotations

import torch

from homelab_llm.engine.context import ForwardContext, get_context
from homelab_llm.engine.cuda_graphs import DecodeGraphs, graph_shapes
from homelab_llm.engine.graph_capture import EagerCapture

PAGE = 16


class SplitsEcho(torch.nn.Module):
    """hidden = the forward context's num_kv_splits, one row per input row."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return torch.full((input_ids.shape[0], 1), float(get_context().num_kv_splits))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def _graphs(short: int, max_num_seqs: int = 8, verify_width: int = 1) -> DecodeGraphs:
    shapes = graph_shapes(max_num_seqs, verify_width)
    graphs = DecodeGraphs(SplitsEcho(), torch.device("cpu"), max(r for r, _ in shapes), 64, PAGE,
                          32, capturer=EagerCapture(), short_kv_splits=short)
    graphs.capture(shapes)
    return graphs


def _step(graphs: DecodeGraphs, rows: int, max_seq_len: int) -> int:
    """The split count of the graph a decode step of `rows` sequences replays."""
    ctx = ForwardContext(
        positions=torch.zeros(rows, dtype=torch.long), slot_mapping=torch.zeros(rows, dtype=torch.long),
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
        seq_lens=torch.full((rows,), max_seq_len, dtype=torch.int32),
        page_table=torch.zeros((rows, 4), dtype=torch.int32), max_query_len=1,
        max_seq_len=max_seq_len, page_size=PAGE, decode_only=True)
    with torch.inference_mode():  # as the runner steps
        logits = graphs.run(torch.zeros(rows, dtype=torch.long), ctx, torch.arange(rows))
    assert logits.shape == (rows, 1) and bool((logits == logits[0]).all())
    return int(logits[0, 0])


def test_short_contexts_replay_their_own_graph() -> None:
    graphs = _graphs(short=4)
    # batch 1: 32 splits; batch 8: the batch-1 count shared out, at least 8 (kv_splits_at)
    assert [graphs.splits(b, 1) for b in (1, 2, 4, 8)] == [32, 16, 8, 8]
    assert sorted(graphs.short) == [1, 2, 4, 8]
    # a 16-token page, 8 pages a split (kv_splits_for): up to 639 tokens want at most 4 splits
    for rows, padded_full in ((1, 32), (3, 8), (8, 8)):
        assert _step(graphs, rows, 33) == 4
        assert _step(graphs, rows, 639) == 4
        assert _step(graphs, rows, 640) == padded_full
        assert _step(graphs, rows, 1000) == padded_full


def test_no_short_graph_where_the_count_is_already_small() -> None:
    graphs = _graphs(short=8)
    assert sorted(graphs.short) == [1, 2]  # batches 4 and 8 have 8 splits already
    assert _step(graphs, 1, 100) == 8 and _step(graphs, 4, 100) == 8
    assert _step(graphs, 1, 8 * 8 * PAGE) == 8  # 8 splits wanted: still the short graph
    assert _step(graphs, 1, 9 * 8 * PAGE) == 32  # 9: the full one


def test_off_verify_shapes_and_release() -> None:
    assert _graphs(short=0).short == {}
    graphs = _graphs(short=4, max_num_seqs=2, verify_width=3)
    assert sorted(graphs.graphs) == [(1, 1), (2, 1), (3, 3), (6, 3)]
    assert sorted(graphs.short) == [1, 2]  # decode shapes only: verify steps keep their graphs
    graphs.release()
    assert graphs.graphs == {} and graphs.short == {}
