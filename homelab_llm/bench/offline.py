"""`bench offline`: the depth/concurrency table from the engine itself, no HTTP.

For GPU runs with dummy weights (`--load-format dummy` and a model_configs JSON): no tokenizer or
checkpoint needed, and prompts are random token ids, so PP and depth are exact token counts.
The same rows, arithmetic and table as `bench depth` (metrics.py); times come from the engine
loop: `start` is the add_request time, a token's time is when the step that made it returned.
Latency is 0: there is no network to subtract, so TTFR = TTFT = est_ppt.

API (synchronous: the engine is not thread-safe, call it from one thread):

    engine = LLMEngine(EngineArgs(model="qwen3-8b.json", load_format="dummy", device="cuda"))
    report = run_offline(engine, OfflineConfig(pp=2048, tg=128, depths=(0, 4096)))

torch is imported only through the engine, so importing this module stays cheap.
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from homelab_llm.bench.client import BenchError
from homelab_llm.bench.depth import CacheMode, check_sizes
from homelab_llm.bench.metrics import RequestTiming
from homelab_llm.bench.sweep import (PointSpec, ProgressCallback, ProgressEvent, SweepReport,
                                     summarize)

if TYPE_CHECKING:
    from homelab_llm.engine.core import LLMEngine


@dataclass(frozen=True)
class OfflineConfig:
    pp: int = 2048
    tg: int = 128
    depths: tuple[int, ...] = (0,)
    concurrency: tuple[int, ...] = (1,)
    repetitions: int = 3
    mode: CacheMode = "cold"
    seed: int = 0
    warmup: bool = True

    def points(self) -> list[PointSpec]:
        check_sizes(self.pp, self.tg, self.depths, self.repetitions)
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise BenchError(f"--concurrency levels must be >= 1, got {list(self.concurrency)}")
        modes = ("cold", "cached") if self.mode == "both" else (self.mode,)
        points = [PointSpec(d, self.pp, self.tg, c, m) for d in self.depths
                  for c in self.concurrency for m in modes if not (m == "cached" and d == 0)]
        if not points:
            raise BenchError("--mode cached needs a --depth above 0 (no context, nothing to cache)")
        return points


def run_offline(engine: "LLMEngine", config: OfflineConfig, *, report: SweepReport | None = None,
                on_progress: ProgressCallback | None = None) -> SweepReport:
    from homelab_llm.engine.sampling_params import SamplingParams

    points = config.points()
    longest = max(p.depth + p.pp + p.tg for p in points)
    if longest > engine.max_model_len:
        raise BenchError(f"depth + pp + tg = {longest} tokens exceeds the engine's max_model_len "
                         f"{engine.max_model_len}; lower --depth or raise --max-model-len")
    report = report or SweepReport("offline", engine.model_name, "engine")
    report.model = engine.model_name
    report.token_source, report.output_token_source = "exact (token ids)", "engine"
    vocab = engine.model_config.vocab_size
    ids = itertools.count()
    run = _Runner(engine, ids)
    timed = SamplingParams(max_tokens=config.tg, ignore_eos=True, temperature=0.0)
    load = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    if config.warmup:  # kernels compile and graphs capture on first use: keep that out
        run.batch([_tokens(random.Random(-1), vocab, min(64, config.pp))], timed)
    total, done = len(points) * config.repetitions, 0
    for p_index, point in enumerate(points):
        batches: list[list[RequestTiming]] = []
        counted: list[list[int]] = []
        try:
            for rep in range(config.repetitions):
                if on_progress:
                    on_progress(ProgressEvent(done, total,
                                              f"{point.label}, run {rep + 1}/{config.repetitions}"))
                rng = random.Random(f"{config.seed}/{p_index}/{rep}")
                contexts = [_tokens(rng, vocab, point.depth) for _ in range(point.concurrency)]
                prompts = [_tokens(rng, vocab, point.pp) for _ in range(point.concurrency)]
                if point.mode == "cached":
                    run.batch([c + prompt[:1] for c, prompt in zip(contexts, prompts)], load)
                batches.append(run.batch([c + p for c, p in zip(contexts, prompts)], timed))
                counted.append([point.pp if point.mode == "cached" else point.depth + point.pp]
                               * point.concurrency)
                done += 1
        finally:  # Ctrl+C: the repetitions finished so far still make a row
            if batches:
                report.rows.append(summarize(point, batches, counted, 0.0))
    if on_progress:
        on_progress(ProgressEvent(done, total, "done"))
    return report


def _tokens(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


class _Runner:
    def __init__(self, engine: "LLMEngine", ids: "itertools.count[int]") -> None:
        self.engine, self.ids = engine, ids

    def batch(self, prompts: list[list[int]], params: object) -> list[RequestTiming]:
        """Add all prompts at once and step until they finish; abort them if interrupted."""
        engine = self.engine
        timings: dict[str, RequestTiming] = {}
        try:
            for prompt in prompts:
                rid = f"bench-{next(self.ids)}"
                now = time.monotonic()
                timings[rid] = RequestTiming(start=now)
                engine.add_request(rid, prompt, params, arrival_time=now)  # type: ignore[arg-type]
            pending = set(timings)
            while pending:
                outputs = engine.step()
                now = time.monotonic()
                for out in outputs:
                    t = timings.get(out.request_id)
                    if t is None:
                        continue
                    if out.new_token_ids:
                        if t.first_token is None:
                            t.first_token = t.first_response = now
                        t.token_times.append(now)
                    if out.finished:
                        pending.discard(out.request_id)
                        t.end = now
                        t.prompt_tokens = out.num_prompt_tokens
                        t.cached_tokens = out.num_cached_tokens
                        t.completion_tokens = out.num_output_tokens
                        t.finish_reason = out.finish_reason
                        if out.finish_reason in ("abort", "error"):
                            t.error = out.error or out.finish_reason
        except BaseException:
            for rid in timings:
                engine.abort_request(rid)
            while engine.has_unfinished_requests():  # let the aborts drain, pages come back
                engine.step()
            raise
        return list(timings.values())
