"""What one streamed request measured, and the arithmetic every bench table is built from.

Definitions (times are seconds on one monotonic clock; `start` is taken just before the request
is sent). They follow llama-benchy for depth/concurrency tables and `vllm bench serve` for the
serving percentiles, so our numbers can sit next to theirs:

- TTFR  = first SSE event of any kind - start (vLLM's "TTFT" on chat: the role-only chunk counts)
- TTFT  = first event carrying generated text - start (llama-benchy's e2e_ttft; what a user sees)
- est_ppt = TTFR - latency, where latency is the measured no-work round trip (llama-benchy)
- pp tok/s = prompt tokens processed / est_ppt
- tg tok/s = (output tokens - 1) / (last token arrival - first token arrival): decode only, the
  first token belongs to prefill
- E2EL  = last event before [DONE] - start
- TPOT  = (E2EL - TTFT) / (output tokens - 1) (vLLM)
- ITL   = gaps between successive text-carrying events (vLLM; a multi-token event is one gap)
Aggregates over c concurrent streams (llama-benchy "total" t/s):
- pp tok/s = sum(prompt tokens) / (max first token - min start)
- tg tok/s = (sum(output tokens) - c) / (max last token - min first token)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class RequestTiming:
    """One request as the client saw it (or as the engine reported it, for `bench offline`)."""

    start: float
    first_response: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)  # arrival of each text-carrying event
    end: float | None = None
    prompt_tokens: int | None = None  # from usage (exact, template included) when the server sends it
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    completion_tokens: int | None = None  # from usage; else we count events
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_token is not None

    @property
    def output_tokens(self) -> int:
        if self.completion_tokens is not None:
            return self.completion_tokens
        return len(self.token_times)

    @property
    def output_token_source(self) -> str:
        return "usage" if self.completion_tokens is not None else "chunks"

    @property
    def last_token(self) -> float | None:
        return self.token_times[-1] if self.token_times else None

    @property
    def ttfr(self) -> float | None:
        return None if self.first_response is None else self.first_response - self.start

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def e2el(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def tg_tps(self) -> float | None:
        n = self.output_tokens
        if n < 2 or self.first_token is None or self.last_token is None:
            return None
        decode = self.last_token - self.first_token
        return (n - 1) / decode if decode > 0 else None

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        if n < 2 or self.e2el is None or self.ttft is None:
            return None
        return (self.e2el - self.ttft) / (n - 1)

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    def est_ppt(self, latency: float) -> float | None:
        ttfr = self.ttfr
        return None if ttfr is None else max(0.0, ttfr - latency)

    def pp_tps(self, prompt_tokens: int, latency: float) -> float | None:
        ppt = self.est_ppt(latency)
        return prompt_tokens / ppt if ppt else None


def aggregate_pp_tps(timings: list[RequestTiming], prompt_tokens: list[int]) -> float | None:
    """Prompt tokens of all streams over the wall time until the last stream's first token."""
    ok = [(t, p) for t, p in zip(timings, prompt_tokens) if t.ok]
    if not ok:
        return None
    span = max(t.first_token for t, _ in ok) - min(t.start for t, _ in ok)  # type: ignore[type-var]
    return sum(p for _, p in ok) / span if span > 0 else None


def aggregate_tg_tps(timings: list[RequestTiming]) -> float | None:
    """Decode tokens of all streams (each stream's first token excluded) over the decode window."""
    ok = [t for t in timings if t.ok and t.last_token is not None]
    if not ok:
        return None
    tokens = sum(t.output_tokens for t in ok) - len(ok)
    span = max(t.last_token for t in ok) - min(t.first_token for t in ok)  # type: ignore[type-var]
    return tokens / span if span > 0 and tokens > 0 else None


@dataclass(frozen=True)
class Stat:
    """Summary of one metric over repetitions. std is the population std (llama-benchy's)."""

    mean: float | None
    std: float | None
    n: int

    @classmethod
    def of(cls, values: list[float | None]) -> "Stat":
        xs = [v for v in values if v is not None]
        if not xs:
            return cls(None, None, 0)
        m = sum(xs) / len(xs)
        return cls(m, math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs)), len(xs))

    def scaled(self, k: float) -> "Stat":
        return Stat(None if self.mean is None else self.mean * k,
                    None if self.std is None else self.std * k, self.n)


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: list[float]) -> float | None:
    return percentile(values, 50.0)


def cv(values: list[float]) -> float | None:
    """Coefficient of variation (population std / mean): how even the turns of a replay are."""
    s = Stat.of(list(values))
    if s.mean in (None, 0.0) or s.std is None:
        return None
    return s.std / s.mean
