"""TP shutdown order (issue #5): graphs destroyed before any process group is touched, peer
buffers unmapped everywhere before any is freed, workers alive until rank 0 left its groups, and a
stuck teardown bounded (shutdown returns, exit stays clean, the next engine waits for it)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from homelab_llm.engine.cuda_graphs import DecodeGraphs
from homelab_llm.engine.llm import LLM
from homelab_llm.engine.parallel import runner as pw
from homelab_llm.engine.parallel import shutdown as tsd
from homelab_llm.engine.runner import ModelRunner
from homelab_llm.engine.spec.mtp_graphs import HeadGraphs
from homelab_llm.engine.sampling_params import SamplingParams
from tests.engine.model_reference import make_hf_model

SHAPE = dict(num_attention_heads=6, num_key_value_heads=2, intermediate_size=192, vocab_size=320)
PROMPTS = [[11, 42, 7, 99, 3], [77]]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


class _Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def add(self, what: str, rank: int) -> None:
        with self.lock:
            self.events.append((what, rank))

    def index(self, what: str, rank: int) -> int:
        return self.events.index((what, rank))


class _Graph:
    def __init__(self, log: _Log, rank: int) -> None:
        self.log, self.rank = log, rank

    def reset(self) -> None:
        self.log.add("graph_reset", self.rank)


class _Comm:
    def __init__(self, log: _Log, rank: int) -> None:
        self.log, self.rank = log, rank

    def release_peers(self) -> None:
        self.log.add("unmap_peers", self.rank)

    def release_own(self) -> None:
        self.log.add("free_own", self.rank)


class _BarrierChannel:
    def __init__(self, barrier: threading.Barrier, log: _Log, rank: int) -> None:
        self.b, self.log, self.rank = barrier, log, rank

    def barrier(self, timeout_s: float) -> None:
        self.log.add("barrier", self.rank)
        self.b.wait(timeout_s)


def _runner(graphs, head_graphs) -> SimpleNamespace:
    """A fake runner with the real release_graphs."""
    runner = SimpleNamespace(graphs=graphs, head_graphs=head_graphs, device=None)
    runner.release_graphs = lambda: ModelRunner.release_graphs(runner)
    return runner


def test_leave_destroys_graphs_then_unmaps_everywhere_before_any_free() -> None:
    log, world = _Log(), 3
    barrier = threading.Barrier(world)
    runners = []
    for r in range(world):
        graphs = SimpleNamespace(graphs={1: SimpleNamespace(graph=_Graph(log, r)),
                                         8: SimpleNamespace(graph=_Graph(log, r))},
                                 short={1: SimpleNamespace(graph=_Graph(log, r))})  # short context
        graphs.release = lambda g=graphs: DecodeGraphs.release(g)  # the real method on the fakes
        head = SimpleNamespace(graphs={(1, 0): (_Graph(log, r), ())}, sizes=[1])  # an MTP head's
        head.release = lambda h=head: HeadGraphs.release(h)
        runners.append(_runner(graphs, head))

    def rank(r: int) -> None:
        if r == 1:
            time.sleep(0.05)  # a slow rank: the others must wait for it at every step
        tsd.leave(_BarrierChannel(barrier, log, r), runners[r], _Comm(log, r), "cpu", 5.0)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert all(r.graphs is None and r.head_graphs is None for r in runners)  # none can replay
    last_reset = max(i for i, (w, _) in enumerate(log.events) if w == "graph_reset")
    first_unmap = min(log.index("unmap_peers", r) for r in range(world))
    last_unmap = max(log.index("unmap_peers", r) for r in range(world))
    first_free = min(log.index("free_own", r) for r in range(world))
    assert last_reset < first_unmap  # every GPU idle and graph-free before a buffer goes
    assert last_unmap < first_free  # an owner frees only after every importer unmapped
    assert sum(w == "graph_reset" for w, _ in log.events) == 4 * world


def test_leave_on_cpu_ranks_skips_the_buffer_barrier() -> None:
    log = _Log()
    runner = _runner(None, None)
    tsd.leave(_BarrierChannel(threading.Barrier(1), log, 0), runner, None, "cpu", 1.0)
    assert log.events == [("barrier", 0)]


def _llm(path: Path) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", tensor_parallel_size=2, page_size=4,
               kv_cache_memory_bytes=4 << 20, tokenizer=str(path / "config.json"))


def test_workers_outlive_rank0_teardown_and_a_second_engine_works(tmp_path: Path,
                                                                  monkeypatch) -> None:
    make_hf_model("llama", tmp_path, **SHAPE)
    seen: dict[str, object] = {}
    real_close = tsd._close_group

    def watched_close(device_type: str) -> None:
        runner = seen["runner"]
        seen["workers_alive_during_teardown"] = all(p.is_alive() for p in runner.procs)
        real_close(device_type)

    monkeypatch.setattr(tsd, "_close_group", watched_close)
    tokens = []
    for _ in range(2):  # a second TP engine in the same process after the first one's teardown
        llm = _llm(tmp_path)
        runner = seen["runner"] = llm.engine.runner
        tokens.append([c.token_ids for c in llm.generate(PROMPTS, GREEDY)])
        llm.shutdown()
        assert seen.pop("workers_alive_during_teardown") is True
        assert [p.exitcode for p in runner.procs] == [0]  # left on rank 0's "done", not killed
        assert set(runner.shutdown_phases) == {"leave", "teardown", "workers"}
        assert runner.shutdown_seconds < tsd.SHUTDOWN_WAIT_S
    assert tokens[0] == tokens[1]


def test_a_stuck_teardown_is_bounded_and_the_next_engine_waits_for_it(tmp_path: Path,
                                                                      monkeypatch) -> None:
    make_hf_model("llama", tmp_path, **SHAPE)
    release = threading.Event()
    real_close = tsd._close_group

    def stuck_close(device_type: str) -> None:  # like NCCL waiting on a graph still alive
        release.wait(30)
        real_close(device_type)

    monkeypatch.setattr(tsd, "_close_group", stuck_close)
    monkeypatch.setattr(pw, "SHUTDOWN_WAIT_S", 1.0)  # rank 0's waits: ParallelRunner's name
    monkeypatch.setattr(tsd, "_stuck_teardowns", [])
    llm = _llm(tmp_path)
    runner = llm.engine.runner
    llm.generate(PROMPTS, GREEDY)
    start = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - start < 5.0  # bounded: 1 s for the teardown, the workers exit
    assert [p.exitcode for p in runner.procs] == [0]
    assert len(tsd._stuck_teardowns) == 1
    with pytest.raises(tsd.RankFailedError, match="still stuck"):
        tsd.wait_for_stuck_teardown(0.2)
    # At exit the guard frees every graph (which is what unblocks NCCL) and lets the thread end.
    monkeypatch.setattr(tsd, "_reset_all_graphs", release.set)
    monkeypatch.setattr(tsd.os, "_exit", lambda code: pytest.fail("guard left via os._exit"))
    tsd._exit_guard(wait_s=10.0)
    assert not tsd._stuck_teardowns[0].is_alive()
    monkeypatch.setattr(tsd, "_close_group", real_close)
    llm = _llm(tmp_path)  # the finished teardown freed torch's default group for this one
    try:
        assert llm.generate(PROMPTS, GREEDY)
    finally:
        llm.shutdown()
    assert tsd._stuck_teardowns == []


def test_exit_guard_leaves_without_finalization_when_still_stuck(monkeypatch) -> None:
    never = threading.Event()
    t = threading.Thread(target=never.wait, args=(30,), daemon=True)
    t.start()
    monkeypatch.setattr(tsd, "_stuck_teardowns", [t])
    monkeypatch.setattr(tsd, "_reset_all_graphs", lambda: None)
    codes = []
    monkeypatch.setattr(tsd.os, "_exit", codes.append)
    tsd._exit_guard(wait_s=0.2)
    never.set()
    t.join(5)
    assert codes == [1]
