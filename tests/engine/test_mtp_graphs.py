"""MTP with captured graphs, on the CPU: the runner's graph path (static buffers, padding, the
decode/verify graphs' hidden rows, the head's graphs) runs through graph_capture.EagerCapture,
which replays the captured function eagerly over the same static buffers. Only the CUDA capture
itself is left to the GPU check (benchmarks/spec_gpu.py --sections mtp_graphs).

- Greedy output and every stored draft with graphs equal the eager run's, token for token, with
  random heads (drafts rejected) and echo heads (drafts accepted, so verify passes keep several
  rows per sequence); both graph kinds were really replayed.
- The pure rules: which row counts the head captures, when a head forward fits a graph, when the
  pass lays rows out as decode rows, what the memory plan counts.
"""

from __future__ import annotations

import json

import pytest

from homelab_llm.engine.graph_capture import EagerCapture
from homelab_llm.engine.memory import graph_bytes
from homelab_llm.engine.spec.config import SpeculativeConfig
from homelab_llm.engine.spec.mtp import enable_mtp
from homelab_llm.engine.spec.mtp_draft import pass_as_decode_rows
from homelab_llm.engine.spec.mtp_graphs import head_graph_fits, head_graph_rows
from hybrid_reference import greedy, our_llm
from hybrid_shapes import QWEN36_27B
from mtp_reference import make_mtp_checkpoint

PROMPTS = [[5, 6, 7, 8, 9] * 3, [(7 * i) % 300 + 3 for i in range(21)], [40, 41, 42]]


def mtp(k: int) -> str:
    return json.dumps({"method": "mtp", "num_speculative_tokens": k})


def _run(folder, k: int, graphs: bool) -> tuple[list[list[int]], list[tuple], dict[str, int]]:
    """(outputs, every stored draft, replay counts) of PROMPTS, batched, greedy."""
    llm = our_llm(folder, speculative_config=mtp(k), max_num_seqs=4)
    engine, runner = llm.engine, llm.engine.runner
    replays = {"decode": 0, "head": 0}
    # an MTP model no longer forces eager steps; on a CPU capture_graphs captures nothing
    assert not runner.eager and runner.graphs is None and runner.head_graphs is None
    if graphs:
        runner.install_graphs(engine.max_model_len, EagerCapture())
        for name, graph_set in (("decode", runner.graphs), ("head", runner.head_graphs)):
            def counted(*args, _run=graph_set.run, _name=name):
                replays[_name] += 1
                return _run(*args)
            graph_set.run = counted
    stored: list[tuple] = []
    store = engine.drafter.proposer.store
    engine.drafter.proposer.store = lambda rid, n, tokens: (stored.append((rid, n, list(tokens))),
                                                           store(rid, n, tokens))
    try:
        outputs = [c.token_ids for c in llm.generate(PROMPTS, greedy(12))]
        return outputs, stored, replays
    finally:
        llm.shutdown()


@pytest.mark.parametrize("echo", [False, True])
def test_graphs_equal_eager(tmp_path, echo: bool) -> None:
    make_mtp_checkpoint(tmp_path, seed=5 if echo else 3, echo=echo)
    plain = our_llm(tmp_path)
    want = [c.token_ids for c in plain.generate(PROMPTS, greedy(12))]
    plain.shutdown()
    eager, eager_drafts, _ = _run(tmp_path, 3, graphs=False)
    graphed, graph_drafts, replays = _run(tmp_path, 3, graphs=True)
    assert graphed == eager == want
    assert graph_drafts == eager_drafts and len(graph_drafts) > 10
    assert replays["decode"] > 5 and replays["head"] > 10


def test_echo_head_drafts_are_accepted_through_graphs(tmp_path) -> None:
    """Accepted drafts make passes of several rows per sequence (decode rows, one graph)."""
    make_mtp_checkpoint(tmp_path, seed=5, echo=True)
    llm = our_llm(tmp_path, speculative_config=mtp(2), max_num_seqs=4)
    llm.engine.runner.install_graphs(llm.engine.max_model_len, EagerCapture())
    widths: list[int] = []
    run = llm.engine.runner.head_graphs.run
    llm.engine.runner.head_graphs.run = lambda ids, *rest: (widths.append(ids.shape[0]), run(ids, *rest))[1]
    llm.generate(PROMPTS[:1], greedy(16))
    stats = llm.engine.spec_stats
    llm.shutdown()
    assert stats.num_accepted_tokens > 0
    assert max(widths) >= 2  # a pass over a verify step's kept rows went through a graph


def test_head_graph_rows_and_fit() -> None:
    assert head_graph_rows(8, 4) == [1, 2, 4, 8, 16, 32]
    assert head_graph_rows(3, 1) == [1, 2, 3]
    assert head_graph_rows(20, 2) == [1, 2, 4, 8, 16, 20, 32, 40]
    captured = head_graph_rows(8, 4)
    assert head_graph_fits(True, 5, 2, 10, 10, 8, captured)  # padded to 8 rows
    assert not head_graph_fits(True, 33, 2, 10, 10, 8, captured)  # more rows than any graph
    assert not head_graph_fits(False, 4, 2, 10, 10, 8, captured)  # a prefill chunk's pass: eager
    assert not head_graph_fits(True, 4, 2, 11, 10, 8, captured)  # longer than the graphs' page tables
    assert not head_graph_fits(True, 16, 9, 10, 10, 8, captured)  # more chains than sequences


def test_pass_layout_rule() -> None:
    assert pass_as_decode_rows(1, 0) and pass_as_decode_rows(4, 3)
    assert not pass_as_decode_rows(5, 3)  # a prefill chunk: one query


def test_memory_plan_counts_the_head_graphs() -> None:
    with_head = enable_mtp(QWEN36_27B, SpeculativeConfig("mtp", 3))
    plain = graph_bytes(QWEN36_27B, 32, "bfloat16", 1)
    extra = graph_bytes(with_head, 32, "bfloat16", 1) - plain
    # one head graph per captured size, the decode graphs' hidden outputs, the head's input
    sizes = [1, 2, 4, 8, 16, 32]
    assert extra == len(sizes) * (2 << 20) + (sum(sizes) + 32) * QWEN36_27B.hidden_size * 2
    assert graph_bytes(with_head, 32, "bfloat16", 1, enforce_eager=True) == 0
