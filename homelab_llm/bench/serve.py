"""`bench serve`: load a server with random prompts at a request rate or a max concurrency, like
`vllm bench serve`; TTFT, TPOT, ITL and E2EL at mean/p50/p90/p99, request and token throughput,
failed requests.

Arrivals are a Poisson process (seeded) at `request_rate` req/s, or all at once when it is inf;
`max_concurrency` caps the requests in flight either way.

API: `await run_serve(client, ServeConfig(num_prompts=64, max_concurrency=8), report=report)`;
`report.timings` holds every finished request if the task is cancelled; `report.to_json()`
summarises them.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import math
import random
from dataclasses import asdict, dataclass, field

from homelab_llm.bench.client import BenchClient, BenchError
from homelab_llm.bench.metrics import RequestTiming, percentile
from homelab_llm.bench.prompts import TokenCounter, synth_text, text_of_tokens
from homelab_llm.bench.sweep import ProgressCallback, ProgressEvent


@dataclass(frozen=True)
class ServeConfig:
    num_prompts: int = 100
    input_len: int = 1024
    output_len: int = 128
    request_rate: float = math.inf  # requests per second
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = True

    def validate(self) -> None:
        if self.num_prompts < 1:
            raise BenchError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.input_len < 1 or self.output_len < 1:
            raise BenchError(f"--input-len and --output-len must be >= 1, got "
                             f"{self.input_len} and {self.output_len}")
        if not self.request_rate > 0:
            raise BenchError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise BenchError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")


@dataclass(frozen=True)
class LatencyStats:
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of(cls, xs: list[float]) -> "LatencyStats":
        return cls(sum(xs) / len(xs) if xs else None, percentile(xs, 50), percentile(xs, 90),
                   percentile(xs, 99))


@dataclass
class ServeReport:
    model: str
    target: str
    config: ServeConfig
    token_source: str = ""
    timings: list[RequestTiming] = field(default_factory=list)  # finished requests, in order
    bench_start: float | None = None
    bench_end: float | None = None
    interrupted: bool = False
    date: str = field(default_factory=lambda: _dt.datetime.now().isoformat(timespec="seconds"))

    @property
    def completed(self) -> list[RequestTiming]:
        return [t for t in self.timings if t.ok]

    @property
    def duration_s(self) -> float | None:
        if self.bench_start is None or self.bench_end is None:
            return None
        return self.bench_end - self.bench_start

    def metrics(self) -> dict[str, object]:
        ok, dur = self.completed, self.duration_s
        out_tokens = sum(t.output_tokens for t in ok)
        in_tokens = sum(t.prompt_tokens or 0 for t in ok)
        rate = (lambda n: n / dur if dur else None)
        return {
            "completed": len(ok), "failed": len(self.timings) - len(ok),
            "duration_s": dur, "request_throughput": rate(len(ok)),
            "input_tokens": in_tokens, "output_tokens": out_tokens,
            "output_throughput": rate(out_tokens), "total_token_throughput": rate(in_tokens + out_tokens),
            "ttft_s": asdict(LatencyStats.of([t.ttft for t in ok if t.ttft is not None])),
            "tpot_s": asdict(LatencyStats.of([t.tpot for t in ok if t.tpot is not None])),
            "itl_s": asdict(LatencyStats.of([x for t in ok for x in t.itl])),
            "e2el_s": asdict(LatencyStats.of([t.e2el for t in ok if t.e2el is not None])),
            "errors": sorted({t.error for t in self.timings if t.error})[:5],
        }

    def to_json(self) -> dict[str, object]:
        cfg = asdict(self.config)
        cfg["request_rate"] = None if math.isinf(self.config.request_rate) else self.config.request_rate
        return {"kind": "serve", "model": self.model, "target": self.target, "date": self.date,
                "token_source": self.token_source, "interrupted": self.interrupted,
                "config": cfg, "results": [self.metrics()]}


async def run_serve(client: BenchClient, config: ServeConfig, *, report: ServeReport | None = None,
                    counter: TokenCounter | None = None,
                    on_progress: ProgressCallback | None = None) -> ServeReport:
    config.validate()
    model = await client.resolve_model()
    report = report or ServeReport(model, client.root, config)
    report.model = model
    counter = counter or await TokenCounter.pick(client, None)
    report.token_source = counter.source
    # Size one prompt by counting, then reuse its word count: counting every prompt would cost a
    # /tokenize round trip each; the true sizes come back in usage anyway.
    sample, _ = await text_of_tokens(counter, config.input_len, config.seed)
    words = len(sample.split())
    prompts = [synth_text(words, config.seed * 100_003 + i + 1) for i in range(config.num_prompts)]
    rng = random.Random(config.seed)
    gate = asyncio.Semaphore(config.max_concurrency or config.num_prompts)

    async def one(prompt: str) -> None:
        async with gate:
            t = await client.stream_chat([{"role": "user", "content": prompt}], config.output_len,
                                         ignore_eos=config.ignore_eos)
        report.timings.append(t)
        report.bench_end = client.clock()
        if on_progress:
            on_progress(ProgressEvent(len(report.timings), config.num_prompts, "requests"))

    tasks: list[asyncio.Task[None]] = []
    report.bench_start = client.clock()
    try:
        for i, prompt in enumerate(prompts):
            tasks.append(asyncio.ensure_future(one(prompt)))
            if i + 1 < len(prompts) and not math.isinf(config.request_rate):
                await asyncio.sleep(rng.expovariate(config.request_rate))
        await asyncio.gather(*tasks)
    finally:  # cancelled: stop the in-flight requests (closing their streams), keep the finished
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if on_progress:
        on_progress(ProgressEvent(config.num_prompts, config.num_prompts, "done"))
    return report
