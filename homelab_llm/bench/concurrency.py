"""`bench concurrency`: c streams at once (c over a list of levels) at one depth; per level the
TTFT, the per-stream decode tok/s and the aggregate ("total") prompt and decode tok/s.

API, like `depth.run_depth`:

    report = SweepReport("concurrency", model="", target=client.root)
    await run_concurrency(client, ConcurrencyConfig(levels=(1, 2, 4, 8)), report=report,
                          on_progress=callback)

Each level is a separate row; cancelling keeps the finished levels and repetitions.
"""

from __future__ import annotations

from dataclasses import dataclass

from homelab_llm.bench.client import BenchClient, BenchError
from homelab_llm.bench.depth import CacheMode, check_sizes
from homelab_llm.bench.prompts import TokenCounter
from homelab_llm.bench.sweep import (PointSpec, ProgressCallback, SweepOptions, SweepReport,
                                     run_points)


@dataclass(frozen=True)
class ConcurrencyConfig:
    pp: int = 2048
    tg: int = 128
    depth: int = 0
    levels: tuple[int, ...] = (1, 2, 4, 8)
    repetitions: int = 3
    mode: CacheMode = "cold"
    options: SweepOptions = SweepOptions()

    def points(self) -> list[PointSpec]:
        check_sizes(self.pp, self.tg, (self.depth,), self.repetitions)
        if not self.levels or any(c < 1 for c in self.levels):
            raise BenchError(f"--concurrency levels must be >= 1, got {list(self.levels)}")
        modes = ("cold", "cached") if self.mode == "both" else (self.mode,)
        if self.mode == "cached" and self.depth == 0:
            raise BenchError("--mode cached needs --depth above 0 (no context, nothing to cache)")
        return [PointSpec(self.depth, self.pp, self.tg, c, m) for c in self.levels for m in modes
                if not (m == "cached" and self.depth == 0)]


async def run_concurrency(client: BenchClient, config: ConcurrencyConfig, *,
                          report: SweepReport | None = None, counter: TokenCounter | None = None,
                          on_progress: ProgressCallback | None = None) -> SweepReport:
    points = config.points()
    model = await client.resolve_model()
    report = report or SweepReport("concurrency", model, client.root)
    report.model = model
    counter = counter or await TokenCounter.pick(client, None)
    options = SweepOptions(**{**config.options.__dict__, "repetitions": config.repetitions})
    return await run_points(client, counter, points, options, report, on_progress)
