"""kernels/program_trace.py's pool and benchmarks/gemv_trace_gpu.py's reading of the stamps, on
made-up stamps (the stamps themselves are PTX: gpu_compile compiles the traced GEMV for sm80 and
sm90, and the benchmark runs it on the GPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from homelab_llm.engine.kernels import program_trace
from homelab_llm.engine.kernels.program_trace import SLOTS

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "gemv_trace_gpu.py"


@pytest.fixture
def pool():
    program_trace.enable(torch.device("cpu"), rows=10)
    yield
    program_trace.disable()


def test_no_buffer_when_off_or_not_ptx(pool):
    assert program_trace.buffer(4, lambda: "a", ptx=False) is None
    program_trace.disable()
    assert program_trace.buffer(4, lambda: "a", ptx=True) is None
    assert program_trace.calls() == []


def test_slices_are_views_of_one_pool_in_launch_order(pool):
    a = program_trace.buffer(4, lambda: "a", ptx=True)
    b = program_trace.buffer(6, lambda: "b", ptx=True)
    assert a.shape == (4, SLOTS) and b.shape == (6, SLOTS)
    a.fill_(1)
    b.fill_(2)  # no overlap: a keeps its values
    assert int(a.sum()) == 4 * SLOTS and int(b.sum()) == 12 * SLOTS
    assert [c.label for c in program_trace.calls()] == ["a", "b"]
    assert program_trace.calls()[0].stamps.data_ptr() == a.data_ptr()
    with pytest.raises(RuntimeError, match="used up"):
        program_trace.buffer(1, lambda: "c", ptx=True)


def _bench():
    spec = importlib.util.spec_from_file_location("gemv_trace_gpu", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _stamps(rows: list[tuple[int, ...]]) -> torch.Tensor:
    """[programs, SLOTS] from (sm, start, waited, prologue end, loop end, exit) per program."""
    out = torch.zeros((len(rows), SLOTS), dtype=torch.int64)
    out[:, :6] = torch.tensor(rows, dtype=torch.int64)
    return out


def test_summary_of_one_launch():
    bench = _bench()
    # three programs: two on SM 5, one on SM 7; times in ns
    r = bench.program_rows(_stamps([(5, 1000, 1100, 2100, 6100, 7100),
                                    (5, 1200, 1200, 2200, 8200, 9200),
                                    (7, 1000, 1300, 2300, 5300, 6300)]))
    assert r["start"] == 1000 and r["end"] == 9200
    assert r["lead"] == pytest.approx(0.1)  # first past the wait - first start
    assert r["prologue"] == pytest.approx(1.0)
    assert r["loop"] == pytest.approx(4.0)  # median of 4.0, 6.0, 3.0
    assert r["epilogue"] == pytest.approx(1.0)
    assert r["work"] == pytest.approx(8.1)  # 9200 - 1100
    assert (r["sms"], r["most"]) == (2, 2)


def test_last_replay_keeps_the_recent_launches_in_start_order(pool):
    bench = _bench()
    old = program_trace.buffer(1, lambda: "old graph", ptx=True)
    late = program_trace.buffer(2, lambda: "second", ptx=True)
    early = program_trace.buffer(2, lambda: "first", ptx=True)
    never = program_trace.buffer(1, lambda: "never ran", ptx=True)  # all zero: skipped
    old.copy_(_stamps([(0, 1_000, 1_100, 1_200, 1_300, 1_400)]))
    late.copy_(_stamps([(1, 5_000_000, 5_000_100, 5_000_200, 5_001_000, 5_002_000)] * 2))
    early.copy_(_stamps([(2, 4_000_000, 4_000_100, 4_000_200, 4_001_000, 4_002_000)] * 2))
    assert int(never.abs().sum()) == 0
    got = bench.last_replay(step_ms=2.0)  # the launches within 2 ms of the latest end
    assert [label for label, _ in got] == ["first", "second"]
