"""Server-side request statistics, fed every RequestOutput on the event loop: token counters,
latency histograms (for /metrics) and a sliding window plus recent samples (for /v1/status)."""

from __future__ import annotations

import bisect
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from homelab_llm.engine.outputs import RequestOutput

# Bucket edges in seconds: sub-millisecond resolution is noise on an HTTP API, and agent turns
# with long prompts can take minutes to first token on a CPU.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 10.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


@dataclass
class Histogram:
    buckets: Sequence[float]
    counts: list[int] = field(default_factory=list)  # per bucket, non-cumulative; last = +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, cumulative count) pairs in Prometheus order, ending with +Inf."""
        out, running = [], 0
        for edge, n in zip([*map(str, self.buckets), "+Inf"], self.counts):
            running += n
            out.append((edge, running))
        return out


def percentile(samples: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None without samples."""
    if not samples:
        return None
    ordered = sorted(samples)
    pos = (len(ordered) - 1) * q
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


class ServerStats:
    def __init__(self, window_s: float = 10.0, max_samples: int = 1000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self.start_time = clock()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished = Counter[str]()  # finish_reason -> requests
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self._recent_ttft: deque[float] = deque(maxlen=max_samples)
        self._recent_tpot: deque[float] = deque(maxlen=max_samples)
        self._window: deque[tuple[float, int, int]] = deque()  # (time, prompt, generated)
        self._prompt_counted: set[str] = set()

    def observe(self, out: RequestOutput) -> None:
        now = self.clock()
        prompt = 0
        # The prompt counts once, when it has been processed (the first output), or at the end
        # for a request that finished before producing anything.
        if (out.new_token_ids or out.finished) and out.request_id not in self._prompt_counted:
            self._prompt_counted.add(out.request_id)
            prompt = out.num_prompt_tokens
        generated = len(out.new_token_ids)
        self.prompt_tokens_total += prompt
        self.generation_tokens_total += generated
        if prompt or generated:
            self._window.append((now, prompt, generated))
            self._prune(now)  # bounded even when nobody reads /v1/status
        if out.finished:
            self._prompt_counted.discard(out.request_id)
            self._finish(out)

    def _finish(self, out: RequestOutput) -> None:
        self.finished[out.finish_reason or "stop"] += 1
        if not out.arrival_time:  # synthesized locally (abort before the engine reported)
            return
        if out.first_token_time is not None:
            ttft = out.first_token_time - out.arrival_time
            self.ttft.observe(ttft)
            self._recent_ttft.append(ttft)
            if out.finish_time is not None and out.num_output_tokens > 1:
                tpot = (out.finish_time - out.first_token_time) / (out.num_output_tokens - 1)
                self.tpot.observe(tpot)
                self._recent_tpot.append(tpot)
        if out.finish_time is not None:
            self.e2e.observe(out.finish_time - out.arrival_time)

    def _prune(self, now: float) -> None:
        while self._window and self._window[0][0] < now - self.window_s:
            self._window.popleft()

    def throughput(self) -> dict[str, float]:
        now = self.clock()
        self._prune(now)
        # Early on, divide by the time actually observed rather than the full window.
        span = max(min(self.window_s, now - self.start_time), 1e-3)
        prompt = sum(p for _, p, _ in self._window)
        generated = sum(g for _, _, g in self._window)
        return {"prompt_tps": prompt / span, "generation_tps": generated / span}

    def latency(self) -> dict[str, float | None]:
        return {"ttft_p50": percentile(self._recent_ttft, 0.5),
                "ttft_p95": percentile(self._recent_ttft, 0.95),
                "tpot_p50": percentile(self._recent_tpot, 0.5),
                "tpot_p95": percentile(self._recent_tpot, 0.95)}

    def uptime(self) -> float:
        return self.clock() - self.start_time
