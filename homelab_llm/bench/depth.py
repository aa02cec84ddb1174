"""`bench depth`: llama-benchy's table — PP prompt tokens at context depths D, TG generated tokens.

API (the TUI's Bench screen uses this; no terminal needed):

    async with BenchClient("http://127.0.0.1:8000") as client:
        report = SweepReport("depth", model="", target=client.root)   # partial rows land here
        await run_depth(client, DepthConfig(pp=2048, tg=128, depths=(0, 4096, 8192)),
                        report=report, on_progress=lambda ev: print(ev.done, ev.total, ev.label))
        report.rows  # list[BenchRow]: pp_tps, tg_tps, ttft_s ... as Stat(mean, std, n)

Cancel the task to stop: in-flight requests are cancelled and `report` keeps what finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from homelab_llm.bench.client import BenchClient, BenchError
from homelab_llm.bench.prompts import TokenCounter
from homelab_llm.bench.sweep import (PointSpec, ProgressCallback, SweepOptions, SweepReport,
                                     run_points)

CacheMode = Literal["cold", "cached", "both"]


@dataclass(frozen=True)
class DepthConfig:
    pp: int = 2048
    tg: int = 128
    depths: tuple[int, ...] = (0,)
    repetitions: int = 3
    mode: CacheMode = "cold"
    concurrency: int = 1
    options: SweepOptions = SweepOptions()

    def points(self) -> list[PointSpec]:
        check_sizes(self.pp, self.tg, self.depths, self.repetitions)
        if self.concurrency < 1:
            raise BenchError(f"--concurrency must be >= 1, got {self.concurrency}")
        modes = ("cold", "cached") if self.mode == "both" else (self.mode,)
        # Cached mode at depth 0 is the same measurement as cold: no context to cache.
        points = [PointSpec(d, self.pp, self.tg, self.concurrency, m)
                  for d in self.depths for m in modes if not (m == "cached" and d == 0)]
        if not points:
            raise BenchError("--mode cached needs a --depth above 0 (no context, nothing to cache)")
        return points


def check_sizes(pp: int, tg: int, depths: tuple[int, ...], repetitions: int) -> None:
    if pp < 1:
        raise BenchError(f"--pp must be >= 1, got {pp}")
    if tg < 2:
        raise BenchError(f"--tg must be >= 2 (decode speed needs two tokens), got {tg}")
    if any(d < 0 for d in depths):
        raise BenchError(f"--depth values must be >= 0, got {list(depths)}")
    if repetitions < 1:
        raise BenchError(f"--repetitions must be >= 1, got {repetitions}")


async def run_depth(client: BenchClient, config: DepthConfig, *, report: SweepReport | None = None,
                    counter: TokenCounter | None = None,
                    on_progress: ProgressCallback | None = None) -> SweepReport:
    points = config.points()
    model = await client.resolve_model()
    report = report or SweepReport("depth", model, client.root)
    report.model = model
    counter = counter or await TokenCounter.pick(client, None)
    options = SweepOptions(**{**config.options.__dict__, "repetitions": config.repetitions})
    return await run_points(client, counter, points, options, report, on_progress)
