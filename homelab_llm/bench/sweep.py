"""The measurement loop shared by `bench depth` and `bench concurrency`: one point = PP prompt
tokens at context depth D, TG generated tokens, c streams at once, repeated; one row per point.

Cold mode sends context and prompt in one request, so the timed prefill covers D + PP tokens.
Cached mode first sends the context alone (a "." user turn, one token out) to fill the server's
prefix cache, then times context + prompt, so only the PP new tokens need prefill. Every request
gets fresh text (seeded by point, repetition and stream), so nothing is cached by accident.

Partial results: a row is appended as soon as its repetitions are done; when the sweep is
cancelled (Ctrl+C, the TUI's stop button) the repetitions finished so far still make a row, and
in-flight requests are cancelled with their connections.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from homelab_llm.bench.client import BenchClient, Message
from homelab_llm.bench.metrics import RequestTiming, Stat, aggregate_pp_tps, aggregate_tg_tps
from homelab_llm.bench.prompts import TokenCounter, text_of_tokens

Mode = Literal["cold", "cached"]
CONTEXT_LOAD_PROMPT = "."  # some servers reject an empty user turn


@dataclass(frozen=True)
class ProgressEvent:
    done: int  # units finished (a unit is one repetition of one point, or one replay turn)
    total: int
    label: str  # what is running now, e.g. "pp2048 @ d4096 cold, run 2/3"


ProgressCallback = Callable[[ProgressEvent], None]


@dataclass(frozen=True)
class PointSpec:
    depth: int
    pp: int
    tg: int
    concurrency: int = 1
    mode: Mode = "cold"

    @property
    def label(self) -> str:
        text = f"pp{self.pp}" + (f" @ d{self.depth}" if self.depth else "")
        return text + (f" c{self.concurrency}" if self.concurrency > 1 else "") + f" {self.mode}"


@dataclass
class BenchRow:
    """One point's summary over its repetitions. Speeds for c > 1 are the aggregate ("total")."""

    mode: str
    depth: int
    pp: int
    tg: int
    concurrency: int
    runs: int  # repetitions measured
    failed: int  # requests that failed
    pp_tps: Stat
    tg_tps: Stat
    tg_tps_stream: Stat  # per-stream decode speed (equals tg_tps when c == 1)
    ttfr_s: Stat
    est_ppt_s: Stat
    ttft_s: Stat
    prompt_tokens: float | None  # mean tokens the pp rate counts (new tokens in cached mode)
    cached_tokens: float | None  # mean reported by the server, if it reports it
    output_tokens: float | None
    errors: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "mode": self.mode, "depth": self.depth, "pp": self.pp, "tg": self.tg,
            "concurrency": self.concurrency, "runs": self.runs, "failed": self.failed}
        for name in ("pp_tps", "tg_tps", "tg_tps_stream", "ttfr_s", "est_ppt_s", "ttft_s"):
            stat: Stat = getattr(self, name)
            out[name], out[f"{name}_std"] = stat.mean, stat.std
        out.update(prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
                   output_tokens=self.output_tokens, errors=self.errors[:5])
        return out


@dataclass
class SweepReport:
    kind: str  # "depth" | "concurrency" | "offline"
    model: str
    target: str  # base URL, or "engine" for offline runs
    token_source: str = ""
    output_token_source: str = ""
    latency_s: float = 0.0
    rows: list[BenchRow] = field(default_factory=list)
    interrupted: bool = False
    date: str = field(default_factory=lambda: _dt.datetime.now().isoformat(timespec="seconds"))

    def to_json(self) -> dict[str, object]:
        return {"kind": self.kind, "model": self.model, "target": self.target, "date": self.date,
                "token_source": self.token_source, "output_token_source": self.output_token_source,
                "latency_s": self.latency_s, "interrupted": self.interrupted,
                "results": [r.to_json() for r in self.rows]}


