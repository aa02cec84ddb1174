"""Benchmarks for any OpenAI-compatible server, and for the engine itself.

Sweeps are plain async functions over a `BenchClient`; each takes a progress callback
(`ProgressEvent(done, total, label)`) and a report object it fills as it goes, so a cancelled
sweep (Ctrl+C, a TUI stop button) leaves the finished rows in the report:

    from homelab_llm.bench.client import BenchClient
    from homelab_llm.bench.depth import DepthConfig, run_depth            # llama-benchy table
    from homelab_llm.bench.concurrency import ConcurrencyConfig, run_concurrency
    from homelab_llm.bench.replay import load_trace, run_replay, ReplayReport
    from homelab_llm.bench.serve import ServeConfig, run_serve, ServeReport
    from homelab_llm.bench.sweep import SweepReport, BenchRow, ProgressEvent
    from homelab_llm.bench.report import sweep_table, replay_table, serve_table
    from homelab_llm.bench.plots import plot_sweep, plot_replay, plot_serve

    async with BenchClient("http://127.0.0.1:8000") as client:
        report = SweepReport("depth", model="", target=client.root)
        await run_depth(client, DepthConfig(pp=512, tg=64, depths=(0, 4096)),
                        report=report, on_progress=callback)
    rows = report.rows          # BenchRow: pp_tps, tg_tps, ttft_s ... as Stat(mean, std, n)
    sweep_table(report)         # the aligned text table; markdown=True for markdown

`offline.run_offline(engine, OfflineConfig(...))` is the synchronous twin that drives an
LLMEngine directly. Metric definitions live in metrics.py.
"""
