"""One benchmark sweep from the Bench screen, run on its own event loop in a worker thread.

Why a thread and not an async worker on the app's loop: a sweep also does CPU work (synthesising
and sizing 100K-token prompts, parsing thousands of SSE events), which would stall key presses
and redraws. The job reports through one callback (`JobUpdate`s, from the worker thread: the
screen posts them as messages), and `cancel()` may be called from any thread: it cancels the
sweep task, which closes the requests in flight (the server aborts them) and keeps the finished
rows in the report, as the bench room promises.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

from homelab_llm.bench.client import BenchClient
from homelab_llm.bench.concurrency import ConcurrencyConfig, run_concurrency
from homelab_llm.bench.depth import DepthConfig, run_depth
from homelab_llm.bench.replay import ReplayReport, load_trace, run_replay
from homelab_llm.bench.sweep import ProgressEvent, SweepReport
from homelab_llm.errors import HomelabError
from homelab_llm.tui.bench_form import BenchSpec

Report = SweepReport | ReplayReport


@dataclass(frozen=True)
class JobUpdate:
    """What the screen shows. `report` is a copy the worker no longer touches."""

    done: int
    total: int
    label: str
    report: Report
    finished: bool = False
    cancelled: bool = False
    error: str | None = None


def _copy(report: Report) -> Report:
    if isinstance(report, SweepReport):
        return replace(report, rows=list(report.rows))
    return replace(report, turns=list(report.turns))


def empty_report(spec: BenchSpec) -> Report:
    if spec.kind == "replay":
        return ReplayReport(spec.trace, "", spec.target)
    return SweepReport(spec.kind, "", spec.target)


class BenchJob:
    def __init__(self, spec: BenchSpec, on_update: Callable[[JobUpdate], None]) -> None:
        self.spec = spec
        self.on_update = on_update
        self.report: Report = empty_report(spec)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[Report] | None = None
        self._cancelled = threading.Event()
        self._done = threading.Event()
        self._progress = ProgressEvent(0, spec.total_units, "connecting…")

    @property
    def running(self) -> bool:
        return not self._done.is_set()

    def run(self) -> None:
        """Blocking: the whole sweep. Call it in a worker thread; it never raises."""
        try:
            asyncio.run(self._main())
        finally:
            self._done.set()

    def cancel(self) -> None:
        self._cancelled.set()
        loop, task = self._loop, self._task
        if loop is not None and task is not None:
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # the loop already closed: the job is over anyway
                pass

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()  # type: ignore[assignment]
        error: str | None = None
        cancelled = False
        try:
            if self._cancelled.is_set():  # cancelled before the loop existed
                raise asyncio.CancelledError
            async with BenchClient(self.spec.target, api_key=self.spec.api_key) as client:
                await self._sweep(client)
        except asyncio.CancelledError:
            cancelled = True
        except HomelabError as err:
            error = str(err)
        except Exception as err:  # a bug or an odd server must not take the app down
            error = f"{type(err).__name__}: {err}"
        self.report.interrupted = cancelled or error is not None
        last = self._progress
        label = "cancelled: partial results kept" if cancelled else (
            "failed" if error else "done")
        self.on_update(JobUpdate(last.done, last.total, label, _copy(self.report), finished=True,
                                 cancelled=cancelled, error=error))

    async def _sweep(self, client: BenchClient) -> None:
        spec = self.spec
        if spec.kind == "depth":
            config = DepthConfig(pp=spec.pp, tg=spec.tg, depths=spec.points,
                                 repetitions=spec.repetitions)
            await run_depth(client, config, report=self.report,  # type: ignore[arg-type]
                            on_progress=self._on_progress)
        elif spec.kind == "concurrency":
            cconfig = ConcurrencyConfig(pp=spec.pp, tg=spec.tg, depth=spec.depth,
                                        levels=spec.points, repetitions=spec.repetitions)
            await run_concurrency(client, cconfig, report=self.report,  # type: ignore[arg-type]
                                  on_progress=self._on_progress)
        else:
            trace = load_trace(spec.trace)
            await run_replay(client, trace, report=self.report,  # type: ignore[arg-type]
                             max_turns=spec.max_turns, on_progress=self._on_progress)

    def _on_progress(self, event: ProgressEvent) -> None:
        self._progress = event
        self.on_update(JobUpdate(event.done, event.total, event.label, _copy(self.report)))
