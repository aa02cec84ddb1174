"""Cancelling a sweep task (what the TUI's stop button and Ctrl+C do): requests in flight are
closed, so the server aborts them, and the report keeps everything that finished."""

from __future__ import annotations

import asyncio

from homelab_llm.bench.client import BenchClient
from homelab_llm.bench.depth import DepthConfig, run_depth
from homelab_llm.bench.serve import ServeConfig, ServeReport, run_serve
from homelab_llm.bench.sweep import SweepOptions, SweepReport
from tests.bench.fake_openai import FakeOpenAI, Script, serve_fake


async def _until(predicate, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_cancelled_depth_sweep_keeps_finished_repetitions():
    server = FakeOpenAI(Script(itl=0.05))  # 20 tokens: 1 s per request
    async with serve_fake(server) as url, BenchClient(url) as client:
        report = SweepReport("depth", "", url)
        config = DepthConfig(pp=8, tg=20, depths=(0,), repetitions=3, concurrency=2,
                             options=SweepOptions(warmup=False, measure_latency=False))
        task = asyncio.ensure_future(run_depth(client, config, report=report))
        await _until(lambda: len(server.requests) == 4)  # repetition 2's two streams started
        await asyncio.sleep(0.2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await _until(lambda: server.aborted == 2)
    assert task.cancelled()
    (row,) = report.rows
    assert row.runs == 1 and row.failed == 0 and row.output_tokens == 20


async def test_cancelled_serve_run_keeps_finished_requests():
    server = FakeOpenAI(Script(itl=0.02))
    async with serve_fake(server) as url, BenchClient(url) as client:
        config = ServeConfig(num_prompts=6, input_len=8, output_len=10, max_concurrency=2)
        report = ServeReport("", url, config)
        task = asyncio.ensure_future(run_serve(client, config, report=report))
        # Cancel with a stream in flight (two done, a third started), or nothing is left to abort.
        await _until(lambda: len(report.timings) >= 2 and len(server.requests) > len(report.timings))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await _until(lambda: server.aborted >= 1)
    assert 2 <= len(report.timings) < 6 and all(t.ok for t in report.timings)
    assert report.metrics()["completed"] == len(report.timings)