def summarize(point: PointSpec, batches: list[list[RequestTiming]], counted: list[list[int]],
              latency: float) -> BenchRow:
    """Rows from timings; `counted[r][i]` is the client-side token count of request i of rep r
    (context + prompt in cold mode, prompt alone in cached mode), used when usage is missing."""
    pp_rates, tg_rates, stream_rates = [], [], []
    ttfr, ppt, ttft, prompt_sizes, cached, outputs, errors = [], [], [], [], [], [], []
    failed = 0
    for timings, counts in zip(batches, counted):
        sizes = [_prompt_size(t, n, point.mode) for t, n in zip(timings, counts)]
        for t, size in zip(timings, sizes):
            if not t.ok:
                failed += 1
                errors.append(t.error or "no tokens")
                continue
            ttfr.append(t.ttfr)
            ppt.append(t.est_ppt(latency))
            ttft.append(t.ttft)
            stream_rates.append(t.tg_tps)
            prompt_sizes.append(size)
            outputs.append(t.output_tokens)
            if t.cached_tokens is not None:
                cached.append(t.cached_tokens)
            if point.concurrency == 1:
                pp_rates.append(t.pp_tps(size, latency))
                tg_rates.append(t.tg_tps)
        if point.concurrency > 1:
            pp_rates.append(aggregate_pp_tps(timings, sizes))
            tg_rates.append(aggregate_tg_tps(timings))
    return BenchRow(
        mode=point.mode, depth=point.depth, pp=point.pp, tg=point.tg,
        concurrency=point.concurrency, runs=len(batches), failed=failed,
        pp_tps=Stat.of(pp_rates), tg_tps=Stat.of(tg_rates), tg_tps_stream=Stat.of(stream_rates),
        ttfr_s=Stat.of(ttfr), est_ppt_s=Stat.of(ppt), ttft_s=Stat.of(ttft),
        prompt_tokens=_mean(prompt_sizes), cached_tokens=_mean(cached), output_tokens=_mean(outputs),
        errors=errors)


def _prompt_size(t: RequestTiming, counted: int, mode: Mode) -> int:
    """Tokens the server had to prefill: usage is exact (it includes the chat template)."""
    if mode == "cold":
        return t.prompt_tokens if t.prompt_tokens is not None else counted
    if t.prompt_tokens is not None and t.cached_tokens is not None:
        return t.prompt_tokens - t.cached_tokens
    return counted


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


@dataclass(frozen=True)
class SweepOptions:
    repetitions: int = 3
    no_cache: bool = False  # also ask the server not to cache (llama.cpp's cache_prompt: false)
    ignore_eos: bool = True
    seed: int = 0
    warmup: bool = True
    measure_latency: bool = True


async def run_points(client: BenchClient, counter: TokenCounter, points: list[PointSpec],
                     opts: SweepOptions, report: SweepReport,
                     on_progress: ProgressCallback | None = None) -> SweepReport:
    """Measure each point `opts.repetitions` times, appending one row per point to `report`."""
    report.token_source = counter.source
    total = len(points) * opts.repetitions
    done = 0
    if opts.warmup:  # first-request costs (graph capture, lazy allocation) stay out of the table
        await client.stream_chat([{"role": "user", "content": "Hello"}], 4, ignore_eos=True)
    if opts.measure_latency:
        report.latency_s = await client.latency()
    for p_index, point in enumerate(points):
        batches: list[list[RequestTiming]] = []
        counted: list[list[int]] = []
        try:
            for rep in range(opts.repetitions):
                if on_progress:
                    on_progress(ProgressEvent(done, total, f"{point.label}, run {rep + 1}/{opts.repetitions}"))
                seeds = [_seed(opts.seed, p_index, rep, i) for i in range(point.concurrency)]
                requests = [await _build(counter, point, s) for s in seeds]
                loads: list[RequestTiming] = []
                if point.mode == "cached":
                    loads = list(await asyncio.gather(*(client.stream_chat(
                        load, 1, ignore_eos=True) for load, _, _ in requests)))
                timings = await asyncio.gather(*(client.stream_chat(
                    msgs, point.tg, ignore_eos=opts.ignore_eos, no_cache=opts.no_cache)
                    for _, msgs, _ in requests))
                for load, timed in zip(loads, timings):
                    if load.error and timed.error is None:  # the timed run was not cached
                        timed.error = f"context load failed: {load.error}"
                batches.append(list(timings))
                counted.append([n for _, _, n in requests])
                done += 1
        finally:  # also on cancellation: the repetitions already measured are kept
            if batches:
                report.rows.append(summarize(point, batches, counted, report.latency_s))
                sources = {t.output_token_source for b in batches for t in b if t.ok}
                report.output_token_source = "usage" if sources == {"usage"} else (
                    "chunks" if sources else report.output_token_source)
    if on_progress:
        on_progress(ProgressEvent(done, total, "done"))
    return report


def _seed(base: int, point: int, rep: int, stream: int) -> int:
    return ((base * 1_000_003 + point) * 1_009 + rep) * 1_013 + stream


async def _build(counter: TokenCounter, point: PointSpec,
                 seed: int) -> tuple[list[Message], list[Message], int]:
    """(context-load messages, timed messages, counted tokens the pp rate falls back on)."""
    prompt, n_prompt = await text_of_tokens(counter, point.pp, seed * 2 + 1)
    if point.depth == 0:
        msgs = [{"role": "user", "content": prompt}]
        return msgs, msgs, n_prompt
    context, n_context = await text_of_tokens(counter, point.depth, seed * 2)
    load = [{"role": "system", "content": context}, {"role": "user", "content": CONTEXT_LOAD_PROMPT}]
    timed = [{"role": "system", "content": context}, {"role": "user", "content": prompt}]
    return load, timed, n_prompt if point.mode == "cached" else n_context + n_prompt
