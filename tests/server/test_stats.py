"""Server statistics on a virtual clock: histograms, percentiles, the throughput window."""

from __future__ import annotations

import pytest

from homelab_llm.engine.outputs import RequestOutput
from homelab_llm.server.metrics import render_metrics
from homelab_llm.server.stats import Histogram, ServerStats, percentile


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_percentile_interpolates() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3.0], 0.95) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.5, abs=1e-12)
    assert percentile(list(map(float, range(101))), 0.95) == pytest.approx(95.0, abs=1e-12)


def test_histogram_is_cumulative_with_inf() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 7.0):
        h.observe(v)
    assert h.cumulative() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]
    assert h.count == 4 and h.total == pytest.approx(7.65, abs=1e-12)


def out(rid: str, n: int, **kw) -> RequestOutput:
    return RequestOutput(rid, list(range(n)), "x" * n, num_prompt_tokens=10, **kw)


def test_observe_counts_latency_and_window() -> None:
    clock = Clock()
    stats = ServerStats(window_s=10.0, clock=clock)
    clock.now = 110.0
    stats.observe(out("a", 1, arrival_time=109.0, first_token_time=109.5))
    stats.observe(out("a", 4, num_output_tokens=5, finished=True, finish_reason="length",
                      arrival_time=109.0, first_token_time=109.5, finish_time=110.5))
    assert stats.prompt_tokens_total == 10 and stats.generation_tokens_total == 5
    assert stats.finished == {"length": 1}
    assert stats.latency() == {"ttft_p50": 0.5, "ttft_p95": 0.5, "tpot_p50": 0.25, "tpot_p95": 0.25}
    assert stats.throughput() == {"prompt_tps": 1.0, "generation_tps": 0.5}
    clock.now = 125.0  # the window has moved past both events
    assert stats.throughput() == {"prompt_tps": 0.0, "generation_tps": 0.0}
    assert stats.uptime() == 25.0


def test_locally_aborted_output_counts_without_latency() -> None:
    stats = ServerStats(clock=Clock())
    stats.observe(RequestOutput("b", [], "", finished=True, finish_reason="abort"))
    assert stats.finished == {"abort": 1} and stats.ttft.count == 0 and stats.e2e.count == 0


def test_metrics_escape_label_values() -> None:
    text = render_metrics({}, ServerStats(clock=Clock()), 'we"ird\\name')
    assert 'model_name="we\\"ird\\\\name"' in text
    assert text.endswith("\n")


def test_window_stays_bounded_without_readers() -> None:
    clock = Clock()
    stats = ServerStats(window_s=1.0, clock=clock)
    for i in range(1000):
        clock.now += 0.1
        stats.observe(out(f"r{i}", 1))
    assert len(stats._window) <= 11  # 1 s of events at 10 per second
